"""How many concepts a CBM's prediction reads: the contributions to the predicted class, their coverage (concepts
making up 90/95/99% of the positive contribution) and the concepts per prediction (the docs' "concepts per
prediction": those contributing at all). ``cbm.train_cbm`` reports them on the test rows; ``path.fit_lambda_path``
counts them on the validation rows to bound the choice (``CbmConfig.max_per_prediction``).

Shapes: N rows, L concepts, C classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["COVERAGE_LEVELS", "contributing", "coverage", "per_prediction", "predicted_contributions"]

COVERAGE_LEVELS = (0.90, 0.95, 0.99)


def predicted_contributions(x: Tensor, W: Tensor) -> Tensor:
    """x [N, L] (scaled concepts), W [C, L] -> [N, L] each concept's contribution to the row's predicted class."""
    return x * W[(x @ W.T).argmax(1)]


def contributing(contrib: Tensor) -> Tensor:
    """[N] int64: per row of contrib [N, L], the concepts contributing at all (active and weighted, either sign)."""
    return (contrib != 0).sum(1)


def coverage(contrib: Tensor, levels: Sequence[float] = COVERAGE_LEVELS) -> dict[str, float]:
    """Mean number of concepts making up each level of the positive contribution, contrib [N, L]
    (each row: the contributions to that input's predicted class)."""
    pos = contrib.clamp_min(0).sort(dim=1, descending=True).values
    total = pos.sum(1, keepdim=True)
    keep = total.squeeze(1) > 0
    frac = pos[keep].cumsum(1) / total[keep]
    out = {}
    for level in levels:
        need = (frac < level - 1e-9).sum(1) + 1
        out[f"{round(level * 100)}"] = float(need.float().mean()) if keep.any() else 0.0
    return out


def per_prediction(contrib: Tensor, level: float = COVERAGE_LEVELS[0]) -> dict[str, float]:
    """Concepts per prediction, median over the rows of contrib [N, L] (each row: the contributions to that input's
    predicted class): ``nonzero``, the concepts contributing at all (:func:`contributing`); ``"90"``, those making
    up ``level`` of the positive contribution (:func:`coverage`'s count, row by row)."""
    if not len(contrib):
        return {"nonzero": 0.0, f"{round(level * 100)}": 0.0}
    pos = contrib.clamp_min(0).sort(dim=1, descending=True).values
    frac = pos.cumsum(1) / pos.sum(1, keepdim=True).clamp_min(1e-30)
    need = torch.where(pos.sum(1) > 0, (frac < level - 1e-9).sum(1) + 1, torch.zeros(len(pos), dtype=torch.int64))
    return {"nonzero": float(contributing(contrib).float().median()),
            f"{round(level * 100)}": float(need.float().median())}
