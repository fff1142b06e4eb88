"""Selection on the pre-activations: per-row TopK, exact batch TopK without sorting B*L values, AuxK.

``select_batch`` proves the batch threshold from per-row candidates: with c candidates per row, let t be
the (k*B)-th largest candidate. The true threshold is >= t, and a row whose smallest candidate is <= t
has nothing outside its candidates above t, so the top k*B of the candidates is exact. Rows whose
smallest candidate is above t (they may hold more than c winners) join the pool whole; when too many
rows do, the exact path (top k*B of all B*L values) runs instead.

Shapes: pre [B, L] (modified in place: ReLU), outputs values / indices [B, K] zero-padded.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# candidates per row, as a multiple of k, for the batch threshold
CANDIDATE_FACTOR = 4
# above this fraction of unproven rows, take the exact path over all B*L values
MAX_UNPROVEN_FRACTION = 0.125


class Selection(NamedTuple):
    values: Tensor  # [B, K] kept activations (>= 0, zero at padding)
    indices: Tensor  # [B, K] int64 (0 at padding)
    smallest: Tensor  # 0-dim, smallest kept activation (0 when nothing is kept or for per-row TopK)


def select_rows(pre: Tensor, k: int, row_topk) -> Selection:
    """Per-row TopK of ReLU(pre): values [B, k] (clamped at 0), indices [B, k]."""
    values, indices = row_topk(pre, k, None)
    return Selection(values.clamp_min(0), indices, pre.new_zeros(()))


def select_batch(pre: Tensor, k: int, scale: Tensor | None, row_topk, relu_inplace: bool = True) -> Selection:
    """Exact top k*B entries of ReLU(pre) (ranked by ReLU(pre) * scale) over the batch, zero-padded per row.

    ``relu_inplace`` clamps ``pre`` in place first; pass False when ``pre`` is already >= 0 (no write)."""
    B, L = pre.shape
    if relu_inplace:
        pre.clamp_min_(0)
    score = pre if scale is None else pre * scale.to(pre.dtype)
    n_keep = min(k * B, B * L)
    rows, cols = _batch_candidates(score, n_keep, row_topk)
    values = pre[rows, cols]
    alive = values > 0
    rows, cols, values = rows[alive], cols[alive], values[alive]
    smallest = values.min() if values.numel() else pre.new_zeros(())
    return _pad_rows(rows, cols, values, B)._replace(smallest=smallest)


def _batch_candidates(score: Tensor, n_keep: int, row_topk) -> tuple[Tensor, Tensor]:
    """(rows [n_keep], cols [n_keep]) of the top n_keep entries of score [B, L]."""
    B, L = score.shape
    c = min(L, CANDIDATE_FACTOR * max(1, -(-n_keep // B)))
    if c >= L or n_keep >= B * c:
        return _exact(score, n_keep)
    cand_v, cand_i = row_topk(score, c, None)  # [B, c]
    top = cand_v.flatten().topk(n_keep, sorted=False)
    unproven = cand_v.min(dim=1).values > top.values.min()
    n_bad = int(unproven.sum().item())
    if n_bad == 0:
        return top.indices // c, cand_i.flatten()[top.indices]
    if n_bad > MAX_UNPROVEN_FRACTION * B:
        log.debug("batch top-k: %d of %d rows unproven by %d candidates; exact path", n_bad, B, c)
        return _exact(score, n_keep)
    good = torch.nonzero(~unproven).flatten()
    bad = torch.nonzero(unproven).flatten()
    pool_v = torch.cat([cand_v[good].flatten(), score[bad].flatten()])
    pool_r = torch.cat([good.repeat_interleave(c), bad.repeat_interleave(L)])
    pool_c = torch.cat([cand_i[good].flatten(), torch.arange(L, device=score.device).repeat(n_bad)])
    pos = pool_v.topk(n_keep, sorted=False).indices
    return pool_r[pos], pool_c[pos]


def _exact(score: Tensor, n_keep: int) -> tuple[Tensor, Tensor]:
    L = score.shape[1]
    flat = score.flatten().topk(n_keep, sorted=False).indices
    return flat // L, flat % L


def _pad_rows(rows: Tensor, cols: Tensor, values: Tensor, B: int) -> Selection:
    """Scatter (row, col, value) triples into zero-padded [B, K] codes, K = the largest row count (>= 1)."""
    counts = torch.bincount(rows, minlength=B)
    K = max(int(counts.max().item()) if rows.numel() else 0, 1)
    order = torch.argsort(rows * (cols.max() + 1 if cols.numel() else 1) + cols)
    rows, cols, values = rows[order], cols[order], values[order]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    out_i = torch.zeros(B, K, dtype=torch.long, device=rows.device)
    out_v = values.new_zeros(B, K)
    out_i[rows, slot] = cols
    out_v[rows, slot] = values
    return Selection(out_v, out_i, values.new_zeros(()))
