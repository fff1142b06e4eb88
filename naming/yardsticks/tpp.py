"""tpp: SAEBench's targeted probe perturbation on a labelled store (one label column is enough).

For each class of a label column (the splits and balanced tasks of ``sparse-probing``), an L2 logistic probe on the
raw inputs. A latent's effect on class c's probe: (mean code on c's positives - on its negatives, clamped at 0) x
(its decoder row . the probe's weights), on c's training task (SAEBench ``get_effects_per_class_precomputed_acts``).
For n in :data:`N_VALUES`, the n latents with the largest non-zero effects are zero-ablated, the error term kept
(each input loses ``code[S] @ W_dec[S]``: exact for mean-pooled contexts, the decoder being linear), and every
class's probe is tested again on its test task. Per class and n: ``intended_diff_only`` (its own probe's accuracy
drop), ``unintended_diff_only`` (the mean drop of the other classes' probes) and ``total_metric`` (their
difference), averaged over the classes (SAEBench ``create_tpp_plotting_dict``): a good dictionary's class latents
hurt their own probe and no other.

Said plainly: the 2026 audit of SAEBench found SCR and TPP unreliable (they move with probe training noise and
with the choice of classes more than with the dictionary); read them beside k-sparse probing, not alone. Here the
probes are the same L2 logistic regression as sparse-probing's (SAEBench trains them with Adam); the rest is
checked against SAEBench's own functions on the fixture (tests/test_yardstick_reference.py).
"""

from __future__ import annotations

from typing import Any

import torch
from conceptdict.naming.yardsticks.sparse_probing import (
    balanced_task,
    fit_logistic,
    label_splits,
    probe_accuracy,
)

SAEBENCH_TYPE = "tpp"
N_VALUES = (2, 5, 10, 20, 50, 100, 500)
"""SAEBench's numbers of ablated latents (those above the dictionary's width are left out)."""


def effects(w: torch.Tensor, codes: torch.Tensor, labels: torch.Tensor, decoder: torch.Tensor,
            scr: bool = False) -> torch.Tensor:
    """Each latent's effect on the probe ``w`` [D + 1]: clamp(mean code pos - neg, 0) * (W_dec[j] . w) -> [L];
    ``scr`` (SAEBench's ``perform_scr``): |(mean code pos - neg) * (W_dec[j] . w)|, no clamp."""
    diff = codes[labels == 1].mean(0) - codes[labels == 0].mean(0)
    out = (diff if scr else diff.clamp_min(0)) * (decoder.double() @ w[:-1])
    return out.abs() if scr else out


def top_n(effect: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest non-zero effects (fewer when fewer are non-zero)."""
    nonzero = int((effect != 0).sum())
    return torch.topk(effect, min(n, nonzero)).indices if nonzero else torch.zeros(0, dtype=torch.long)


def tpp_scores(raw: torch.Tensor, codes: torch.Tensor, decoder: torch.Tensor, train: dict, test: dict,
               seed: int) -> dict[str, dict[str, float]]:
    """class -> {tpp_threshold_N_total_metric, ..._intended_diff_only, ..._unintended_diff_only} of one column.
    The balanced tasks are drawn in SAEBench's order, draw for draw: each class's train and test task (the probes),
    each class's test task (clean accuracy), each class's train task (effects), then for each ablated class and n,
    each class's test task."""
    g = torch.Generator().manual_seed(seed)
    classes = list(train)
    probes = {}
    for c in classes:
        tr, ytr = balanced_task(train, c, g)
        balanced_task(test, c, g)  # SAEBench tests each probe as it trains it: the draw is kept, the score not
        probes[c] = fit_logistic(raw[tr], ytr)

    def accuracies(x: torch.Tensor) -> dict:
        out = {}
        for j in classes:
            te, yte = balanced_task(test, j, g)
            out[j] = probe_accuracy(probes[j], x[te], yte)
        return out

    clean = accuracies(raw)
    effect = {}
    for c in classes:
        tr, ytr = balanced_task(train, c, g)
        effect[c] = effects(probes[c], codes[tr], ytr, decoder)
    out: dict[str, dict[str, float]] = {str(c): {} for c in classes}
    for c in classes:
        for n in (n for n in N_VALUES if n <= decoder.shape[0]):
            ablate = top_n(effect[c], n)
            patched = accuracies(raw - codes[:, ablate] @ decoder[ablate].double())
            drop = {j: clean[j] - patched[j] for j in classes}
            unintended = sum(drop[j] for j in classes if j != c) / (len(classes) - 1)
            out[str(c)].update({f"tpp_threshold_{n}_total_metric": drop[c] - unintended,
                                f"tpp_threshold_{n}_intended_diff_only": drop[c],
                                f"tpp_threshold_{n}_unintended_diff_only": unintended})
    return out


def compute(inputs) -> dict[str, Any]:
    """TPP on every label column of ``inputs.store`` with at least two classes."""
    sae = inputs.dictionary
    raw, codes, splits = label_splits(inputs)
    decoder = sae.decoder_directions().double().cpu()
    columns = {key: tpp_scores(raw, codes, decoder, train, test, inputs.seed) for key, (train, test) in splits.items()}
    per_column = {}
    for key, per_class in columns.items():
        names = next(iter(per_class.values())).keys()
        per_column[key] = {n: sum(m[n] for m in per_class.values()) / len(per_class) for n in names}
    names = next(iter(per_column.values())).keys()
    summary = {n: sum(c[n] for c in per_column.values()) / len(per_column) for n in names}
    return {"summary": summary, "details": {"columns": per_column, "per_class": columns},
            "note": "the 2026 SAEBench audit found TPP unreliable: read it beside sparse-probing"}


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's TppEvalOutput layout: ``tpp_metrics`` (what its graphing reads), one detail per label column."""
    d = result["details"]
    return {"eval_type_id": SAEBENCH_TYPE, **about, "eval_result_metrics": {"tpp_metrics": result["summary"]},
            "eval_result_details": [{"dataset_name": f"{key}_results", **v} for key, v in d["columns"].items()],
            "eval_result_unstructured": {f"{key}_results": v for key, v in d["per_class"].items()}}
