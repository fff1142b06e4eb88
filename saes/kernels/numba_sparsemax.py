"""SpaDE's support search in numba (``kernels.sparsemax_support``' ``numba`` implementation): per row, the support of
sparsemax(pre * scale) from one pass over the row, with a lower bound of the threshold found during that pass.

Any set v of a row's scores bounds its threshold tau from below: rho = (sum(v) - 1) / |v| <= tau, since
sum_j max(z_j - tau, 0) = 1 >= sum_{j in v} (z_j - tau). So a score at or below such a bound is outside the support
and is skipped. The pass keeps one such set (Condat's running set, L. Condat, "Fast projection onto the simplex and
the l1 ball", Math. Program. 2016): every score above its bound joins it, which raises the bound. The row is read
BLOCK columns at a time, a branch-free count of the scores above the bound first and scalar work only on the blocks
holding one; the scores above the bound go into a buffer. When the buffer fills it is narrowed by Michelot's
iteration (the buffer's own bound, which may be higher, becomes the set and the bound; the buffer is filtered by
it), and again at the end of the row.

A row after the first ``HISTORY`` of a thread's rows is first read with a guess t of its threshold (the lowest of
the last ``HISTORY`` rows' bounds less half their spread: rows of one batch have thresholds close together): its
scores above t only, found 32 columns at a time by one vector comparison (``numba_simd.above_mask``, scalar work on
the columns that pass), are narrowed as above; where the bound they give skips t itself, no score at or below t can be
in the support and the row is done; otherwise (0.6% of the rows in a simulation on the benchmark's scores at its
initialisation; never wrong, only slower) the row is searched as above. The margin's max|z| is then the largest of |t|
and the scores above t (those the support rule reads). On the AMX Xeon, the benchmark's SpaDE scores (~900 in the support, ~1,250 above the guess): 309
-> ~120 ms of CPU a step on one thread (the running bound's pass offered ~1,900 candidates a row and did scalar work
on nearly every block).

Only the remaining candidates are sorted (by decreasing score, ties by increasing column; a radix sort), and the
support is the torch rule's on them, in the same float32 roundings: ``size = #{j : 1 + j * z_(j) > cumsum_j}`` with
the cumulative sums accumulated in float64 and each rounded to float32 (as torch's CPU ``cumsum`` of float32 does), so
the support is the one torch's search and the dense reference find. The bound used for skipping sits
1e-6 * (|rho| + max|z| + 1) below rho, wider than that rule's rounding, so a score the rule would keep is never
skipped.

No ``fastmath``: ``1 + j * z`` must round twice, as torch's does.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .numba_simd import WIDTH, above_mask, lowest_bit

_MARGIN = 1e-6
BLOCK = 32  # scores tested at once (a branch-free count) before any scalar work on them
NARROW_ROUNDS = 64  # Michelot's rounds before the sort (more converge slowly: each removes few)
HISTORY = 8  # rows whose bounds guess the next row's threshold


@njit(cache=True, nogil=True, inline="always")
def _skip_below(rho, top):
    """The float32 bound under which a score is skipped: rho less a margin wider than the support rule's rounding."""
    return np.float32(rho - _MARGIN * (abs(rho) + top + 1.0))


@njit(cache=True, nogil=True, inline="always")
def _keep_above(bv, bi, n, thr):
    """Move the buffer's entries above thr to its front (in order); return how many there are and their sum."""
    m = 0
    total = 0.0
    for t in range(n):
        y = bv[t]
        bv[m] = y
        bi[m] = bi[t]
        keep = y > thr
        m += keep
        total += np.float64(y) if keep else 0.0
    return m, total


@njit(cache=True, nogil=True)
def _narrow(bv, bi, n, rho, top, rounds):
    """Michelot's iteration on the buffer (every entry above the current skip bound): the buffer's own bound
    (sum - 1) / n, where higher, becomes rho and the buffer is filtered by it, up to ``rounds`` times or until it
    removes none. Returns (n, rho, the buffer's sum)."""
    n, total = _keep_above(bv, bi, n, _skip_below(rho, top))
    for _ in range(rounds):
        if n == 0:  # scores that are not numbers (NaN) leave no candidate; the row's support is then empty
            break
        own = (total - 1.0) / n
        if not own > rho:
            break
        rho = own
        m, total = _keep_above(bv, bi, n, _skip_below(rho, top))
        if m == n:
            break
        n = m
    return n, rho, total


@njit(cache=True, nogil=True)
def _candidates(row, s, bv, bi):
    """One pass over the row: the scores row[c] * s above the running bound into bv / bi (buffers of the row's
    width); returns how many, the bound rho and the largest |score| seen. The set v is kept as its sum less one
    (``rest``) and its size; the scores of a block above rho join it (branch-free) and rho = rest / nv is taken
    once per block. A full buffer is narrowed (``_narrow``) and v becomes the buffer where that bound is higher."""
    L = row.shape[0]
    y = row[0] * s
    rest = np.float64(y) - 1.0
    nv = 1
    rho = rest
    top = abs(np.float64(y))
    thr = _skip_below(rho, top)
    bv[0] = y
    bi[0] = 0
    n = 1
    soft = min(L, 1024)  # narrowed when this full (doubled when that frees too few)
    c0 = 1
    while c0 < L:
        width = min(BLOCK, L - c0)
        hits = 0
        for u in range(width):
            hits += row[c0 + u] * s > thr
        if hits > 0:
            if n + width > soft:
                n, got, total = _narrow(bv, bi, n, rho, top, 4)
                if got > rho:
                    rho, rest, nv = got, total - 1.0, n
                if 2 * n > soft:
                    soft = min(L, 2 * soft)
            for u in range(width):  # branch-free: every score written, the count advanced by those above thr
                y = row[c0 + u] * s
                bv[n] = y
                bi[n] = c0 + u
                n += y > thr
                y64 = np.float64(y)
                join = y64 > rho  # v grows by the scores above its bound (each raises it)
                rest += y64 if join else 0.0
                nv += join
                top = max(top, abs(y64))
            rho = max(rho, rest / nv)
            thr = _skip_below(rho, top)
        c0 += width
    return n, rho, top


@njit(cache=True, nogil=True)
def _above(row, s, t, bv, bi):
    """The scores row[c] * s above t into bv / bi in column order, WIDTH columns tested at a time by one vector
    comparison; returns how many and the largest of |t| and their |score|."""
    L = row.shape[0]
    n = 0
    top = abs(np.float64(t))
    c0 = 0
    while c0 + WIDTH <= L:
        m = above_mask(row, c0, None, s, t)
        while m:
            c = c0 + lowest_bit(m)
            m &= m - np.uint32(1)
            y = row[c] * s
            bv[n] = y
            bi[n] = c
            n += 1
            top = max(top, abs(np.float64(y)))
        c0 += WIDTH
    for c in range(c0, L):
        y = row[c] * s
        if y > t:
            bv[n] = y
            bi[n] = c
            n += 1
            top = max(top, abs(np.float64(y)))
    return n, top


@njit(cache=True, nogil=True)
def _by_decreasing_score(bv, bi, n, ka, kb, ca, cb, counts):
    """The columns bi[:n] (increasing) ordered by decreasing score bv, ties by increasing column: a stable LSD radix
    sort on the 8-bit digits of a uint32 key per score that orders as the score descends (a pass whose digit every
    key shares is skipped). The order of sorting uint64 keys (score key high, column low), ~4x faster on a row's
    ~1,000 candidates. Returns the array (ca or cb) holding the ordered columns in [:n]."""
    bits = bv[:n].view(np.uint32)
    top = np.uint32(0x80000000)
    ones = np.uint32(0xFFFFFFFF)
    for t in range(n):
        u = bits[t]
        asc = (u ^ ones) if u >= top else (u | top)  # orders as the float does (negatives flipped)
        ka[t] = ones - asc
        ca[t] = bi[t]
    for shift in range(0, 32, 8):
        counts[:] = 0
        for t in range(n):
            counts[(ka[t] >> shift) & 0xFF] += 1
        if counts[(ka[0] >> shift) & 0xFF] == n:
            continue
        total = 0
        for d in range(256):
            c = counts[d]
            counts[d] = total
            total += c
        for t in range(n):
            d = (ka[t] >> shift) & 0xFF
            p = counts[d]
            kb[p] = ka[t]
            cb[p] = ca[t]
            counts[d] = p + 1
        ka, kb = kb, ka
        ca, cb = cb, ca
    return ca


@njit(cache=True, nogil=True)
def _row_support(row, s, guess, bv, bi, sort_buffers, out):
    """The sorted support of sparsemax(row * s) into out[:size]; returns size and the bound found (see the module's
    docstring; ``guess``: the threshold's guess, NaN for none)."""
    n = 0
    if not np.isnan(guess):
        t = np.float32(guess)
        n, top = _above(row, s, t, bv, bi)
        if n > 0:
            n, rho, _ = _narrow(bv, bi, n, -np.inf, top, NARROW_ROUNDS)
            if not _skip_below(rho, top) >= t:  # a score at or below t may be in the support
                n = 0
    if n == 0:
        n, rho, top = _candidates(row, s, bv, bi)
        n, rho, _ = _narrow(bv, bi, n, rho, top, NARROW_ROUNDS)
    ka, kb, ca, cb, counts = sort_buffers
    cols = _by_decreasing_score(bv, bi, n, ka, kb, ca, cb, counts)
    acc = 0.0
    size = 0
    one = np.float32(1.0)
    for j in range(n):
        c = cols[j]
        y = row[c] * s
        acc += np.float64(y)
        if one + np.float32(j + 1) * y > np.float32(acc):
            size += 1
        out[j] = c
    return size, rho


@njit(parallel=True, cache=True, nogil=True)
def _rows(pre, s, parts, out, size):
    n_rows, L = pre.shape
    for part in prange(parts):
        bv = np.empty(L, np.float32)
        bi = np.empty(L, np.int64)
        sort_buffers = (np.empty(L, np.uint32), np.empty(L, np.uint32), np.empty(L, np.int64), np.empty(L, np.int64),
                        np.empty(256, np.int64))
        recent = np.empty(HISTORY, np.float64)  # the last rows' bounds
        first = part * n_rows // parts
        for b in range(first, (part + 1) * n_rows // parts):
            seen = b - first
            guess = np.nan
            if seen >= HISTORY:
                low, high = recent[0], recent[0]
                for h in range(1, HISTORY):
                    low, high = min(low, recent[h]), max(high, recent[h])
                guess = low - 0.5 * (high - low)
            size[b], rho = _row_support(pre[b], s, guess, bv, bi, sort_buffers, out[b])
            recent[seen % HISTORY] = rho


@njit(parallel=True, cache=True, nogil=True)
def pack_rows(pre, cols, size, idx, scores):
    """Per row b of pre [n, L]: idx[b, j] = cols[b, j] and scores[b, j] = pre[b, cols[b, j]] for j < size[b], 0 after
    (idx [n, K] int64, scores [n, K] float32): the packed support and its scores from :func:`sparsemax_rows`' out, in
    one pass (torch's int64 conversion, mask, gather and mask of the [n, K] code were four)."""
    n, K = idx.shape
    for b in prange(n):
        m = size[b]
        for j in range(m):
            c = cols[b, j]
            idx[b, j] = c
            scores[b, j] = pre[b, c]
        for j in range(m, K):
            idx[b, j] = 0
            scores[b, j] = np.float32(0.0)


def sparsemax_rows(pre, s, out, size):
    """Per row b of pre [n, L] (float32): the support of sparsemax(pre[b] * s), by decreasing score, into
    out[b, :size[b]] (out [n, L]; the slots after a row's support hold other candidates or nothing). Each thread
    takes a range of rows and its own buffers of the row's width."""
    _rows(pre, s, max(1, min(numba.get_num_threads(), pre.shape[0])), out, size)


# ---------------------------------------------------------------- SpaDE's tail: sparsemax on the packed support


@njit(parallel=True, cache=True, nogil=True)
def tail_forward(u, size, s, lam, row_sq, unit, f, tau, pen):
    """Per row b of the packed scores u [B, K] (the support first, size[b] entries): z = u s, tau[b] = (sum z - 1) /
    size[b] (the sum in float64), f = max(z - tau, 0) on the support and 0 after it, written as f * unit (float32),
    and pen[b] = sum over the support of f max(row_sq[b] - z / lam, 0) (SpaDE's distance-weighted L1, in float64)."""
    B, K = u.shape
    zero = np.float32(0.0)
    for b in prange(B):
        n = size[b]
        acc = 0.0
        for j in range(n):
            acc += np.float64(u[b, j] * s)
        t = (np.float32(acc) - np.float32(1.0)) / np.float32(max(n, 1))
        tau[b] = t
        p = 0.0
        for j in range(n):
            z = u[b, j] * s
            v = max(z - t, zero)
            f[b, j] = v * unit
            p += np.float64(v * max(row_sq[b] - z / lam, zero))
        for j in range(n, K):
            f[b, j] = zero
        pen[b] = p


@njit(parallel=True, cache=True, nogil=True)
def tail_backward(u, f, tau, size, s, lam, row_sq, unit, grad_f, grad_pen, grad_u, grad_rs, part_s, part_lam):
    """The gradients of :func:`tail_forward`'s f * unit and sum(pen) (``f``: its output, f * unit; ``grad_f`` [B, K]
    that of f * unit, times unit in float32 for f's; ``grad_pen`` a float): grad_u [B, K],
    grad_rs [B] (of row_sq), and per row the parts of the gradients of s and lam (summed by the caller). Computed in
    float64 (the gradient of s sums terms that nearly cancel: the rows of sparsemax's Jacobian sum to 0)."""
    B, K = u.shape
    zero = np.float32(0.0)
    s64, lam64, gp = np.float64(s), np.float64(lam), np.float64(grad_pen)
    for b in prange(B):
        n = size[b]
        t = tau[b]
        total = 0.0
        for j in range(n):  # the gradient of z_j - tau where f's clamp passes it, in grad_u for now
            z = u[b, j] * s
            d = row_sq[b] - z / lam
            keep = z - t >= zero
            a = np.float64(grad_f[b, j] * unit) + gp * np.float64(max(d, zero)) if keep else 0.0  # decode's + penalty's
            grad_u[b, j] = a
            total += a
        mean = total / max(n, 1)
        gs, gl, gr = 0.0, 0.0, 0.0
        for j in range(n):
            z = u[b, j] * s
            d = row_sq[b] - z / lam
            gd = gp * np.float64(max(z - t, zero)) if d >= zero else 0.0  # the distance's (f: the forward's, again)
            a = np.float64(grad_u[b, j]) if z - t >= zero else 0.0
            gz = a - mean - gd / lam64
            grad_u[b, j] = gz * s64
            gs += gz * np.float64(u[b, j])
            gl += gd * np.float64(z) / (lam64 * lam64)
            gr += gd
        for j in range(n, K):
            grad_u[b, j] = zero
        part_s[b], part_lam[b], grad_rs[b] = gs, gl, gr


@njit(cache=True, nogil=True)
def add_at(idx, src, out):
    """out[idx[t]] += src[t] for every t in order, in float32: torch's CPU ``index_add_`` on a 1-D tensor (one thread,
    in the index's order), so the same sums bit for bit."""
    for t in range(idx.shape[0]):
        out[idx[t]] += src[t]
