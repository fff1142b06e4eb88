"""CPU kernels in numba (``@njit(parallel=True, cache=True)``), imported only when the ``numba`` impl is used.

Every kernel reads float32 numpy arrays (zero-copy views of contiguous CPU tensors) and writes into a
preallocated output; ``numba_impl.py`` wraps them as a backend for the sparse autograd in ``sparse.py``.

Shapes: idx / val [B, K] (int64 / float32), W rows [L, D], x [B, D], W_enc [D, L].
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_OPTS = dict(parallel=True, cache=True, fastmath=True, nogil=True)


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
                r = idx[b, j]
                for d in range(D):
                    out[b, d] += v * W[r, d]


@njit(**_OPTS)
def gather_dot(idx, G, W, out):
    """out[b, j] = <G[b], W[idx[b, j]]>: the gradient of the decode with respect to the values."""
    B, K = idx.shape
    D = W.shape[1]
    for b in prange(B):
        for j in range(K):
            r = idx[b, j]
            s = np.float32(0.0)
            for d in range(D):
                s += G[b, d] * W[r, d]
            out[b, j] = s


@njit(cache=True)
def _bucket_by_latent(idx, L):
    """Counting sort of the B*K entries by latent: (start [L+1], flat entry ids ordered by latent)."""
    flat = idx.ravel()
    start = np.zeros(L + 1, np.int64)
    for e in range(flat.shape[0]):
        start[flat[e] + 1] += 1
    for r in range(L):
        start[r + 1] += start[r]
    fill = start[:-1].copy()
    order = np.empty(flat.shape[0], np.int64)
    for e in range(flat.shape[0]):
        r = flat[e]
        order[fill[r]] = e
        fill[r] += 1
    return start, order


@njit(**_OPTS)
def _scatter_buckets(start, order, val, A, K, out):
    L, D = out.shape
    flat_val = val.ravel()
    for r in prange(L):
        for d in range(D):
            out[r, d] = 0.0
        for t in range(start[r], start[r + 1]):
            e = order[t]
            v = flat_val[e]
            if v != 0.0:
                b = e // K
                for d in range(D):
                    out[r, d] += v * A[b, d]


def scatter_rows(idx, val, A, out):
    """out [L, D] = sum over entries (b, j) of val[b, j] * A[b] into row idx[b, j] (race-free, by latent)."""
    start, order = _bucket_by_latent(idx, out.shape[0])
    _scatter_buckets(start, order, val, A, idx.shape[1], out)


@njit(**_OPTS)
def encoder_backward(idx, g, xT, W_enc, grad_xT, grad_W):
    """The encoder backward restricted to the selected pre-activations, one pass per input dimension d.

    grad_xT [D, B] = (S_g W_enc^T)^T and grad_W [D, L] = x^T S_g, where S_g [B, L] holds g at idx.
    Row d of W_enc and of grad_W (L floats) stay in cache while all B*K entries stream past; every
    thread owns whole rows of grad_W, so there are no races and no [B*K, D] intermediate."""
    D, L = W_enc.shape
    B, K = idx.shape
    for d in prange(D):
        for c in range(L):
            grad_W[d, c] = 0.0
        for b in range(B):
            xv = xT[d, b]
            s = np.float32(0.0)
            for j in range(K):
                gv = g[b, j]
                c = idx[b, j]
                s += gv * W_enc[d, c]
                grad_W[d, c] += gv * xv
            grad_xT[d, b] = s


@njit(cache=True, fastmath=False)
def _compact(bv, bi, n, k):
    """Keep the k largest of bv[:n] at the front; return the new count and the smallest kept value."""
    order = np.argsort(-bv[:n], kind="quicksort")[:k]
    tv = bv[order].copy()
    ti = bi[order].copy()
    bv[:k] = tv
    bi[:k] = ti
    return k, tv[k - 1]


@njit(parallel=True, cache=True, nogil=True)
def row_topk(pre, k, cols, out_val, out_idx):
    """Per row, the k largest of pre[b, cols] (all columns when cols is empty), largest first.

    One pass per row with a small candidate buffer (4k) and a running threshold; ties are broken
    arbitrarily, as in torch.topk. Requires 1 <= k <= number of columns scanned."""
    B = pre.shape[0]
    n_cols = cols.shape[0] if cols.shape[0] > 0 else pre.shape[1]
    cap = min(n_cols, 4 * k)
    for b in prange(B):
        bv = np.empty(cap, np.float32)
        bi = np.empty(cap, np.int64)
        n = 0
        thr = -np.inf
        for t in range(n_cols):
            c = cols[t] if cols.shape[0] > 0 else t
            v = pre[b, c]
            if v > thr or n < k:
                if n == cap:
                    n, thr = _compact(bv, bi, n, k)
                    if not (v > thr):
                        continue
                bv[n] = v
                bi[n] = c
                n += 1
        n, thr = _compact(bv, bi, n, k)
        for j in range(k):
            out_val[b, j] = bv[j]
            out_idx[b, j] = bi[j]
