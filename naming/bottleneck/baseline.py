"""The CBM's raw-activation baseline probe, and the per-concept scales it gives the CBM's L1 path.

- :func:`fit_raw_probe`: multinomial logistic regression with bias on the standardised raw activations of the
  CBM's inputs, its L2 weight chosen on the CBM's validation split (L-BFGS, ``naming.solvers``); the weights are
  returned in raw units (the standardisation folded in), so ``raw @ weight.T + bias`` are its logits.
- :func:`concept_scale`: what each concept activation is multiplied by before the CBM's L1 path. ``std``: 1 / its
  training std, so the penalty treats every concept alike. ``probe``: how strongly the probe's classes read the
  concept's decoder direction, ``||W_probe d_j||`` (an adaptive lasso, Zou 2006, whose first estimate comes from the
  decoder: a dictionary reconstructs ``x ~ sum_j f_j d_j + b``, so the probe's logits are ``sum_j f_j (W_probe d_j)``
  up to a constant and to what the dictionary does not reconstruct). Concepts the probe relies on then cost the
  penalty less, and concepts that carry nothing the probe reads cost more.

Shapes: N inputs, L concepts, D raw width, C classes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

import torch
from torch import Tensor

from conceptdict.naming.bottleneck.solvers import fit_path

__all__ = ["RawProbe", "accuracy", "concept_scale", "fit_raw_probe"]


class RawProbe(NamedTuple):
    weight: Tensor  # [C, D] in raw activation units
    bias: Tensor  # [C]
    l2: float
    val_accuracy: float
    test_accuracy: float


def accuracy(logits: Tensor, y: Tensor) -> float:
    """The share of rows whose largest logit is their label (NaN without rows)."""
    return float((logits.argmax(1) == y).float().mean()) if len(y) else float("nan")


def fit_raw_probe(raw: Tensor, y: Tensor, train: Tensor, val: Tensor, test: Tensor, n_classes: int,
                  l2: Sequence[float], max_iter: int = 5000, tol: float = 1e-4) -> RawProbe:  # fmt: skip
    """The baseline probe on raw [N, D] (train / val / test: index tensors): the L2 weight of ``l2`` with the best
    validation accuracy (ties: the first listed)."""
    mu = raw[train].mean(0)
    sd = raw[train].std(0).clamp_min(1e-6)
    z = (raw - mu) / sd
    fits = fit_path(z[train], y[train], n_classes, bias=True, l2=l2, max_iter=max_iter, tol=tol)
    best = None
    for c in l2:
        fit = fits[(0.0, c)]
        va = accuracy(z[val] @ fit.weight.T + fit.bias, y[val])
        if best is None or va > best[0]:
            best = (va, c, fit)
    va, c, fit = best
    weight = fit.weight / sd
    bias = fit.bias - (mu / sd) @ fit.weight.T
    return RawProbe(weight, bias, c, va, accuracy(raw[test] @ weight.T + bias, y[test]))


def concept_scale(concepts_train: Tensor, how: Literal["probe", "std"], probe: RawProbe | None = None,
                  directions: Tensor | None = None) -> tuple[Tensor, str]:  # fmt: skip
    """(scale [L], the rule used: "probe" or "std") for concept activations whose training rows are
    ``concepts_train`` [n, L]; ``directions`` [L, D] are the concepts' decoder directions in raw units. ``probe``
    needs the probe and directions of the probe's width, and falls back to ``std`` without them. A ``probe`` scale
    is normalised so that the scaled concepts' training std averages 1, as with ``std``, and the lambda grid means
    the same under both."""
    sd = concepts_train.std(0)
    std_scale = torch.where(sd > 1e-8, 1.0 / sd.clamp_min(1e-8), torch.ones_like(sd))
    if how == "std" or probe is None or directions is None:
        return std_scale, "std"
    if directions.shape != (concepts_train.shape[1], probe.weight.shape[1]):
        raise ValueError(f"decoder directions {tuple(directions.shape)} do not match {concepts_train.shape[1]} "
                         f"concepts of a {probe.weight.shape[1]}-wide probe; pass one direction per concept")
    importance = (directions.to(probe.weight) @ probe.weight.T).norm(dim=1)
    spread = float((concepts_train * importance).std(0).mean())
    if not spread > 0:  # the probe reads none of the concepts that vary on these rows
        return std_scale, "std"
    return importance / spread, "probe"
