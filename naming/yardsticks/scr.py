"""scr: SAEBench's spurious correlation removal on a store with two label columns.

Two columns play SAEBench's profession and gender: column A (the one with more classes; ties: the first) gives
pairs of its most frequent classes (a+, a-) (``(c0, c1), (c2, c3), ...``, at most :data:`MAX_PAIRS`), column B
its two most frequent classes (b+, b-). Each input (a context of a token store, mean-pooled, or a row of a
sequence store: as ``sparse-probing``) falls in one of the four quadrants (a+-, b+-); the inputs of each quadrant
are split train / test as ``sparse-probing`` splits a class's. With m inputs per quadrant (m = the smallest of
the mixed quadrants (a-, b+), (a+, b-), half of each matched one (a+, b+), (a-, b-), and 1000 train / 250 test),
the three tasks of SAEBench's ``get_spurious_corr_data``:

- B: (a+, b+) + (a-, b+) against (a+, b-) + (a-, b-) (gender), m of each quadrant;
- A: (a+, b+) + (a+, b-) against (a-, b+) + (a-, b-) (profession);
- biased: (a+, b+) against (a-, b-), 2m each: A and B perfectly correlated.

A probe for each (L2 logistic on the raw inputs, as ``sparse-probing``'s). A latent's effect on a probe:
|(mean code on its train positives - negatives) x (its decoder row . the probe's weights)| (SAEBench
``get_effects_per_class_precomputed_acts`` with ``perform_scr``). For n in ``tpp.N_VALUES``, the n latents with
the largest effect on B's probe are zero-ablated (the error term kept, as ``tpp``) and the biased probe is tested
on A's test task (dir1); likewise A's latents and B's task (dir2). SCR score = (ablated accuracy - biased accuracy)
/ (the task's own probe's accuracy - biased accuracy), 0 when that gap is below 0.001 (SAEBench
``get_scr_plotting_dict``); ``scr_metric_threshold_n`` is dir1 when the biased probe does worse on A's task than on
B's, else dir2 (SAEBench leaves a tie unset; here a tie takes dir1). Results are averaged over the pairs and the
column pairs.

Said plainly: the 2026 audit of SAEBench found SCR and TPP unreliable (they move with probe training noise and
with the chosen classes more than with the dictionary); k-sparse probing was the most reliable of its metrics.
Read SCR beside ``sparse-probing``, not alone. SAEBench trains its probes with AdamW (batch 16, 20 epochs, L1
1e-3), which shapes how much the biased probe leans on B; here they are converged L2 logistic probes. The rest is
checked against SAEBench's own functions on the fixture (tests/test_yardstick_reference.py).
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Any

import torch
from conceptdict.naming.yardsticks import TooThin
from conceptdict.naming.yardsticks.sparse_probing import (
    fit_logistic,
    pooled_inputs,
    probe_accuracy,
    split,
)
from conceptdict.naming.yardsticks.tpp import N_VALUES, effects, top_n

SAEBENCH_TYPE = "scr"
MAX_PAIRS = 4
"""Class pairs of column A per column pair (SAEBench: 4 profession pairs per dataset)."""
TRAIN_PER_QUADRANT = 1000
TEST_PER_QUADRANT = 250
"""SAEBench's train_set_size 4000 and test_set_size 1000, a quarter per quadrant."""
MIN_PER_QUADRANT = 4
"""A pair runs when every one of its tasks has at least this many inputs per quadrant (m), train and test."""


def scr_tasks(quadrants: dict[tuple[int, int], torch.Tensor], cap: int) -> dict[str, tuple[torch.Tensor,
                                                                                           torch.Tensor]]:
    """{"B": ..., "A": ..., "biased": ...}: (input indices, labels 1/0) of the three tasks from the quadrants
    {(a, b): indices} (a, b = 1 for a+, b+), m of each mixed quadrant and 2m of each matched one."""
    pp, np_, pn, nn = (quadrants[q] for q in ((1, 1), (0, 1), (1, 0), (0, 0)))
    m = min(cap, len(np_), len(pn), len(pp) // 2, len(nn) // 2)
    task = lambda pos, neg: (torch.cat([pos, neg]), torch.cat([torch.ones(len(pos), dtype=torch.long),
                                                               torch.zeros(len(neg), dtype=torch.long)]))
    return {"B": task(torch.cat([pp[:m], np_[:m]]), torch.cat([pn[:m], nn[:m]])),
            "A": task(torch.cat([pp[:m], pn[:m]]), torch.cat([np_[:m], nn[:m]])),
            "biased": task(pp[:2 * m], nn[:2 * m])}


def scr_scores(raw: torch.Tensor, codes: torch.Tensor, decoder: torch.Tensor, train: dict, test: dict
               ) -> dict[str, float]:
    """scr_dir1_threshold_N, scr_dir2_threshold_N, scr_metric_threshold_N of one (a+, a-) x (b+, b-) run from its
    train / test tasks (:func:`scr_tasks`)."""
    probes = {t: fit_logistic(raw[idx], y) for t, (idx, y) in train.items()}
    acc = lambda probe, x, t: probe_accuracy(probes[probe], x[test[t][0]], test[t][1])
    clean = {t: acc(t, raw, t) for t in ("A", "B")}
    biased = {t: acc("biased", raw, t) for t in ("A", "B")}
    effect = {t: effects(probes[t], codes[train[t][0]], train[t][1], decoder, scr=True) for t in ("A", "B")}
    out: dict[str, float] = {}
    for n in (n for n in N_VALUES if n <= decoder.shape[0]):
        for d, (ablated, measured) in ((1, ("B", "A")), (2, ("A", "B"))):
            drop = top_n(effect[ablated], n)
            changed = acc("biased", raw - codes[:, drop] @ decoder[drop].double(), measured)
            gap = clean[measured] - biased[measured]
            out[f"scr_dir{d}_threshold_{n}"] = 0.0 if gap < 0.001 else (changed - biased[measured]) / gap
        out[f"scr_metric_threshold_{n}"] = out[f"scr_dir{1 if biased['A'] <= biased['B'] else 2}_threshold_{n}"]
    return out


def runs(store, first: torch.Tensor, seed: int) -> dict[str, tuple[dict, dict]]:
    """run name -> (train tasks, test tasks) for every pair of label columns with enough inputs per quadrant."""
    values = {}
    for key in store.manifest["label_keys"]:
        labels = store.labels(key)
        values[key] = [labels[int(i)] for i in first]
    out = {}
    for pair in combinations(values, 2):
        top = {k: [c for c, _ in sorted(Counter(v for v in values[k] if v is not None).items(),
                                        key=lambda cn: (-cn[1], str(cn[0])))] for k in pair}
        col_a, col_b = sorted(pair, key=lambda k: -len(top[k]))  # stable: ties keep the manifest's order
        if len(top[col_b]) < 2:
            continue
        b_pos, b_neg = sorted(top[col_b][:2], key=str)
        for i in range(0, min(len(top[col_a]) - 1, 2 * MAX_PAIRS), 2):
            a_pos, a_neg = sorted(top[col_a][i:i + 2], key=str)
            quadrant = [((a == a_pos) * 1, (b == b_pos) * 1) if a in (a_pos, a_neg) and b in (b_pos, b_neg) else None
                        for a, b in zip(values[col_a], values[col_b])]
            qs = [(1, 1), (0, 1), (1, 0), (0, 0)]
            train, test = split(qs, quadrant, torch.Generator().manual_seed(seed))
            tasks = scr_tasks(train, TRAIN_PER_QUADRANT), scr_tasks(test, TEST_PER_QUADRANT)
            if min(len(t[1]) for ts in tasks for t in ts.values()) >= 4 * MIN_PER_QUADRANT:
                out[f"{col_a}_{a_pos}_{a_neg}__{col_b}_{b_pos}_{b_neg}"] = tasks
    return out


def compute(inputs) -> dict[str, Any]:
    """SCR on every pair of label columns of ``inputs.store`` (each run: a pair of column A's classes against
    column B's two most frequent), averaged over the runs."""
    sae, store = inputs.dictionary, inputs.store
    raw, codes, first = pooled_inputs(inputs)
    found = runs(store, first, inputs.seed)
    if not found:
        raise TooThin(f"scr: no two label columns of {store.path} have {MIN_PER_QUADRANT} inputs in each of the "
                         f"four quadrants of their two most frequent classes (train and test) among the first "
                         f"{inputs.rows} rows; label more rows or pass a larger --rows")
    decoder = sae.decoder_directions().double().cpu()
    per_run = {name: scr_scores(raw, codes, decoder, train, test) for name, (train, test) in found.items()}
    names = next(iter(per_run.values())).keys()
    summary = {n: sum(r[n] for r in per_run.values()) / len(per_run) for n in names}
    return {"summary": summary, "details": {"runs": per_run, "inputs": int(raw.shape[0])},
            "note": "the 2026 SAEBench audit found SCR unreliable: read it beside sparse-probing"}


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's ScrEvalOutput layout: ``scr_metrics`` (what its graphing reads), one detail per run."""
    return {"eval_type_id": SAEBENCH_TYPE, **about, "eval_result_metrics": {"scr_metrics": result["summary"]},
            "eval_result_details": [{"dataset_name": f"{name}_results", **v}
                                    for name, v in result["details"]["runs"].items()],
            "eval_result_unstructured": None}
