"""The CBM's sparsity trade-off: the L1 path over lambda, the relaxed refits on each lambda's concepts, and the
choice on the validation split.

- The L1 path: ``CE + lambda * mean|W|`` by FISTA from the largest lambda down, warm-started (``naming.solvers``);
  weights below ``zero_tol * max|W|`` are then set to exactly zero. The L1 penalty both picks the concepts and
  shrinks their weights towards zero.
- Relaxed refits (a relaxed lasso, Meinshausen 2007): each lambda's concepts (its support) are fitted again without
  the L1 term, with each L2 weight of ``refit_l2`` (``CE + l2 * mean W^2`` on the support only; L-BFGS). The support
  stays that of the L1 fit, so the sparsity does not change; what changes is the shrinkage, which at the lambdas
  that pick a few hundred concepts costs accuracy on small labelled sets.
- The choice: every fit (lambda, and ``l2`` None for the L1 fit itself or the refit's L2) is one entry of the
  curve; of the entries within ``val_tolerance`` of the best validation accuracy, the one using the fewest concepts
  wins (ties: the larger lambda, then the better validation accuracy). When the grid's largest lambda is chosen,
  up to ``grow_lambda`` larger ones (x :data:`GROW_FACTOR`) are tried, so the sparsest is not cut off by the grid.
- With added concepts (``--add-pairs``), only the fits that keep their bound (``naming.bottleneck.bound``) may be
  chosen; each entry records its validation ``added_share`` and, where it breaks the bound, ``breach`` (why).
- The per-prediction bound (``max_per_prediction``, 0: none): each entry records ``per_prediction``, the median
  over the validation rows (pooled over the folds, as its accuracy) of the concepts contributing to the row's
  predicted class (``coverage.contributing``: the count ``per_prediction`` reports); a fit above the bound, or
  using no concept, gets a ``breach`` like the added concepts' and is never chosen nor sets the best. The growth
  above the grid also continues while no fit keeps the bound; where none does after it, the fit with the fewest
  concepts per prediction is chosen, with a warning and ``met`` False in :func:`bound_report`.

Shapes: n rows, L concepts, C classes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from conceptdict.naming.bottleneck.baseline import accuracy, stratified_folds
from conceptdict.naming.bottleneck.coverage import contributing, predicted_contributions
from conceptdict.naming.bottleneck.solvers import Rows, fit_linear, fit_path
from torch import Tensor

if TYPE_CHECKING:
    from conceptdict.naming.bottleneck.bound import AddedBound
    from conceptdict.naming.bottleneck.cbm import CbmConfig

__all__ = ["GROW_FACTOR", "Part", "bound_report", "choose_lambda", "chosen_refit", "cv_parts", "describe_fit",
           "fit_lambda_path", "is_chosen", "per_prediction_breach", "prune", "refit_support"]

log = logging.getLogger(__name__)

GROW_FACTOR = 3.0
"""Each lambda tried above the grid is this many times the last (``CbmConfig.grow_lambda``)."""


def prune(W: Tensor, tol: float) -> Tensor:
    """W with the weights below ``tol * max|W|`` set to exactly zero."""
    cut = tol * float(W.abs().max()) if W.numel() else 0.0
    return torch.where(W.abs() < cut, torch.zeros_like(W), W)


def refit_support(x: Tensor, y: Tensor, n_classes: int, W: Tensor, l2: Sequence[float], max_iter: int = 5000,
                  tol: float = 1e-4) -> dict[float, Tensor]:  # fmt: skip
    """For each L2 weight of ``l2``: the weights [C, L] of ``CE + l2 * mean W^2`` fitted on the concepts (columns of
    x [n, L]) that ``W`` uses, zero elsewhere; {} when W uses none. Solved from the largest L2 down, warm-started."""
    support = (W != 0).any(0)
    if not l2 or not support.any():
        return {}
    fits = fit_path(x[:, support], y, n_classes, bias=False, l2=l2, max_iter=max_iter, tol=tol)
    out = {}
    for c in l2:
        V = torch.zeros_like(W)
        V[:, support] = fits[(0.0, c)].weight.to(W)
        out[c] = V
    return out


def choose_lambda(path: Sequence[dict], tolerance: float, breach: Callable[[dict], str | None] | None = None
                  ) -> dict | None:  # fmt: skip
    """The entry of ``path`` (dicts with lambda, val_accuracy, concepts_used) within ``tolerance`` of the best
    validation accuracy that uses the fewest concepts; ties go to the larger lambda, then to the better validation
    accuracy, then to the earlier entry. Entries with a ``breach`` (of the added concepts' bound or the
    per-prediction bound; ``breach(entry)`` in its place where given) are never chosen, and do not set the best;
    None when every entry has one."""
    allowed = [p for p in path if not (p.get("breach") if breach is None else breach(p))]
    if not allowed:
        return None
    best = max(p["val_accuracy"] for p in allowed)
    ok = [p for p in allowed if p["val_accuracy"] >= best - tolerance - 1e-12]
    return min(ok, key=lambda p: (p["concepts_used"], -p["lambda"], -p["val_accuracy"]))


def per_prediction_breach(median: float, concepts_used: int, bound: int) -> str | None:
    """Why a fit whose validation predictions read a median of ``median`` concepts breaks the per-prediction
    ``bound`` (``CbmConfig.max_per_prediction``; 0: no bound), or None when it keeps it."""
    if not bound:
        return None
    if not concepts_used:  # keeps the bound trivially, and is no CBM
        return "no concepts"
    return f"{median:g} concepts per prediction (median) > {bound}" if median > bound else None


def _summary(entry: dict | None) -> dict | None:
    keys = ("lambda", "l2", "val_accuracy", "concepts_used", "per_prediction")
    return None if entry is None else {k: entry.get(k) for k in keys}


def bound_report(chosen: dict | None, unbounded: dict | None, bound: int) -> dict:
    """``metrics["per_prediction_bound"]``: the bound (``max``), whether the chosen fit keeps it (``met``), whether
    the rule without it would have chosen another fit (``changed``) and which (``unbounded``)."""
    met = chosen is None or not bound or chosen.get("per_prediction", 0.0) <= bound
    return {"max": bound, "met": met, "changed": chosen is not unbounded, "unbounded": _summary(unbounded)}


class Part(NamedTuple):
    """One training / scoring split of the rows the path is chosen on: the fits are trained on ``x``, ``y`` and
    scored on ``x_val``, ``y_val``."""

    x: Tensor
    y: Tensor
    x_val: Tensor
    y_val: Tensor


def cv_parts(x: Tensor, y: Tensor, folds: int, seed: int = 0) -> list[Part]:
    """``folds`` stratified folds of the rows x [n, L], y [n] (:func:`baseline.stratified_folds`): each fold scored
    once by fits on the others."""
    fold = stratified_folds(y, folds, seed).to(y.device)
    return [Part(x[fold != f], y[fold != f], x[fold == f], y[fold == f]) for f in range(folds)]


class _Fits:
    """The L1 path of one training set, from the largest lambda down, warm-started; each lambda's pruned fit and its
    relaxed refits ({l2 or None: weights [C, L]})."""

    def __init__(self, x: Tensor, y: Tensor, n_classes: int, cfg: CbmConfig, lams: Sequence[float]):
        self.x, self.y, self.n_classes, self.cfg = x, y, n_classes, cfg
        self.rows = Rows(x)  # converted (and its step bound computed) once for the whole path
        self.path = fit_path(self.rows, y, n_classes, bias=False, l1=lams, max_iter=cfg.max_iter, tol=cfg.tol)
        self.last = self.path[(max(lams), 0.0)]
        self.memo: dict[float, dict[float | None, Tensor]] = {}

    def grow(self, lam: float) -> None:
        self.last = fit_linear(self.rows, self.y, self.n_classes, bias=False, l1=lam, init=self.last,
                               max_iter=self.cfg.max_iter, tol=self.cfg.tol)  # fmt: skip
        self.path[(lam, 0.0)] = self.last

    def weights(self, lam: float) -> dict[float | None, Tensor]:
        if lam not in self.memo:
            W = prune(self.path[(lam, 0.0)].weight, self.cfg.zero_tol)
            refits = refit_support(self.x, self.y, self.n_classes, W, self.cfg.refit_l2, self.cfg.max_iter,
                                   self.cfg.tol)  # fmt: skip
            self.memo[lam] = {None: W, **refits}
        return self.memo[lam]


def fit_lambda_path(parts: Sequence[Part], n_classes: int, cfg: CbmConfig, final: tuple[Tensor, Tensor] | None = None,
                    bound: AddedBound | None = None) -> tuple[dict | None, Tensor | None, list[dict], dict]:  # fmt: skip
    """(the chosen entry, its weights [C, L], the whole curve, :func:`bound_report`): one entry per fit, lambdas
    smallest first, each lambda's L1 fit (``l2`` None) then its refits; the chosen entry has ``chosen`` True.

    Each entry's validation accuracy and concepts per prediction are pooled over ``parts`` (one part: the validation
    split; several: cross-validation folds, :func:`cv_parts`); its weights and concepts used are those of the fit on
    ``final`` (x, y): the rows the CBM is fitted on, by default the first part's training rows. With ``bound``, each
    entry's added share is pooled over the parts the same way, the bound is checked on it and the entry's weights,
    and only the entries that keep it may be chosen; (None, None, curve, report) when none does. The per-prediction
    bound (``cfg.max_per_prediction``) is checked after it (module docstring). The path grows above the grid while
    the chosen fit, or the one the rule without the per-prediction bound chooses, is the largest lambda's, or while
    no fit keeps the per-prediction bound."""
    lams = sorted(set(cfg.lambdas))
    fitted = [_Fits(p.x, p.y, n_classes, cfg, lams) for p in parts]
    whole = fitted[0] if final is None else _Fits(*final, n_classes, cfg, lams)
    path: list[dict] = []
    weights: dict[tuple[float, float | None], Tensor] = {}
    added_breach: dict[int, str | None] = {}  # id(entry) -> its breach of the added concepts' bound alone
    n_val = sum(len(p.y_val) for p in parts)

    def add(lam: float) -> dict | None:
        correct: dict[float | None, float] = {}
        shares: dict[float | None, float] = {}
        counts: dict[float | None, list[Tensor]] = {}
        for part, fits in zip(parts, fitted):
            for l2, V in fits.weights(lam).items():
                correct[l2] = correct.get(l2, 0.0) + accuracy(part.x_val @ V.T, part.y_val) * len(part.y_val)
                counts.setdefault(l2, []).append(contributing(predicted_contributions(part.x_val, V)))
                if bound is not None:
                    shares[l2] = shares.get(l2, 0.0) + bound.share_sum(part.x_val, V)
        for l2, V in whole.weights(lam).items():
            weights[(lam, l2)] = V
            used = int((V != 0).any(0).sum())
            median = float(torch.cat(counts[l2]).float().median()) if l2 in counts else 0.0
            path.append({"lambda": lam, "l2": l2, "val_accuracy": correct.get(l2, 0.0) / n_val,
                         "concepts_used": used, "per_prediction": median, "zero_weights": int((V == 0).sum())})
            if bound is not None:
                share = shares.get(l2, 0.0) / n_val
                path[-1].update(added_share=share, breach=bound.breach(share, V))
            added_breach[id(path[-1])] = path[-1].get("breach")
            if cfg.max_per_prediction:
                path[-1]["breach"] = path[-1].get("breach") or per_prediction_breach(median, used,
                                                                                     cfg.max_per_prediction)
        return choose_lambda(path, cfg.val_tolerance)

    def unbounded() -> dict | None:  # the choice without the per-prediction bound
        return choose_lambda(path, cfg.val_tolerance, breach=lambda p: added_breach[id(p)])

    def at_top(entry: dict | None) -> bool:  # the sparsest within tolerance may lie above the grid
        return entry is not None and entry["lambda"] == lams[-1] != 0 and entry["concepts_used"] > 0

    def unmet() -> bool:  # no fit keeps the per-prediction bound, some keep the added concepts' one
        last_used = any(p["concepts_used"] for p in path if p["lambda"] == lams[-1])
        return lams[-1] != 0 and last_used and any(not added_breach[id(p)] for p in path)

    for lam in lams:
        chosen = add(lam)
    free = unbounded()
    free_grows = at_top(free)  # whether the rule without the bound still grows (it stops for good once it does not)
    for _ in range(cfg.grow_lambda):
        if not (at_top(chosen) or free_grows or (chosen is None and cfg.max_per_prediction and unmet())):
            break
        lams.append(float(f"{lams[-1] * GROW_FACTOR:.6g}"))
        for fits in {id(f): f for f in [*fitted, whole]}.values():
            fits.grow(lams[-1])
        chosen = add(lams[-1])
        if free_grows:
            free = unbounded()
            free_grows = at_top(free)
    if chosen is None and cfg.max_per_prediction:
        kept = [p for p in path if not added_breach[id(p)] and p["concepts_used"]]
        if kept:
            chosen = min(kept, key=lambda p: (p["per_prediction"], -p["val_accuracy"], p["concepts_used"],
                                              -p["lambda"]))  # fmt: skip
            log.warning("no fit on the CBM's lambda path (up to lambda %g) reads at most %d concepts per prediction "
                        "(median, validation rows): the fewest, %g at lambda %g, is chosen; pass a larger "
                        "--max-per-prediction or --grow-lambda, or 0 for no bound", lams[-1],
                        cfg.max_per_prediction, chosen["per_prediction"], chosen["lambda"])  # fmt: skip
    for p in path:
        p["chosen"] = p is chosen
    W = None if chosen is None else weights[(chosen["lambda"], chosen["l2"])]
    return chosen, W, path, bound_report(chosen, free, cfg.max_per_prediction)


def describe_fit(entry: dict) -> str:
    """How a curve entry was fitted: ``L1`` (the lambda's own fit), or ``refit L2 c`` (its concepts refitted)."""
    return "L1" if entry.get("l2") is None else f"refit L2 {entry['l2']:g}"


def is_chosen(entry: dict, lam: float) -> bool:
    """Whether curve entry ``entry`` is the chosen fit (curves written before the refits mark it by lambda alone)."""
    return entry["chosen"] if "chosen" in entry else entry["lambda"] == lam


def chosen_refit(metrics: dict) -> str:
    """``", refit with L2 c"`` when the CBM with these ``metrics`` is a refit, else "" (an L1 fit, or older files)."""
    return f", refit with L2 {metrics['refit_l2']:g}" if metrics.get("refit_l2") is not None else ""
