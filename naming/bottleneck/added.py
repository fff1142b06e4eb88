"""Concepts added where the classes need them (CB-SAE's idea, bottleneck latents for what is missing, fitted to the
labels): after the dictionary's concepts are read, find the class pairs they confuse and, per pair, the direction
that separates the two classes in what the dictionary does not reconstruct; add it to the CBM's inputs as two
non-negative concepts, each named after the class its evidence points to ("Danish rather than Norwegian").

- **What the directions read** (``CbmConfig.add_reads``). ``raw`` (the default): the raw activations, so a pair's
  direction is the discriminant the raw probe could read for it. ``error``: ``x - decode(encode(x))``, the raw
  activations less the dictionary's reconstruction from its sparse code, the part no concept reconstructs (a
  dictionary that does not decode into the raw space, e.g. a transcoder, falls back to ``raw``). Measured on
  msglang (docs/results/cbm.md): the reconstruction error does not separate the confused pairs (out-of-fold AUROC
  0.44-0.56), the raw activations do (0.73-0.96), so ``raw``. (The residual after projecting out the concepts'
  decoder span is empty there: the ~900 concepts a CBM keeps span all 384 raw dimensions.)
- **Which pairs.** A ridge classifier on the standardised concept activations, fitted out of fold (``folds`` folds of
  the fitting rows only), counts each class pair's confusions (a read as b plus b read as a); the ``pairs`` pairs
  with the most, each with at least ``min_confusions``, get a direction. Nothing is added where the concepts
  confuse no pair.
- **Direction.** Shrinkage LDA on the residual of the pair's fitting rows: ``w = ((1 - g) S_w + g tr(S_w)/D I)^-1
  (mu_a - mu_b)``, the shrinkage ``g`` of :data:`SHRINKAGE` chosen by the out-of-fold AUROC of the projection
  (``folds`` folds of the pair's fitting rows), then fitted on all of them. The projection ``s = (r . w - m) / sd``
  is centred on the midpoint of the two classes' projected means and scaled by its spread.
- **Concepts.** ``relu(s)`` ("a rather than b") and ``relu(-s)`` ("b rather than a"): non-negative, zero where the
  evidence points the other way, so a prediction counts at most one of the two. The name comes from the labels of
  the half's top-activating fitting rows (the majority label over the top ``top_k``), and the score is the pair's
  out-of-fold AUROC; the CBM then reads them like any dictionary latent, and its L1 path may leave them out.
- **Cross-fitting.** The CBM's weights are fitted on the same rows as the directions; there a direction separates
  its pair better than on new rows, and the L1 path would lean on it. So a pair's own fitting rows get the
  activation of the direction fitted without their fold (:attr:`AddedConcepts.fitted`); every other row, that of
  the direction fitted on all of them.

Shapes: N inputs, L concepts, D raw width, A added concepts (two per pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from conceptdict.naming.bottleneck.baseline import stratified_folds
from conceptdict.naming.scoring import auroc
from torch import Tensor

SHRINKAGE = (0.01, 0.1, 0.3, 0.7)
"""Candidate shrinkages of the within-class covariance toward a multiple of the identity (chosen by AUROC)."""


@dataclass(frozen=True)
class AddedConcepts:
    """Directions added to a CBM's concepts, two non-negative halves per class pair."""

    weight: Tensor
    """[P, D] each pair's direction on the residual (scaled so that the projection has unit spread)."""
    offset: Tensor
    """[P] the projection's centre (the midpoint of the two classes' projected means, in the same units)."""
    pairs: tuple[tuple[str, str], ...]
    """(a, b) per direction: ``relu(s)`` reads as a rather than b, ``relu(-s)`` as b rather than a."""
    names: tuple[str, ...]
    """[2P] the concepts' names, in column order (pair 0's positive half, its negative half, pair 1's, ...)."""
    residual: str
    """What the directions read: ``error`` (x less the dictionary's reconstruction) or ``raw``."""
    evidence: tuple[dict[str, Any], ...] = field(default=())
    """[2P] per concept: pair, out-of-fold AUROC, shrinkage, confusions, top rows and their labels."""
    fitted: Tensor | None = field(default=None, compare=False)
    """[len(fit_rows), 2P] the fitting rows' activations, cross-fitted: a pair's own rows by the direction fitted
    without their fold, so the CBM's weights are fitted on activations as noisy as on new rows (None: loaded)."""

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    def activations(self, residual: Tensor) -> Tensor:
        """residual [N, D] -> [N, 2P] the added concepts' activations (each >= 0)."""
        if not self.pairs:
            return residual.new_zeros(residual.shape[0], 0)
        s = residual.float() @ self.weight.T - self.offset
        return torch.stack([s.clamp_min(0), (-s).clamp_min(0)], 2).flatten(1)

    def activations_for_fit(self, residual: Tensor, fit_rows: Tensor) -> Tensor:
        """residual [N, D] -> [N, 2P]: :meth:`activations`, with the fitting rows' cross-fitted ones."""
        out = self.activations(residual)
        if self.fitted is not None and len(self.pairs):
            out[fit_rows] = self.fitted.to(out)
        return out

    def directions(self) -> Tensor:
        """[2P, D] each concept's direction in raw units (the residual's direction: ``w`` and ``-w``), for the
        CBM's probe scale."""
        w = self.weight / self.weight.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return torch.stack([w, -w], 1).flatten(0, 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, everything :meth:`from_dict` needs to compute the activations again."""
        return {"residual": self.residual, "names": list(self.names), "pairs": [list(p) for p in self.pairs],
                "weight": self.weight.tolist(), "offset": self.offset.tolist(), "evidence": list(self.evidence)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> AddedConcepts:
        """The added concepts of a saved CBM (``cbm.json``'s ``metrics["added_concepts"]``)."""
        return cls(torch.tensor(doc["weight"], dtype=torch.float32).reshape(len(doc["pairs"]), -1),
                   torch.tensor(doc["offset"], dtype=torch.float32), tuple(tuple(p) for p in doc["pairs"]),
                   tuple(doc["names"]), doc["residual"], tuple(doc.get("evidence", ())))


class Residual(NamedTuple):
    """What the added concepts' directions read, per input."""

    values: Tensor
    """[N, D]"""
    kind: str
    """``error`` (the raw activations less the dictionary's reconstruction) or ``raw`` (the raw activations)."""


def dictionary_residual(model, raw: Tensor, chunk: int = 4096) -> Residual:
    """raw [N, D] less the dictionary's reconstruction from its sparse code (``error``); raw itself (``raw``) where
    the dictionary does not decode into raw's space (its decoder directions are not ``D`` wide)."""
    from conceptdict.naming.bottleneck.features import concept_directions

    if concept_directions(model, raw.shape[1]) is None:
        return Residual(raw.float(), "raw")
    with torch.no_grad():
        parts = [x.float() - model.decode(model.encode(x.float())).float() for x in raw.split(chunk)]
    return Residual(torch.cat(parts), "error")


def cbm_residual(model, raw: Tensor, reads: str = "raw") -> Residual:
    """What the added concepts read (``CbmConfig.add_reads``): ``raw``, the raw activations (the pair's discriminant
    of what the raw probe reads); ``error``, :func:`dictionary_residual`."""
    if reads == "raw":
        return Residual(raw.float(), "raw")
    if reads == "error":
        return dictionary_residual(model, raw)
    raise ValueError(f"add_reads={reads!r} is not one of raw, error")


def standardise(x: Tensor, rows: Tensor) -> Tensor:
    """x standardised by the mean and std of its ``rows`` (constant columns left at 0)."""
    mu, sd = x[rows].mean(0), x[rows].std(0)
    return (x - mu) / torch.where(sd > 0, sd, torch.ones_like(sd))


def ridge_predictions(x: Tensor, y: Tensor, n_classes: int, folds: Tensor, l2: float = 1.0) -> Tensor:
    """[N] out-of-fold predictions of a ridge classifier (one-hot targets, bias) on x [N, F]: each row predicted
    by the fit on the other folds. ``l2`` is per row (the penalty is ``l2 * rows * |W|^2``)."""
    pred = torch.empty(len(y), dtype=torch.int64)
    onehot = torch.nn.functional.one_hot(y, n_classes).double()
    for f in torch.unique(folds).tolist():
        tr, te = folds != f, folds == f
        xt = x[tr].double()
        mu, ym = xt.mean(0), onehot[tr].mean(0)
        xc = xt - mu
        gram = xc.T @ xc + l2 * len(xt) * torch.eye(x.shape[1], dtype=torch.float64)
        W = torch.linalg.solve(gram, xc.T @ (onehot[tr] - ym))
        pred[te] = ((x[te].double() - mu) @ W + ym).argmax(1)
    return pred


def confused_pairs(pred: Tensor, y: Tensor, n_classes: int) -> list[tuple[int, int, int]]:
    """(a, b, confusions) per unordered class pair, a < b, most confused first (a read as b plus b read as a)."""
    conf = torch.zeros(n_classes, n_classes, dtype=torch.int64)
    conf.index_put_((y, pred), torch.ones(len(y), dtype=torch.int64), accumulate=True)
    both = conf + conf.T
    out = [(a, b, int(both[a, b])) for a in range(n_classes) for b in range(a + 1, n_classes)]
    return sorted(out, key=lambda t: (-t[2], t[0], t[1]))


def lda_direction(r: Tensor, is_a: Tensor, shrinkage: float) -> Tensor:
    """[D] shrinkage-LDA direction separating rows ``is_a`` of r [n, D] from the others, toward ``is_a``."""
    a, b = r[is_a].double(), r[~is_a].double()
    centred = torch.cat([a - a.mean(0), b - b.mean(0)])
    cov = centred.T @ centred / max(len(centred) - 2, 1)
    target = torch.eye(r.shape[1], dtype=torch.float64) * cov.diagonal().mean().clamp_min(1e-12)
    return torch.linalg.solve((1 - shrinkage) * cov + shrinkage * target, a.mean(0) - b.mean(0)).float()


def pair_direction(r: Tensor, is_a: Tensor, folds: int, seed: int) -> tuple[Tensor, float, float, float, Tensor]:
    """(w [D], offset, out-of-fold AUROC, shrinkage, the rows' out-of-fold projections [n]) for the pair's rows
    r [n, D] (module docstring): each row's projection by the direction fitted without its fold, centred and scaled
    on the other folds' rows."""
    fold = stratified_folds(is_a.long(), folds, seed)
    best = (-1.0, SHRINKAGE[0], None)
    for g in SHRINKAGE:
        s = torch.empty(len(r))
        for f in range(folds):
            tr, te = fold != f, fold == f
            w = lda_direction(r[tr], is_a[tr], g)
            p = r[tr] @ w
            m = (p[is_a[tr]].mean() + p[~is_a[tr]].mean()) / 2
            s[te] = (r[te] @ w - m) / (p - m).std().clamp_min(1e-12)
        auc = auroc(s[is_a], s[~is_a])
        if auc > best[0]:
            best = (auc, g, s)
    w = lda_direction(r, is_a, best[1])
    s = r @ w
    m = (s[is_a].mean() + s[~is_a].mean()) / 2
    sd = (s - m).std().clamp_min(1e-12)
    return w / sd, float(m / sd), best[0], best[1], best[2]


def half_name(acts: Tensor, y: Tensor, classes: Sequence[str], pair: tuple[int, int], top_k: int) -> tuple[str, list]:
    """The name of one half from its evidence: the majority label of its top ``top_k`` rows (activation > 0), "X
    rather than Y" with Y the pair's other class; and those rows' positions."""
    top = acts.topk(min(top_k, len(acts))).indices
    top = top[acts[top] > 0]
    if not len(top):
        return f"{classes[pair[0]]} rather than {classes[pair[1]]}", []
    label = int(torch.bincount(y[top], minlength=len(classes)).argmax())
    other = pair[1] if label == pair[0] else pair[0]
    return f"{classes[label]} rather than {classes[other]}", top.tolist()


def add_needed_concepts(
    concepts: Tensor, residual: Tensor, y: Tensor, classes: Sequence[str], fit_rows: Tensor, *, pairs: int,
    folds: int = 5, min_confusions: int = 2, seed: int = 0, residual_kind: str = "error", top_k: int = 20,
) -> AddedConcepts:  # fmt: skip
    """Directions for the ``pairs`` class pairs the concepts [N, L] confuse most, fitted on ``fit_rows`` alone
    (module docstring). y [N] class indices; residual [N, D]."""
    if pairs < 0:
        raise ValueError(f"pairs={pairs}: the number of class pairs to add concepts for must be >= 0")
    empty = AddedConcepts(residual.new_zeros(0, residual.shape[1]), residual.new_zeros(0), (), (), residual_kind)
    if pairs == 0 or len(fit_rows) < 2 * folds:
        return empty
    C = len(classes)
    yf = y[fit_rows]
    x = standardise(concepts.float(), fit_rows)[fit_rows]
    pred = ridge_predictions(x, yf, C, stratified_folds(yf, folds, seed))
    chosen = [p for p in confused_pairs(pred, yf, C) if p[2] >= min_confusions][:pairs]
    weights, offsets, names, evidence, kept = [], [], [], [], []
    r = residual.float()
    fitted = []
    for a, b, n_conf in chosen:
        rows = fit_rows[(yf == a) | (yf == b)]
        w, m, auc, g, s = pair_direction(r[rows], y[rows] == a, folds, seed)
        weights.append(w)
        offsets.append(m)
        kept.append((classes[a], classes[b]))
        full = r[fit_rows] @ w - m  # the fitting rows outside the pair did not fit the direction
        full[((yf == a) | (yf == b)).nonzero().flatten()] = s  # the pair's rows: out of fold (cross-fitting)
        fitted.append(full)
        for acts in (s.clamp_min(0), (-s).clamp_min(0)):
            name, top = half_name(acts, y[rows], classes, (a, b), top_k)
            names.append(name)
            evidence.append({"pair": [classes[a], classes[b]], "confusions": n_conf, "auroc": auc, "shrinkage": g,
                             "top_rows": rows[top].tolist(), "top_labels": [classes[i] for i in y[rows][top].tolist()]})
    if not weights:
        return empty
    f = torch.stack(fitted, 1)
    return AddedConcepts(torch.stack(weights), torch.tensor(offsets), tuple(kept), tuple(names), residual_kind,
                         tuple(evidence), torch.stack([f.clamp_min(0), (-f).clamp_min(0)], 2).flatten(1))


def added_summary(added: AddedConcepts, weight: Tensor, contrib: Tensor) -> dict[str, Any]:
    """What the CBM made of the added concepts (its last ``len(added)`` columns): weight [C, L + A], contrib [N, L + A]
    the test inputs' contributions to their predicted class. ``used``: the added concepts with a nonzero weight;
    ``predictions_share``: the share of test predictions an added concept contributes to; ``contribution_share``:
    the added concepts' share of the positive contribution, over all test predictions."""
    A = len(added)
    used = (weight[:, weight.shape[1] - A:] != 0).any(0).tolist() if A else []
    tail = contrib[:, contrib.shape[1] - A:] if A else contrib[:, :0]
    pos = contrib.clamp_min(0).sum()
    return {**added.to_dict(), "n_pairs": len(added.pairs), "n_added": A,
            "used": [n for n, u in zip(added.names, used) if u],
            "predictions_share": float((tail != 0).any(1).float().mean()) if len(contrib) and A else 0.0,
            "contribution_share": float(tail.clamp_min(0).sum() / pos) if A and pos > 0 else 0.0}
