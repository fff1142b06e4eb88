"""The bound that keeps a CBM with added concepts (``--add-pairs``, ``naming/bottleneck/added.py``) a concept
bottleneck: the added concepts may help the dictionary's concepts, not replace them.

An added concept is a class pair's supervised discriminant: on a two-class task it is the linear probe itself
(``relu(s)`` and ``relu(-s)`` read the whole probe direction), and an L1 path, which keeps the fewest concepts
that predict as well, then keeps those two and nothing else. So every fit on the lambda path is checked against
two rules, and only the fits that keep both may be chosen (``path.choose_lambda``):

- **Share** (``CbmConfig.add_max_share``): the added concepts' share of a prediction's |contribution| (to the
  predicted class: ``|a_j * scale_j * W[c, j]|`` summed over the added concepts, over the sum over all), averaged
  over the validation rows (pooled over the cross-validation folds; never the test rows), is at most the bound.
- **Classes**: in each class's explanation (its concepts of positive weight, ``cbm.class_concepts``) there are at
  least as many of the dictionary's concepts as added ones.

A fit that uses no concept at all keeps both trivially and is never chosen either. The best validation accuracy
the choice's tolerance counts from is the best of the fits that keep the bound.

Where no fit on the path keeps both, the added concepts are refused: the CBM is fitted on the dictionary's
concepts alone, the same CBM as ``--add-pairs 0`` (``metrics["added_bound"]["refused"]`` says why).

Shapes: n rows, L concepts of which the last A are added, C classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from conceptdict.naming.bottleneck.coverage import predicted_contributions
from torch import Tensor

__all__ = ["AddedBound", "BoundedFit", "added_metrics", "added_share", "fit_bounded", "row_shares"]

log = logging.getLogger(__name__)


def row_shares(contrib: Tensor, n_added: int) -> Tensor:
    """[n] each row's share of |contribution| from the last ``n_added`` columns of contrib [n, L] (each row: the
    contributions to one prediction's class); 0 where a row has no contribution."""
    total = contrib.abs().sum(1)
    tail = contrib[:, contrib.shape[1] - n_added:].abs().sum(1) if n_added else torch.zeros_like(total)
    return torch.where(total > 0, tail / total.clamp_min(1e-30), torch.zeros_like(total))


def added_share(contrib: Tensor, n_added: int) -> float:
    """The mean over the rows of :func:`row_shares` (0.0 for no rows)."""
    return float(row_shares(contrib, n_added).mean()) if len(contrib) else 0.0


@dataclass(frozen=True)
class AddedBound:
    """The rules a fit with ``n_added`` added concepts (the last columns) must keep (module docstring)."""

    n_added: int
    """A: how many of the last columns are added concepts."""
    max_share: float
    """The largest mean share of |contribution| the added concepts may have (validation rows)."""

    def share_sum(self, x_val: Tensor, W: Tensor) -> float:
        """The sum over the rows x_val [n, L] (scaled) of their added share under W [C, L] (pooled by the caller)."""
        return float(row_shares(predicted_contributions(x_val, W), self.n_added).sum())

    def class_counts(self, W: Tensor) -> tuple[list[int], list[int]]:
        """(dictionary concepts, added concepts) of positive weight, per class of W [C, L]."""
        pos = W > 0
        L = W.shape[1] - self.n_added
        return pos[:, :L].sum(1).tolist(), pos[:, L:].sum(1).tolist()

    def breach(self, share: float, W: Tensor, classes: tuple[str, ...] | None = None) -> str | None:
        """Why a fit with weights W [C, L] and validation ``share`` breaks the bound, or None when it keeps it."""
        if not (W != 0).any():  # an empty fit keeps the share trivially, and is no CBM
            return "no concepts"
        if share > self.max_share + 1e-12:
            return f"added share {100 * share:.1f}% of the contribution > {100 * self.max_share:.0f}%"
        for c, (d, a) in enumerate(zip(*self.class_counts(W))):
            if a > d:
                name = classes[c] if classes else str(c)
                return f"class {name}: {a} added concepts against {d} of the dictionary's"
        return None


class BoundedFit(NamedTuple):
    """The CBM's lambda path fitted on the concepts (and the added ones, unless refused)."""

    x: Tensor
    """[N, L (+ A)] the concept activations the chosen fit reads (without the added ones where they were refused)."""
    scale: Tensor
    """[L (+ A)]"""
    scaled_by: str
    chosen: dict
    W: Tensor
    """[C, L (+ A)]"""
    path: list[dict]
    refused: str | None = None
    """Why the added concepts were refused (no fit on the path kept the bound), else None."""
    refused_path: list[dict] | None = None
    """The curve with the added concepts, where they were refused (each entry's ``added_share`` and ``breach``)."""
    per_prediction_bound: dict | None = None
    """``path.bound_report``: the per-prediction bound, whether the chosen fit keeps it and what it changed."""


def capped_scale(scale: Tensor, n_added: int) -> Tensor:
    """scale [L + A] with the last ``n_added`` (the added concepts') at most the largest of the others: the probe
    scale reads an added concept's direction, a pair's discriminant, as the probe's own and makes it ~30x cheaper
    under the L1 penalty than any dictionary concept (man2: 203 against at most 6.9)."""
    L = len(scale) - n_added
    if not L:
        return scale
    return torch.cat([scale[:L], scale[L:].clamp_max(float(scale[:L].max()))])


def fit_bounded(x: Tensor, y: Tensor, split, folds: int, fit_rows: Tensor, cfg, probe, directions: Tensor | None,
                n_added: int = 0, classes: tuple[str, ...] | None = None,
                scale: tuple[Tensor, str] | None = None) -> BoundedFit:  # fmt: skip
    """The lambda path on x [N, L + A] (the last ``n_added`` columns added concepts): scaled
    (``baseline.concept_scale``; ``scale``: this (scale, rule) instead, a joined CBM's per part), chosen by
    cross-validation over ``folds`` folds of ``fit_rows`` (0: on ``split``'s validation rows) among the fits that keep :class:`AddedBound` (``cfg.add_max_share``) and the per-prediction
    bound (``cfg.max_per_prediction``: ``path.fit_lambda_path``); where none keeps the former, the path again on
    the first L columns alone (the CBM without added concepts)."""
    from conceptdict.naming.bottleneck.baseline import concept_scale
    from conceptdict.naming.bottleneck.path import Part, cv_parts, fit_lambda_path

    C = int(y.max()) + 1 if classes is None else len(classes)
    bound = AddedBound(n_added, cfg.add_max_share) if n_added else None
    scale, scaled_by = scale or concept_scale(x[fit_rows], cfg.scale, probe, directions)
    if n_added and cfg.add_scale == "capped":
        scale = capped_scale(scale, n_added)
    xs = x * scale
    if folds:
        parts = cv_parts(xs[fit_rows], y[fit_rows], folds, cfg.seed)
        chosen, W, path, report = fit_lambda_path(parts, C, cfg, final=(xs[fit_rows], y[fit_rows]), bound=bound)
    else:
        part = Part(xs[split.train], y[split.train], xs[split.val], y[split.val])
        chosen, W, path, report = fit_lambda_path([part], C, cfg, bound=bound)
    if chosen is not None:
        return BoundedFit(x, scale, scaled_by, chosen, W, path, per_prediction_bound=report)
    L = x.shape[1] - n_added
    reasons = sorted({p["breach"] for p in path})
    refused = f"no fit on the lambda path kept the bound ({'; '.join(reasons[:3])})"
    alone = fit_bounded(x[:, :L], y, split, folds, fit_rows, cfg, probe,
                        None if directions is None else directions[:L], 0, classes)
    return alone._replace(refused=refused, refused_path=path)


def added_metrics(added, fit: BoundedFit, contrib: Tensor, max_share: float) -> dict:
    """The CBM's metrics on its added concepts, contrib [n_test, L (+ A)] the test inputs' contributions to their
    predicted class: ``added_bound`` (the bound; why the added concepts were refused and their curve, if they were),
    ``added_share`` (:func:`added_share` on the test inputs; 0 when refused) and, unless refused,
    ``added_concepts`` (``added.added_summary``)."""
    from conceptdict.naming.bottleneck.added import added_summary

    out = {"added_bound": {"max_share": max_share, "refused": fit.refused, "path": fit.refused_path},
           "added_share": added_share(contrib, 0 if fit.refused else len(added))}
    if fit.refused:
        log.warning("--add-pairs: the added concepts are refused, %s; the CBM reads the dictionary's alone",
                    fit.refused)
    else:
        out["added_concepts"] = added_summary(added, fit.W, contrib)
    return out
