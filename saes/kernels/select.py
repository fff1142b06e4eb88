"""Selection on the pre-activations: per-row TopK, exact batch TopK without sorting B*L values, AuxK.

Batch TopK is proven from per-row candidates: with the c = 4k largest scores of every row, let t be the
(k*B)-th largest candidate. The true threshold is >= t, and a row whose smallest candidate is <= t has
nothing outside its candidates above t, so the top k*B of the candidates is exact. Rows whose smallest
candidate is above t (they may hold more than c winners) are recomputed, and their entries >= t join
the good rows' candidates >= t in the pool; no path sorts or even holds all B*L values unless every
row is unproven.

Shapes: pre [B, L] (or a chunk of rows of it), outputs values / indices [B, K] zero-padded per row.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# candidates per row, as a multiple of k, for the batch threshold
CANDIDATE_FACTOR = 4


class Selection(NamedTuple):
    values: Tensor  # [B, K] kept activations (>= 0, zero at padding)
    indices: Tensor  # [B, K] int64 (0 at padding)
    smallest: Tensor  # 0-dim, smallest kept activation (0 when nothing is kept or for per-row TopK)


class Candidates(NamedTuple):
    """The c best entries of each row by score: score, unscaled activation and latent, each [B, c]."""

    score: Tensor
    value: Tensor
    index: Tensor


def select_rows(pre: Tensor, k: int, row_topk, bias: Tensor | None = None) -> Selection:
    """Per-row TopK of ReLU(pre + bias): values [B, k] (clamped at 0), indices [B, k]."""
    values, indices = row_topk(pre, k, None, bias)
    return Selection(values.clamp_min(0), indices, pre.new_zeros(()))


def n_candidates(k: int, L: int) -> int:
    return min(L, CANDIDATE_FACTOR * k)


def row_candidates(pre: Tensor, c: int, scale: Tensor | None, row_topk, bias: Tensor | None = None) -> Candidates:
    """The c best entries per row of ReLU(pre + bias) [b, L] ranked by ReLU(pre + bias) * scale (scale >= 0).

    The backend ranks (pre + bias) * scale, which orders the positive entries the same way; clamping the
    scores at 0 afterwards gives exactly the ReLU ranking's candidate scores."""
    score, index = row_topk(pre, c, None, bias, scale)
    if scale is None:
        value = score
    else:
        value = pre.gather(1, index)
        if bias is not None:
            value = value + bias.to(value.dtype)[index]
    return Candidates(score.clamp_min(0), value.clamp_min(0), index)


def batch_from_candidates(cand: Candidates, k: int, L: int,
                          full_rows: Callable[[Tensor], tuple[Tensor, Tensor]]) -> Selection:
    """Exact top k*B of the batch from per-row candidates [B, c]; ``full_rows(rows)`` returns
    (score, value) [n, L] of whole rows, called only for rows the candidates cannot prove."""
    B, c = cand.score.shape
    n_keep = min(k * B, B * L)
    top = cand.score.flatten().topk(n_keep, sorted=False)
    if c < L:
        unproven = cand.score.min(dim=1).values > top.values.min()
    else:  # the candidates are whole rows
        unproven = torch.zeros(B, dtype=torch.bool, device=cand.score.device)
    bad = torch.nonzero(unproven).flatten()
    if bad.numel() == 0:
        rows, flat = top.indices // c, top.indices
        cols, values = cand.index.flatten()[flat], cand.value.flatten()[flat]
    else:
        # only entries >= t can be kept (the true threshold is >= t): the good rows' candidates and the
        # unproven rows' recomputed entries that pass t form an exact, small pool
        log.debug("batch top-k: %d of %d rows unproven by %d candidates; recomputing them", bad.numel(), B, c)
        t = top.values.min()
        good = torch.nonzero(~unproven).flatten()
        g_s, g_v, g_i = cand.score[good], cand.value[good], cand.index[good]
        g_r, g_c = torch.nonzero(g_s >= t, as_tuple=True)
        full_score, full_value = full_rows(bad)
        b_r, b_c = torch.nonzero(full_score >= t, as_tuple=True)
        pool_s = torch.cat([g_s[g_r, g_c], full_score[b_r, b_c]])
        pos = pool_s.topk(n_keep, sorted=False).indices
        rows = torch.cat([good[g_r], bad[b_r]])[pos]
        cols = torch.cat([g_i[g_r, g_c], b_c])[pos]
        values = torch.cat([g_v[g_r, g_c], full_value[b_r, b_c]])[pos]
    alive = values > 0
    rows, cols, values = rows[alive], cols[alive], values[alive]
    smallest = values.min() if values.numel() else cand.value.new_zeros(())
    return _pad_rows(rows, cols, values, B)._replace(smallest=smallest)


def select_batch(acts: Tensor, k: int, scale: Tensor | None, row_topk) -> Selection:
    """Exact top k*B entries of acts [B, L] (already >= 0) ranked by acts * scale, zero-padded per row."""
    B, L = acts.shape
    cand = row_candidates(acts, n_candidates(k, L), scale, row_topk)

    def full_rows(rows):
        value = acts[rows]
        return (value if scale is None else value * scale.to(value.dtype)), value

    return batch_from_candidates(cand, k, L, full_rows)


def _pad_rows(rows: Tensor, cols: Tensor, values: Tensor, B: int) -> Selection:
    """Scatter (row, col, value) triples into zero-padded [B, K] codes, K = the largest row count (>= 1),
    each row's entries in latent order."""
    counts = torch.bincount(rows, minlength=B)
    K = max(int(counts.max().item()) if rows.numel() else 0, 1)
    order = torch.argsort(rows * (int(cols.max()) + 1 if cols.numel() else 1) + cols)
    rows, cols, values = rows[order], cols[order], values[order]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    out_i = torch.zeros(B, K, dtype=torch.long, device=rows.device)
    out_v = values.new_zeros(B, K)
    out_i[rows, slot] = cols
    out_v[rows, slot] = values
    return Selection(out_v, out_i, values.new_zeros(()))
