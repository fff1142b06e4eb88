"""ground-truth: a dictionary against the true features of a synthetic store, as ``sae_lens.synthetic`` (sae-lens
>= 6.54, SynthSAEBench) defines the scores.

- **mcc**: the decoder rows and the true directions matched one to one by the Hungarian algorithm on |cosine|
  (``scipy.optimize.linear_sum_assignment``), the mean |cosine| of the min(L, F) matched pairs;
- **uniqueness**: each latent's best |cosine| true feature; distinct features hit / L;
- **precision / recall / f1_score / accuracy**: each latent as a binary detector (fires: code > 0) of its best
  |cosine| true feature (fires: true activation > 0) over the store's rows, each per latent (0 where undefined),
  then the mean over latents -- dead latents count, with 0;
- **true_l0, sae_l0, dead_latents, shrinkage, explained_variance** over the same rows (the last three from
  ``saes.evaluation.evaluate``: shrinkage is its l2_ratio, explained variance its textbook 1 - FVU).

Rows: the store's first ``inputs.rows`` rows (the rows the true codes describe). Without recorded codes the
per-row scores are left out and the result says so.
"""

from __future__ import annotations

from typing import Any

import torch
from conceptdict.activations.true_features import load_true_features
from conceptdict.saes.evaluation import evaluate as evaluate_rows

SAEBENCH_TYPE = "synthetic"
CHUNK = 8192


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|cos| between every row of ``a`` [A, D] and of ``b`` [B, D] -> [A, B] (float64)."""
    a, b = a.double(), b.double()
    a = a / a.norm(dim=1, keepdim=True).clamp_min(1e-8)
    b = b / b.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return (a @ b.T).abs()


def mcc(directions: torch.Tensor, true: torch.Tensor) -> float:
    """Mean |cosine| of the Hungarian matching between ``directions`` [L, D] and ``true`` [F, D]."""
    from scipy.optimize import linear_sum_assignment

    cos = cosines(directions, true)
    rows, cols = linear_sum_assignment(1 - cos.numpy())
    return float(cos[rows, cols].mean())


def uniqueness(directions: torch.Tensor, true: torch.Tensor) -> float:
    """Distinct best-matching true features / number of latents (1: every latent tracks its own feature)."""
    if directions.shape[0] == 0:
        return 0.0
    return len(cosines(directions, true).argmax(dim=1).unique()) / directions.shape[0]


def detection(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor, tn: torch.Tensor) -> dict[str, float]:
    """Mean over latents of precision, recall, F1 and accuracy from per-latent counts (0 where undefined)."""
    zero = torch.zeros_like(tp)
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1), zero)
    recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp_min(1), zero)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-30), zero)
    accuracy = (tp + tn) / (tp + fp + fn + tn).clamp_min(1e-8)
    return {"precision": float(precision.mean()), "recall": float(recall.mean()), "f1_score": float(f1.mean()),
            "accuracy": float(accuracy.mean())}


@torch.no_grad()
def compute(inputs) -> dict[str, Any]:
    """The ground-truth scores of ``inputs.dictionary`` on ``inputs.store``'s true features."""
    sae, store = inputs.dictionary, inputs.store
    truth = load_true_features(store)
    directions = sae.decoder_directions().float().cpu()
    true = truth.directions.float()
    if true.shape[1] != directions.shape[1]:
        raise ValueError(f"ground-truth: the store's true features are {true.shape[1]}-wide but the dictionary's "
                         f"decoder rows are {directions.shape[1]}-wide; evaluate it on the store it was trained on")
    best = cosines(directions, true).argmax(dim=1)
    n = min(inputs.rows, store.num_rows)
    summary: dict[str, Any] = {"mcc": mcc(directions, true), "uniqueness": uniqueness(directions, true)}
    base = evaluate_rows(sae, (store.rows(inputs.hookpoint, a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)))
    summary.update(sae_l0=base.l0, dead_latents=round(base.dead_fraction * base.n_latents),
                   shrinkage=base.l2_ratio, explained_variance=base.explained_variance)
    note = None
    if truth.codes is None:
        note = "the store records no true codes: precision / recall / F1 left out (import with --true-codes)"
    else:
        L = directions.shape[0]
        tp, fp, fn, tn = (torch.zeros(L, dtype=torch.float64) for _ in range(4))
        true_l0 = 0.0
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            x = store.rows(inputs.hookpoint, a, b).to(sae.W_enc)
            fires = sae.codes(sae.split(sae.flatten_batch(x))[0]).cpu() > 0
            acts = truth.codes_of(a, b)
            true_l0 += float((acts > 0).sum())
            gt = acts[:, best] > 0
            tp += (fires & gt).sum(0)
            fp += (fires & ~gt).sum(0)
            fn += (~fires & gt).sum(0)
            tn += (~fires & ~gt).sum(0)
        summary = {"true_l0": true_l0 / n, **summary, **detection(tp, fp, fn, tn)}
    out: dict[str, Any] = {"summary": summary, "details": {"rows": n, "features": int(true.shape[0]),
                                                           "best_match": best.tolist()}}
    if note:
        out["note"] = note
    return out


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """sae_lens.synthetic's ``SyntheticDataEvalResult.to_dict()`` layout inside SAEBench's envelope."""
    s = result["summary"]
    metrics = {k: s[k] for k in ("true_l0", "sae_l0", "dead_latents", "shrinkage", "explained_variance", "mcc",
                                 "uniqueness") if k in s}
    if "f1_score" in s:
        metrics["classification"] = {k: s[k] for k in ("precision", "recall", "f1_score", "accuracy")}
    return {"eval_type_id": SAEBENCH_TYPE, **about, "eval_result_metrics": {"synthetic": metrics},
            "eval_result_details": [], "eval_result_unstructured": result["details"]}
