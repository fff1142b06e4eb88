"""CPU kernels in numba (``@njit(parallel=True, cache=True)``), imported only when the ``numba`` impl is used.

Every kernel reads float32 numpy arrays (zero-copy views of contiguous CPU tensors) and writes into a
preallocated output; ``numba_impl.py`` wraps them as a backend for the sparse autograd in ``sparse.py``. The
arrays read as rows (pre-activations, weight rows) may instead hold bfloat16 bit patterns (uint16 views of bf16
tensors): each element is read as the float32 it is exactly (:func:`at_f32`), so a kernel computes the same float32
sums on a bf16 tensor as on its float32 copy, reading half the bytes and making no copy.

Shapes: idx / val [B, K] (int64 / float32), W rows [L, D], x [B, D], W_enc [D, L].
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from . import numba_simd as simd

_OPTS = dict(parallel=True, cache=True, fastmath=True, nogil=True)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is ``bits`` (uint32): a register move, no memory round trip."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def at_f32(a, i):
    """a[i] as float32: an element of a float32 array, or of a bf16 tensor viewed as uint16 (its bits, shifted into
    the high half of a float32: the bf16 value exactly). Compiled per dtype (numba types the arrays apart)."""
    return np.float32(a[i])


@overload(at_f32, inline="always")
def _at_typed(a, i):
    if isinstance(a, types.Array) and a.dtype == types.uint16:
        def from_bf16(a, i):
            return _f32_from_bits(np.uint32(a[i]) << np.uint32(16))
        return from_bf16

    def plain(a, i):
        return a[i]
    return plain


@njit(**_OPTS)
def gather_sum(idx, val, W, bias, out):
    """out[b] = bias + sum_j val[b, j] * W[idx[b, j]]: the sparse decode forward (embedding-bag sum)."""
    B, K = idx.shape
    D = W.shape[1]
    for b in prange(B):
        for d in range(D):
            out[b, d] = bias[d]
        for j in range(K):
            v = val[b, j]
            if v != 0.0:
                w = W[idx[b, j]]
                for d in range(D):
                    out[b, d] += v * at_f32(w, d)


@njit(**_OPTS)
def gather_dot(idx, G, W, val, out):
    """out[b, j] = <G[b], W[idx[b, j]]>: the gradient of the decode with respect to the values; 0 without
    any work where val[b, j] == 0 (val None: every entry)."""
    B, K = idx.shape
    D = W.shape[1]
    for b in prange(B):
        for j in range(K):
            if val is not None and val[b, j] == 0.0:
                out[b, j] = 0.0
                continue
            w = W[idx[b, j]]
            s = np.float32(0.0)
            for d in range(D):
                s += G[b, d] * at_f32(w, d)
            out[b, j] = s


@njit(**_OPTS)
def project_rows(W, G):
    """In place, every row r: G[r] -= (<G[r], W[r]> / max(|W[r]|^2, 1e-24)) W[r]: the decoder gradient without its
    component along each row, in one pass over both (the dot and the norm together, then the update in cache)."""
    L, D = W.shape
    for r in prange(L):
        w = W[r]
        g = G[r]
        dot = np.float32(0.0)
        sq = np.float32(0.0)
        for d in range(D):
            dot += w[d] * g[d]
            sq += w[d] * w[d]
        c = dot / max(sq, np.float32(1e-24))
        for d in range(D):
            g[d] -= c * w[d]


@njit(cache=True)
def _bucket_by_latent(idx, val, L):
    """Counting sort of the B*K entries with a nonzero value by latent: (start [L+1], flat entry ids
    ordered by latent). Zero entries (padding of a BatchTopK code) add nothing to a scatter, so they
    are left out rather than piled onto latent 0."""
    flat = idx.ravel()
    fv = val.ravel()
    start = np.zeros(L + 1, np.int64)
    for e in range(flat.shape[0]):
        if fv[e] != 0.0:
            start[flat[e] + 1] += 1
    for r in range(L):
        start[r + 1] += start[r]
    fill = start[:-1].copy()
    order = np.empty(start[L], np.int64)
    for e in range(flat.shape[0]):
        if fv[e] != 0.0:
            r = flat[e]
            order[fill[r]] = e
            fill[r] += 1
    return start, order


@njit(**_OPTS)
def _scatter_buckets(start, order, val, A, K, out):
    L, D = out.shape
    flat_val = val.ravel()
    for r in prange(L):
        o = out[r]  # 1-D views: the row updates vectorise
        o[:] = 0.0
        for t in range(start[r], start[r + 1]):
            e = order[t]
            v = flat_val[e]
            if v != 0.0:
                a = A[e // K]
                for d in range(D):
                    o[d] += v * a[d]


def scatter_rows(idx, val, A, out):
    """out [L, D] = sum over entries (b, j) of val[b, j] * A[b] into row idx[b, j] (race-free, by latent)."""
    start, order = _bucket_by_latent(idx, val, out.shape[0])
    _scatter_buckets(start, order, val, A, idx.shape[1], out)


def scatter_rows_by_group(idx, val, As, bounds, out):
    """:func:`scatter_rows` where the rows of latent group g = [bounds[g-1], bounds[g]) read As[g] [B, D] (Matryoshka's
    prefixes: each group's latents get their own gradient rows); the same sums in the same order per latent."""
    start, order = _bucket_by_latent(idx, val, out.shape[0])
    lo = 0
    for g, hi in enumerate(bounds):
        _scatter_buckets(start[lo : hi + 1], order, val, As[g], idx.shape[1], out[lo:hi])
        lo = hi


TILE = 16  # latents per tile of the encoder backward (one 64-byte cache line of a W_enc row)


@njit(**_OPTS)
def _encoder_backward_tiles(start, order, g, x, W_enc, n_parts, grad_x_parts, grad_W):
    D, L = W_enc.shape
    K = g.shape[1]
    flat_g = g.ravel()
    n_tiles = (L + TILE - 1) // TILE
    for part in prange(n_parts):
        gx = grad_x_parts[part]
        Wt = np.empty((TILE, D), np.float32)
        Gt = np.empty((TILE, D), np.float32)
        for tile in range(part * n_tiles // n_parts, (part + 1) * n_tiles // n_parts):
            c0 = tile * TILE
            w = min(TILE, L - c0)
            for d in range(D):
                for u in range(w):
                    Wt[u, d] = W_enc[d, c0 + u]
            Gt[:] = 0.0
            for u in range(w):
                wt = Wt[u]
                gt = Gt[u]
                for t in range(start[c0 + u], start[c0 + u + 1]):
                    e = order[t]
                    gv = flat_g[e]
                    if gv != 0.0:
                        xr = x[e // K]
                        gr = gx[e // K]
                        for d in range(D):  # separate loops over 1-D views vectorise
                            gt[d] += gv * xr[d]
                        for d in range(D):
                            gr[d] += gv * wt[d]
            for d in range(D):
                for u in range(w):
                    grad_W[d, c0 + u] = Gt[u, d]


def encoder_backward(idx, g, x, W_enc, grad_x, grad_W):
    """The encoder backward restricted to the selected pre-activations: grad_x [B, D] = S_g W_enc^T and
    grad_W [D, L] = x^T S_g, where S_g [B, L] holds g [B, K] at idx [B, K].

    Entries are bucketed by latent; each thread owns a range of 16-latent tiles, loads the tile of
    W_enc (one cache line per input dimension), accumulates the tile of grad_W with contiguous
    vectorised row updates, and writes it back once. grad_x is summed over per-thread partials, so
    nothing races and nothing of size [B*K, D] or [B, L] is built."""
    start, order = _bucket_by_latent(idx, g, W_enc.shape[1])
    n_parts = numba.get_num_threads()
    parts = np.zeros((n_parts, x.shape[0], x.shape[1]), np.float32)
    _encoder_backward_tiles(start, order, g, x, W_enc, n_parts, parts, grad_W)
    np.sum(parts, axis=0, out=grad_x)


@njit(cache=True, nogil=True)
def _compact(bv, bi, n, k):
    """Move the k largest of bv[:n] (with their bi) to the front, in place (quickselect, no allocation);
    return k and the smallest of them."""
    lo, hi, target = 0, n - 1, k - 1
    while lo < hi:
        pivot = bv[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while bv[i] > pivot:
                i += 1
            while bv[j] < pivot:
                j -= 1
            if i <= j:
                bv[i], bv[j] = bv[j], bv[i]
                bi[i], bi[j] = bi[j], bi[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    smallest = bv[0]
    for t in range(1, k):
        smallest = min(smallest, bv[t])
    return k, smallest


@njit(cache=True, nogil=True)
def _sort_desc(bv, bi, k):
    """Insertion sort of the first k entries, largest first (k is small)."""
    for t in range(1, k):
        v, c = bv[t], bi[t]
        u = t - 1
        while u >= 0 and bv[u] < v:
            bv[u + 1], bi[u + 1] = bv[u], bi[u]
            u -= 1
        bv[u + 1], bi[u + 1] = v, c


SORT_MAX_K = 64  # row_topk returns its entries largest first up to this k (insertion sort is O(k^2))
_NO_FLOOR = np.float32(-np.inf)
SCAN_BLOCK = simd.WIDTH  # columns tested at once (one vector comparison) before any scalar work on them


@njit(cache=True, nogil=True, inline="always")
def _score(row, c, bias, scale):
    """(row[c] + bias[c]) * scale[c]; ``bias`` / ``scale`` None are compiled out (numba types None apart)."""
    v = at_f32(row, c)
    if bias is not None:
        v += bias[c]
    if scale is not None:
        v *= scale[c]
    return v


def block_mask(row, c0, bias, scale, thr):
    """Bit u set iff the score of column c0 + u (:func:`_score`) is above ``thr`` (a float32, or an array: its
    element c0 + u), u < SCAN_BLOCK: one vector comparison (``numba_simd.above_mask``, the float32 operations of
    :func:`_score`), so the common block (no bit) costs no scalar work."""


@overload(block_mask, inline="always")
def _block_mask_impl(row, c0, bias, scale, thr):
    if not simd.vectorisable(row, bias, scale, thr):  # numba_impl's wrappers pass contiguous float32 arrays
        raise TypeError(f"block_mask reads C-contiguous rows (uint16 or float32) and float32 bias / scale / "
                        f"thresholds; got {row}, {bias}, {scale}, {thr}: pass np.ascontiguousarray copies")
    return lambda row, c0, bias, scale, thr: simd.above_mask(row, c0, bias, scale, thr)


@njit(cache=True, nogil=True, inline="always")
def _offer(bv, bi, n, thr, cap, k, v, c, floor):
    """Keep column c with score v when it beats thr; a full buffer is compacted to its k best first
    (which raises thr, never below ``floor``). Returns the new (n, thr)."""
    if v > thr:
        if n == cap:
            n, thr = _compact(bv, bi, n, k)
            thr = max(thr, floor)
            if not (v > thr):
                return n, thr
        bv[n] = v
        bi[n] = c
        n += 1
    return n, thr


@njit(cache=True, nogil=True, inline="always")
def _scan_row(row, k, cap, bias, scale, floor, bv, bi):
    """The k largest scores of one whole row into bv[:k] / bi[:k] (see row_topk); returns the k-th
    largest. Scores at or below ``floor`` may be skipped: the result is exact when it is above floor."""
    L = row.shape[0]
    for t in range(cap):
        bv[t] = _score(row, t, bias, scale)
        bi[t] = t
    n, thr = _compact(bv, bi, cap, k)
    thr = max(thr, floor)
    c0 = cap
    while c0 + SCAN_BLOCK <= L:
        # only the columns above the block's starting threshold can pass _offer (thr never falls): the same offers
        m = block_mask(row, c0, bias, scale, thr)
        while m:
            c = c0 + simd.lowest_bit(m)
            m &= m - np.uint32(1)
            n, thr = _offer(bv, bi, n, thr, cap, k, _score(row, c, bias, scale), c, floor)
        c0 += SCAN_BLOCK
    for c in range(c0, L):
        n, thr = _offer(bv, bi, n, thr, cap, k, _score(row, c, bias, scale), c, floor)
    n, thr = _compact(bv, bi, n, k)
    return thr


@njit(parallel=True, cache=True, nogil=True)
def row_topk(pre, k, cols, bias, scale, floor, out_val, out_idx):
    """Per row, the k largest scores (pre[b, c] + bias[c]) * scale[c] over c in cols (all columns when
    cols is empty; bias and scale may be None); largest first when k <= SORT_MAX_K, in no particular
    order above (the AuxK code with k_aux = D/2).

    One pass per row: a candidate buffer of 4k entries seeded with the first columns, a running
    threshold (the k-th largest seen so far), and an in-place quickselect when the buffer fills. Over
    all columns the row is read SCAN_BLOCK columns at a time: one vector comparison of the scores with
    the threshold (:func:`block_mask`), and scalar work only on the scores above it. ``floor`` (-inf for
    none; whole rows only) starts the threshold at a guess of the k-th largest: scores at or below it
    are skipped, and a row whose k-th largest turns out below the guess is scanned again without it,
    so the result is exact either way. Ties are broken arbitrarily, as in torch.topk. Requires
    1 <= k <= number of columns scanned."""
    B, L = pre.shape
    use_cols = cols.shape[0] > 0
    n_cols = cols.shape[0] if use_cols else L
    cap = min(n_cols, 4 * k)
    for b in prange(B):
        row = pre[b]
        bv = np.empty(cap, np.float32)
        bi = np.empty(cap, np.int64)
        if use_cols:
            for t in range(cap):
                bv[t] = _score(row, cols[t], bias, scale)
                bi[t] = cols[t]
            n, thr = _compact(bv, bi, cap, k)
            for t in range(cap, n_cols):
                c = cols[t]
                n, thr = _offer(bv, bi, n, thr, cap, k, _score(row, c, bias, scale), c, _NO_FLOOR)
            n, thr = _compact(bv, bi, n, k)
        else:
            thr = _scan_row(row, k, cap, bias, scale, floor, bv, bi)
            if thr <= floor:  # the guess was too high for this row: something above the k-th was skipped
                thr = _scan_row(row, k, cap, bias, scale, _NO_FLOOR, bv, bi)
        if k <= SORT_MAX_K:
            _sort_desc(bv, bi, k)
        for j in range(k):
            out_val[b, j] = bv[j]
            out_idx[b, j] = bi[j]


@njit(parallel=True, cache=True, nogil=True)
def row_above(pre, tau, cap, bias, scale, out_val, out_idx, count):
    """Per row, the scores (pre[b, c] + bias[c]) * scale[c] above ``tau`` (bias / scale may be None), in
    column order, the first ``cap`` of them into out_val / out_idx (the rest of the slots zeroed) and how
    many there are into count[b] (> cap: the row holds more than its slots).

    The batch top-k's pass once a cutoff is known: one vector comparison per SCAN_BLOCK columns, scalar
    work only on the blocks that hold a score above tau; no selection at all."""
    B, L = pre.shape
    for b in prange(B):
        row = pre[b]
        n = 0
        c0 = 0
        while c0 + SCAN_BLOCK <= L:
            m = block_mask(row, c0, bias, scale, tau)
            while m:
                c = c0 + simd.lowest_bit(m)
                m &= m - np.uint32(1)
                if n < cap:
                    out_val[b, n] = _score(row, c, bias, scale)
                    out_idx[b, n] = c
                n += 1
            c0 += SCAN_BLOCK
        for c in range(c0, L):
            v = _score(row, c, bias, scale)
            if v > tau:
                if n < cap:
                    out_val[b, n] = v
                    out_idx[b, n] = c
                n += 1
        for j in range(min(n, cap), cap):
            out_val[b, j] = 0.0
            out_idx[b, j] = 0
        count[b] = n


@njit(parallel=True, cache=True, nogil=True)
def row_above_floor(pre, bias, floor, cap, out_val, out_idx, count):
    """Per row, the columns c with pre[b, c] + bias[c] > floor[c] (a floor per column), in column order: the
    first ``cap`` into out_idx and their pre[b, c] (without bias) into out_val (the rest of the slots zeroed),
    and how many there are into count[b]
    (> cap: the row holds more than its slots). JumpReLU's selection (``sparse.encode_above``): one
    vector comparison per SCAN_BLOCK columns (:func:`block_mask`), scalar work only on the entries above."""
    B, L = pre.shape
    for b in prange(B):
        row = pre[b]
        n = 0
        c0 = 0
        while c0 + SCAN_BLOCK <= L:
            m = block_mask(row, c0, bias, None, floor)
            while m:
                c = c0 + simd.lowest_bit(m)
                m &= m - np.uint32(1)
                if n < cap:
                    out_val[b, n] = at_f32(row, c)
                    out_idx[b, n] = c
                n += 1
            c0 += SCAN_BLOCK
        for c in range(c0, L):
            if at_f32(row, c) + bias[c] > floor[c]:
                if n < cap:
                    out_val[b, n] = at_f32(row, c)
                    out_idx[b, n] = c
                n += 1
        for j in range(min(n, cap), cap):
            out_val[b, j] = 0.0
            out_idx[b, j] = 0
        count[b] = n
