"""The CBM's splits of its labelled rows, its raw-activation baseline probe, and the per-concept scales it gives
the CBM's L1 path.

- :func:`stratified_split`: per class, the test, validation and training rows; :func:`stratified_folds`: the
  cross-validation folds of the training and validation rows (``CbmConfig.cv_folds``).

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

__all__ = ["RawProbe", "Split", "accuracy", "concept_scale", "fit_raw_probe", "stratified_folds", "stratified_split"]


class RawProbe(NamedTuple):
    weight: Tensor  # [C, D] in raw activation units
    bias: Tensor  # [C]
    l2: float
    val_accuracy: float
    test_accuracy: float


def accuracy(logits: Tensor, y: Tensor) -> float:
    """The share of rows whose largest logit is their label (NaN without rows)."""
    return float((logits.argmax(1) == y).float().mean()) if len(y) else float("nan")


class Split(NamedTuple):
    train: Tensor  # int64 indices
    val: Tensor
    test: Tensor


def stratified_split(y: Tensor, val_fraction: float, test_fraction: float, seed: int = 0) -> Split:
    """Per class: shuffle, then ``test_fraction`` to test, ``val_fraction`` to val, the rest to train."""
    gen = torch.Generator().manual_seed(seed)
    parts: tuple[list, list, list] = ([], [], [])
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_test = max(1, round(test_fraction * len(idx)))
        n_val = max(1, round(val_fraction * len(idx)))
        parts[2].append(idx[:n_test])
        parts[1].append(idx[n_test : n_test + n_val])
        parts[0].append(idx[n_test + n_val :])
    return Split(*(torch.cat(p).sort().values for p in parts))


def fitting_rows(y: Tensor, val_fraction: float, test_fraction: float, seed: int, cv_folds: int,
                 cv_max_rows: int) -> tuple[Split, int, Tensor]:
    """(the split, the folds that choose the fit (0: the one validation split), the rows the chosen fit is fitted
    on): with ``cv_folds >= 2`` and at most ``cv_max_rows`` training and validation rows, those rows together,
    else the training rows alone (``CbmConfig.cv_folds``)."""
    split = stratified_split(y.cpu(), val_fraction, test_fraction, seed)
    folds = cv_folds if cv_folds >= 2 and len(split.train) + len(split.val) <= cv_max_rows else 0
    return split, folds, torch.cat([split.train, split.val]) if folds else split.train


def stratified_folds(y: Tensor, folds: int, seed: int = 0) -> Tensor:
    """[n] int64: the fold (0..folds-1) of each row of y [n]. Each class's rows are shuffled (seeded) and dealt to
    the folds in turn, so every fold holds every class that has at least ``folds`` rows."""
    if folds < 2:
        raise ValueError(f"folds={folds}: cross-validation needs at least 2")
    gen = torch.Generator().manual_seed(seed)
    y = y.cpu()
    fold = torch.empty(len(y), dtype=torch.int64)
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        fold[idx[torch.randperm(len(idx), generator=gen)]] = torch.arange(len(idx)) % folds
    return fold


def _standardised_fits(raw: Tensor, y: Tensor, rows: Tensor, n_classes: int, l2: Sequence[float], max_iter: int,
                       tol: float) -> tuple[Tensor, Tensor, dict]:  # fmt: skip
    """(mean, std, {(0, l2): fit}) of the probes on ``raw[rows]`` standardised by those rows' mean and std."""
    mu = raw[rows].mean(0)
    sd = raw[rows].std(0).clamp_min(1e-6)
    return mu, sd, fit_path((raw[rows] - mu) / sd, y[rows], n_classes, bias=True, l2=l2, max_iter=max_iter, tol=tol)


def fit_raw_probe(raw: Tensor, y: Tensor, train: Tensor, val: Tensor, test: Tensor, n_classes: int,
                  l2: Sequence[float], max_iter: int = 5000, tol: float = 1e-4, folds: int = 0,
                  seed: int = 0) -> RawProbe:  # fmt: skip
    """The baseline probe on raw [N, D] (train / val / test: index tensors): the L2 weight of ``l2`` with the best
    validation accuracy (ties: the first listed), fitted on the training rows. With ``folds`` >= 2 (the CBM's
    cross-validation) the accuracy is pooled over that many stratified folds of the training and validation rows
    together (:func:`stratified_folds`, ``seed``) and the chosen L2's probe is fitted on all of them."""
    if folds >= 2:
        pool = torch.cat([train, val])
        fold = stratified_folds(y[pool], folds, seed).to(pool.device)
        correct = dict.fromkeys(l2, 0.0)
        for f in range(folds):
            held = pool[fold == f]
            mu, sd, fits = _standardised_fits(raw, y, pool[fold != f], n_classes, l2, max_iter, tol)
            for c in l2:
                correct[c] += accuracy(((raw[held] - mu) / sd) @ fits[(0.0, c)].weight.T + fits[(0.0, c)].bias,
                                       y[held]) * len(held)  # fmt: skip
        c = max(l2, key=lambda v: (correct[v], -list(l2).index(v)))
        va = correct[c] / len(pool)
        mu, sd, fits = _standardised_fits(raw, y, pool, n_classes, [c], max_iter, tol)
        fit = fits[(0.0, c)]
    else:
        mu, sd, fits = _standardised_fits(raw, y, train, n_classes, l2, max_iter, tol)
        best = None
        for c in l2:
            fit = fits[(0.0, c)]
            va = accuracy(((raw[val] - mu) / sd) @ fit.weight.T + fit.bias, y[val])
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
