"""BatchTopK's cut and packed code in numba (``select.batch_from_candidates`` for the ``numba`` backend).

The candidates of every row sit in one [B, W] buffer (``select.BatchCandidates``). The torch form takes the cut t, the
(k*B)-th largest candidate score, with a ``topk`` over the B*W scores, then a [B, W] mask, a ``nonzero``, gathers and
an argsort to pad the kept entries into [B, K] rows. Here the cut is a radix select over the scores' bits (two
counting passes: the scores are >= 0, so their float32 bit patterns order as they do), and one pass per row counts
the entries it keeps, a second writes them into the [B, K] code in latent order. The rules are the torch form's: the
same t, the same unproven rows (recomputed by the caller), the same pool of entries >= t for the cut among them, the
same tie rule (every entry equal to the cut kept) and every kept value > 0; the code is the torch form's bit for bit.
Scores that are NaN or negative (other than -0.0) are not ordered by their bits: :func:`kth_largest` then says so
and the caller takes the torch form.

Shapes: score / value [B, W] float32 (value may be score itself), index [B, W] int64, floor [B] float32, width [B]
int64: the slots of row b from width[b] on hold zeros (score and value +0.0), counted without being read.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

_BINS = 1 << 16  # the radix: a score's 32 bits in two halves
_SIGN = np.uint32(0x80000000)


@njit(parallel=True, cache=True, nogil=True)
def _histogram(score, bits, width, skip, lower, high, hists):
    """Add to ``hists`` [P, BINS] (a histogram per part of the rows, summed by the caller) the entries of the rows not
    ``skip``ped whose score is >= ``lower``: counted by the high 16 bits of their bit pattern (``high`` < 0), or,
    among those whose high bits are ``high``, by the low 16 bits. Row b's slots from width[b] on hold +0.0 and are
    counted without being read. Returns False at a NaN or a negative score other than -0.0 (counted as +0.0)."""
    B, W = score.shape
    P = hists.shape[0]
    ok = np.ones(P, np.bool_)
    for p in prange(P):
        hist = hists[p]
        for b in range(p * B // P, (p + 1) * B // P):
            if skip[b]:
                continue
            if lower <= 0.0 and high <= 0:
                hist[0] += W - width[b]
            for j in range(width[b]):
                v = score[b, j]
                if np.isnan(v):
                    ok[p] = False
                    break
                if not v >= lower:
                    continue
                key = bits[b, j]
                if key & _SIGN:
                    if v != 0.0:
                        ok[p] = False
                        break
                    key = np.uint32(0)
                if high < 0:
                    hist[key >> np.uint32(16)] += 1
                elif (key >> np.uint32(16)) == high:
                    hist[key & np.uint32(0xFFFF)] += 1
    return ok.all()


@njit(cache=True, nogil=True)
def _pick(hist, n):
    """The bin holding the n-th largest entry counted in ``hist`` (n >= 1) and that entry's rank inside the bin."""
    seen = 0
    for h in range(_BINS - 1, -1, -1):
        if seen + hist[h] >= n:
            return h, n - seen
        seen += hist[h]
    return -1, 0


def high_counts(parts) -> np.ndarray | None:
    """The entries of ``parts``, each (score [R, W], width [R] int64, skip [R] bool, lower): those >= lower of the rows
    not skipped (the slots of row r from width[r] on hold +0.0), counted by the high 16 bits of their scores' bit
    patterns; None at a NaN or a negative score (not ordered by its bits). ``.sum()``: how many there are."""
    hists = np.zeros((numba.get_num_threads(), _BINS), np.int64)
    for score, width, skip, lower in parts:
        if not _histogram(score, score.view(np.uint32), width, skip, np.float32(lower), -1, hists):
            return None
    return hists.sum(axis=0)


def kth_largest(parts, n: int, high: np.ndarray | None = None):
    """The n-th largest score (float32) among the entries of ``parts`` (as :func:`high_counts`'s, whose counts
    ``high`` may be given); None at a NaN or a negative score, or where there are fewer than n entries."""
    high = high_counts(parts) if high is None else high
    if high is None:
        return None
    top, rank = _pick(high, n)
    if top < 0:
        return None
    hists = np.zeros((numba.get_num_threads(), _BINS), np.int64)
    for score, width, skip, lower in parts:
        _histogram(score, score.view(np.uint32), width, skip, np.float32(lower), top, hists)
    low, _ = _pick(hists.sum(axis=0), rank)
    return np.array([(top << 16) | low], np.uint32).view(np.float32)[0]


@njit(parallel=True, cache=True, nogil=True)
def row_counts(score, value, width, full_row, full_score, full_value, t_good, t_full, counts):
    """counts[b]: the entries row b keeps, score >= the cut and value > 0, from its candidates' first width[b] slots
    (full_row[b] < 0; the others hold zeros) or from its recomputed row full_row[b] of full_score / full_value (cut
    ``t_full``)."""
    B = score.shape[0]
    for b in prange(B):
        r = full_row[b]
        n = 0
        if r < 0:
            for j in range(width[b]):
                if score[b, j] >= t_good and value[b, j] > 0:
                    n += 1
        else:
            for c in range(full_score.shape[1]):
                if full_score[r, c] >= t_full and full_value[r, c] > 0:
                    n += 1
        counts[b] = n


@njit(parallel=True, cache=True, nogil=True)
def pack_rows(score, value, index, width, full_row, full_score, full_value, t_good, t_full, out_val, out_idx, row_min):
    """The entries :func:`row_counts` counts, per row in latent order, into out_val / out_idx [B, K] (zeroed
    beyond each row's count), and each row's smallest kept value into row_min (+inf for none)."""
    B = score.shape[0]
    K = out_val.shape[1]
    for b in prange(B):
        r = full_row[b]
        n = 0
        least = np.float32(np.inf)
        if r < 0:
            for j in range(width[b]):
                v = value[b, j]
                if score[b, j] >= t_good and v > 0:
                    c = index[b, j]
                    u = n  # insertion by latent (the first chunk's candidates come by score)
                    while u > 0 and out_idx[b, u - 1] > c:
                        out_idx[b, u] = out_idx[b, u - 1]
                        out_val[b, u] = out_val[b, u - 1]
                        u -= 1
                    out_idx[b, u] = c
                    out_val[b, u] = v
                    n += 1
                    least = min(least, v)
        else:
            for c in range(full_score.shape[1]):
                v = full_value[r, c]
                if full_score[r, c] >= t_full and v > 0:
                    out_idx[b, n] = c
                    out_val[b, n] = v
                    n += 1
                    least = min(least, v)
        for j in range(n, K):
            out_val[b, j] = 0.0
            out_idx[b, j] = 0
        row_min[b] = least


@njit(cache=True, nogil=True)
def unproven_rows(floor, t, out):
    """out[b]: row b's candidates cannot prove the cut t (its floor above t, or at a positive t: it may hold more
    entries equal to t than its candidates show); returns how many."""
    n = 0
    for b in range(floor.shape[0]):
        out[b] = floor[b] > t or (floor[b] == t and t > 0)
        n += out[b]
    return n

