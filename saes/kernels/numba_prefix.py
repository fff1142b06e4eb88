"""Matryoshka's loss terms in numba (``kinds.prefix_errors`` with ``impl="numba"``): the prefixes' residuals from the
code as it is, row by row, instead of a decode of the code regrouped per group.

The generic path (``kinds._group_parts``) regroups the [B, K] code into G * B rows (row (g, b): row b's entries of
group g), decodes them into G partial reconstructions [G, B, D] (G times a decode's output: 63 MB at B 4096, D 768,
G 5, written at every step into fresh pages) and differentiates through them. Here :func:`prefix_residuals` walks
each row once: for g = 0 .. G-1 it sums the row's entries of group g (in code order, as the regrouped decode does)
into a D-wide part and subtracts it from the running residual x - b_dec, keeping the inner residuals; the backward
(``numba_impl.prefix_errors``) reads the code as it is too, one group at a time. The floating-point operations and
their order are the generic path's, so the results are its own bit for bit (``tests/test_architectures.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_OPTS = {"parallel": True, "cache": True, "fastmath": True, "nogil": True}  # as numba_kernels' kernels


@njit(**_OPTS)
def prefix_residuals(idx, val, grp, W, x, b_dec, res, x_hat):
    """Per row b, with e = x[b] - b_dec and part_g the sum of val * W[idx] over the row's entries of group g (grp
    [B, K]; zero values skipped): e -= part_g for g = 0 .. G-1 in turn, res[g, b] = e after group g for the inner
    groups g < G - 1 (res [G - 1, B, D]), and x_hat[b] = x[b] - e at the end."""
    B, K = idx.shape
    D = W.shape[1]
    G = res.shape[0] + 1
    for b in prange(B):
        e = np.empty(D, np.float32)
        part = np.empty(D, np.float32)
        for d in range(D):
            e[d] = x[b, d] - b_dec[d]
        for g in range(G):
            part[:] = 0.0
            for j in range(K):
                v = val[b, j]
                if v != 0.0 and grp[b, j] == g:
                    w = W[idx[b, j]]
                    for d in range(D):
                        part[d] += v * w[d]
            for d in range(D):
                e[d] = e[d] - part[d]
            if g < G - 1:
                r = res[g, b]
                for d in range(D):
                    r[d] = e[d]
        for d in range(D):
            x_hat[b, d] = x[b, d] - e[d]


@njit(**_OPTS)
def gather_dot_by_group(idx, grp, val, As, W, out):
    """out[b, j] = <As[grp[b, j], b], W[idx[b, j]]>, 0 where val[b, j] == 0: ``numba_kernels.gather_dot`` of each
    group's entries against that group's gradient rows (``numba_impl._PrefixErrors.backward``), all groups in one
    pass over the code; each dot the same float32 loop as gather_dot's."""
    B, K = idx.shape
    D = W.shape[1]
    for b in prange(B):
        for j in range(K):
            if val[b, j] == 0.0:
                out[b, j] = 0.0
                continue
            w = W[idx[b, j]]
            a = As[grp[b, j], b]
            s = np.float32(0.0)
            for d in range(D):
                s += a[d] * w[d]
            out[b, j] = s
