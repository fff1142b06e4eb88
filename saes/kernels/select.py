"""Selection on the pre-activations: per-row TopK, exact batch TopK without sorting B*L values, AuxK.

Batch TopK keeps every entry whose score is at least the (k*B)-th largest: ties at the cut are all kept, so the
choice is a function of the scores alone, whatever the order of the rows or their split over processes.
It is proven from per-row candidates: every row b offers candidates holding all its scores
above a floor f_b (its c = 4k largest scores, f_b the smallest of them; or, with a cutoff tau guessed
from the first rows, every score above tau, f_b = tau). Let t be the (k*B)-th largest candidate. The
true threshold is >= t, and a row with f_b <= t has nothing outside its candidates above t, so the top
k*B of the candidates is exact. Rows with f_b > t (or more scores above tau than the candidate buffer
holds) are recomputed, and their entries >= t join the good rows' candidates >= t in the pool (all their
entries, where the recomputation rounded one at t below it); no path sorts or even holds all B*L values
unless every row is unproven.

Shapes: pre [B, L] (or a chunk of rows of it), outputs values / indices [B, K] zero-padded per row.
"""

from __future__ import annotations

import logging
import math
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
    """Entries of each row by score: score, unscaled activation and latent, each [B, c] (padding: score
    and value 0), and the floor [B]: every score of the row above it is among the candidates."""

    score: Tensor
    value: Tensor
    index: Tensor
    floor: Tensor


def select_rows(pre: Tensor, k: int, row_topk, bias: Tensor | None = None,
                floor: float = float("-inf")) -> Selection:
    """Per-row TopK of ReLU(pre + bias): values [B, k] (clamped at 0), indices [B, k]; ``floor`` is a
    hint of the rows' k-th largest score (``row_floor``)."""
    values, indices = row_topk(pre, k, None, bias, None, floor)
    return Selection(values.clamp_min(0), indices, values.new_zeros(()))


# the TopK floor hint is this quantile of the first chunk's k-th largest scores (a row below it is rescanned)
FLOOR_QUANTILE = 0.1


def row_floor(first: Selection) -> float:
    """A hint for the rows after the first chunk: a low quantile of the first chunk's per-row k-th
    largest (clamped) scores. About FLOOR_QUANTILE of the rows fall below it and are scanned twice; the
    others start their threshold there instead of at the k-th largest of their first 4k columns."""
    kth = first.values.min(dim=1).values.float()
    return float(torch.quantile(kth, FLOOR_QUANTILE)) if kth.numel() else float("-inf")


def n_candidates(k: int, L: int) -> int:
    return min(L, CANDIDATE_FACTOR * k)


def row_candidates(pre: Tensor, c: int, scale: Tensor | None, row_topk, bias: Tensor | None = None,
                   floor: float = float("-inf")) -> Candidates:
    """The c best entries per row of ReLU(pre + bias) [b, L] ranked by ReLU(pre + bias) * scale (scale >= 0);
    ``floor``: ``row_topk``'s hint of the rows' c-th largest score.

    The backend ranks (pre + bias) * scale, which orders the positive entries the same way; clamping the
    scores at 0 afterwards gives exactly the ReLU ranking's candidate scores."""
    score, index = row_topk(pre, c, None, bias, scale, floor)
    value = score if scale is None else _value_at(pre, index, bias)
    score = score.clamp_min(0)
    floor = score.min(dim=1).values if c < pre.shape[1] else score.new_full((pre.shape[0],), float("-inf"))
    return Candidates(score, value.clamp_min(0), index, floor)


def _value_at(pre: Tensor, index: Tensor, bias: Tensor | None) -> Tensor:
    """(pre + bias) at ``index``, in the wider dtype of the two (as the backends' scores)."""
    value = pre.gather(1, index)
    return value if bias is None else value.to(torch.promote_types(value.dtype, bias.dtype)) + bias[index]


# the cutoff guessed from the first rows keeps about this many times k entries per row on average
TAU_MARGIN = 1.5


def batch_cutoff(cand: Candidates, k: int) -> float:
    """A guess of the batch threshold from the first rows' candidates, on the low side: the
    (TAU_MARGIN * k * rows)-th largest of their scores (0 when they hold fewer)."""
    n = int(TAU_MARGIN * k * cand.score.shape[0])
    flat = cand.score.flatten()
    return float(flat.topk(n, sorted=False).values.min()) if 0 < n <= flat.numel() else 0.0


# BatchTopK after the first chunk: slots per row for the entries above the cutoff, in units of 4k (a row
# with more is recomputed; 2 rather than 1 cut the recomputed rows from ~8% to ~1.2% of the batch on the
# data of bench/train_step.py)
ABOVE_SLOTS = 2

# BatchTopK's first chunk: rows selected without a hint, whose candidates' floors give the others' (``row_floor``)
PROBE_ROWS = 64


class BatchCandidates:
    """The candidates of a BatchTopK selected chunk by chunk (``sparse.encode``), gathered into one zero-padded
    [B, W] buffer as they come: the first chunk's c = 4k best per row (:func:`row_candidates`), then, with a backend
    ``row_above``, every later chunk's entries above the cutoff guessed from them (ABOVE_SLOTS * c slots a row, written
    in place by ``row_above(..., out=)``; else c best per row again). :meth:`select` cuts and packs them with the
    backend's ``batch_pack`` where it has one, else :func:`batch_from_candidates`: the same code either way."""

    def __init__(self, B: int, k: int, L: int, scale: Tensor | None, chunk: int, row_topk, row_above=None,
                 batch_pack=None):
        self.B, self.k, self.L, self.scale = B, k, L, scale
        self.row_topk, self.row_above, self.batch_pack = row_topk, row_above, batch_pack
        self.c = n_candidates(k, L)
        self.slots = min(L, ABOVE_SLOTS * self.c)
        self.width = max(self.c, self.slots) if row_above is not None and B > chunk else self.c
        self.tau, self.rows = 0.0, 0
        self.cand: Candidates | None = None
        self.filled = torch.empty(B, dtype=torch.long)  # each row's filled slots (zeros after them)

    def add(self, pre: Tensor, bias: Tensor | None) -> None:
        """The candidates of the next chunk of rows, pre [n, L] (+ bias)."""
        s, n = self.rows, pre.shape[0]
        self.rows += n
        if self.cand is not None and self.row_above is not None:
            score, index = self.cand.score[s : s + n, : self.slots], self.cand.index[s : s + n, : self.slots]
            if score.dtype == torch.float32:  # in place (the kernel zeroes the padding slots)
                count = self.row_above(pre, self.tau, self.slots, bias, self.scale, out=(score, index))
            else:
                got_score, got_index, count = self.row_above(pre, self.tau, self.slots, bias, self.scale)
                score.copy_(got_score), index.copy_(got_index)
            if self.scale is not None:  # the unscaled values (padding slots -> 0); the scores are > tau >= 0
                value = _value_at(pre, index, bias) * (torch.arange(self.slots, device=pre.device) < count[:, None])
                self.cand.value[s : s + n, : self.slots] = value.clamp_min(0)
            self.cand.floor[s : s + n] = torch.where(count > self.slots, float("inf"), max(self.tau, 0.0))
            self.filled[s : s + n] = count.clamp(max=self.slots)
            return
        # the first chunk: PROBE_ROWS rows, then the others with a hint of their c-th largest score taken from them
        # (as TopK's row_floor; row_topk's result is exact either way, and the code does not depend on which of
        # several scores tied with a row's c-th largest it keeps: that row's floor decides alone)
        probe = PROBE_ROWS if self.cand is None and self.c < self.L and n > 2 * PROBE_ROWS else n
        part = row_candidates(pre[:probe], self.c, self.scale, self.row_topk, bias)
        if probe < n:
            hint = float(torch.quantile(part.floor.float(), FLOOR_QUANTILE))
            rest = row_candidates(pre[probe:], self.c, self.scale, self.row_topk, bias, hint if hint > 0 else -math.inf)
            part = Candidates(*(torch.cat(ts) for ts in zip(part, rest)))
        if self.cand is None:
            self.tau = batch_cutoff(part, self.k)
            score, index = part.score.new_empty(self.B, self.width), part.index.new_empty(self.B, self.width)
            value = score if self.scale is None else part.value.new_empty(self.B, self.width)  # None: the scores
            self.cand = Candidates(score, value, index, part.floor.new_empty(self.B))
        c = self.c
        self.cand.score[s : s + n, :c], self.cand.index[s : s + n, :c] = part.score, part.index
        self.cand.score[s : s + n, c:], self.cand.index[s : s + n, c:] = 0, 0  # the padding (chunk 0: to the slots)
        if self.scale is not None:
            self.cand.value[s : s + n, :c], self.cand.value[s : s + n, c:] = part.value, 0
        self.cand.floor[s : s + n] = part.floor
        self.filled[s : s + n] = c

    def select(self, full_rows: Callable[[Tensor], tuple[Tensor, Tensor]]) -> Selection:
        """The exact top k*B of the batch (:func:`batch_from_candidates`)."""
        if self.batch_pack is not None:
            packed = self.batch_pack(self.cand, min(self.k * self.B, self.B * self.L), full_rows, self.filled)
            if packed is not None:
                return Selection(*packed)
        return batch_from_candidates(self.cand, self.k, self.L, full_rows)


def batch_from_candidates(cand: Candidates, k: int, L: int,
                          full_rows: Callable[[Tensor], tuple[Tensor, Tensor]]) -> Selection:
    """Exact top k*B of the batch from per-row candidates [B, c]; ``full_rows(rows)`` returns
    (score, value) [n, L] of whole rows, called only for rows the candidates cannot prove."""
    B, c = cand.score.shape
    n_keep = min(k * B, B * L)
    t = cand.score.flatten().topk(n_keep, sorted=False).values.min()
    # a row whose floor is the cut may hold more entries equal to it than its candidates show
    unproven = (cand.floor > t) | ((cand.floor == t) & (t > 0))
    bad = torch.nonzero(unproven).flatten()
    if bad.numel() == 0:
        flat = torch.nonzero(cand.score.flatten() >= t).flatten()  # every entry tied with the cut is kept too
        rows, cols, values = flat // c, cand.index.flatten()[flat], cand.value.flatten()[flat]
    else:
        # only entries >= t can be kept (the true threshold is >= t): the good rows' candidates and the
        # unproven rows' recomputed entries that pass t form an exact, small pool
        log.debug("batch top-k: %d of %d rows unproven by %d candidates; recomputing them", bad.numel(), B, c)
        good = torch.nonzero(~unproven).flatten()
        g_s, g_v, g_i = cand.score[good], cand.value[good], cand.index[good]
        g_r, g_c = torch.nonzero(g_s >= t, as_tuple=True)
        full_score, full_value = full_rows(bad)
        b_r, b_c = torch.nonzero(full_score >= t, as_tuple=True)
        if g_r.numel() + b_r.numel() < n_keep:
            # the rows are recomputed by another matmul than the candidates' (rows apart, addmm against mm plus
            # the bias), which can round an entry at t to just below it: the pool then held fewer than k*B
            # entries and topk raised. The unproven rows' entries are then all taken (a row has L >= its c).
            b_r, b_c = torch.nonzero(full_score.new_ones(full_score.shape, dtype=torch.bool), as_tuple=True)
        pool_s = torch.cat([g_s[g_r, g_c], full_score[b_r, b_c]])
        pos = torch.nonzero(pool_s >= pool_s.topk(n_keep, sorted=False).values.min()).flatten()
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


def dense_aux(x: Tensor, W_enc: Tensor, b_enc: Tensor, cols: Tensor, kk: int) -> Tensor:
    """The AuxK code over the dead latents ``cols`` [n] as a dense [B, n]: ReLU(x W_enc[:, cols] + b_enc[cols])
    kept at each row's top ``kk``, zero elsewhere; plain autograd (matmuls) into x, W_enc and b_enc."""
    W_dead = W_enc.t().index_select(0, cols)  # [n, D]: rows of latent-major storage, grads back into rows
    act = torch.relu(torch.addmm(b_enc.index_select(0, cols), x, W_dead.t()))
    with torch.no_grad():
        keep = torch.zeros_like(act, dtype=torch.bool).scatter_(1, act.topk(kk, dim=1, sorted=False).indices, True)
    return act * keep
