"""The update's one pass over a weight matrix in numba (``kernels.adam_rows``' ``numba`` implementation).

Per row of W [L, F]: the Adam step of every element (torch's fused CPU kernel's float32 arithmetic, operation for
operation, so the weights and moments are bit for bit torch's), then, for a unit-norm decoder, the row divided by
its norm, then the row rounded to bf16 into the step's copy of the weights (``copies.rounded``'s buffer). Torch's
form reads and writes the matrix three times (Adam; the norms and the division; the copy at the next read); this
reads W, its gradient and the two moments once and writes W, the moments and the copy once.

No ``fastmath`` here (unlike ``numba_kernels``): every float32 operation is rounded where torch's is, and the one
fused multiply-adds of torch's vectorised kernel (the first moment's ``lerp`` and the second moment's sum) are
``llvm.fma``, taken only where torch's kernel fuses them (``fma=True``: ATen's AVX2 and AVX-512 kernels; its portable
``default`` kernel rounds twice). tests/test_adam_rows.py checks the equality bit for bit under each capability.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

_TINY = np.float32(1e-12)


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (float32)."""
    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _bits(typingctx, x):
    """The bit pattern (uint32) of float32 x."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def _bf16_bits(x):
    """The bf16 bit pattern of float32 x, rounded to nearest even (a NaN stays a quiet NaN), as torch rounds."""
    bits = _bits(x)
    if np.isnan(x):
        return np.uint16(0x7FC0)
    bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16((bits + bias) >> np.uint32(16))


@njit(cache=True, nogil=True, inline="always")
def _adam_row(w, g, m, v, lerp_w, beta2, grad_w2, bc2_sqrt, eps, neg_step, fma):
    """Adam over one row, element by element (no reduction: the loop vectorises)."""
    if fma:  # torch's vectorised kernel: two of its multiply-adds are fused
        for j in range(w.shape[0]):
            gj = g[j]
            # exp_avg.lerp_(grad, 1 - beta1), torch's form for a weight below 0.5: exp_avg + w (grad - exp_avg)
            mj = _fma(lerp_w, gj - m[j], m[j])
            vj = _fma(grad_w2 * gj, gj, v[j] * beta2)
            m[j] = mj
            v[j] = vj
            w[j] = w[j] + neg_step * mj / (np.sqrt(vj) / bc2_sqrt + eps)
    else:
        for j in range(w.shape[0]):
            gj = g[j]
            mj = lerp_w * (gj - m[j]) + m[j]
            vj = v[j] * beta2 + grad_w2 * gj * gj
            m[j] = mj
            v[j] = vj
            w[j] = w[j] + neg_step * mj / (np.sqrt(vj) / bc2_sqrt + eps)


@njit(cache=True, nogil=True, inline="always")
def _row_norm(w, fma):
    """torch's ``w.norm()`` of one float32 row, to the bit: the squares summed in 8 lanes (element j into lane
    j mod 8, up to the last whole group of 8), the lanes added in order, then the remaining elements one by one
    (fused multiply-adds where ATen's kernel is AVX2 / AVX-512)."""
    F = w.shape[0]
    whole = F - F % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for j in range(0, whole, 8):
        a0 += w[j] * w[j]
        a1 += w[j + 1] * w[j + 1]
        a2 += w[j + 2] * w[j + 2]
        a3 += w[j + 3] * w[j + 3]
        a4 += w[j + 4] * w[j + 4]
        a5 += w[j + 5] * w[j + 5]
        a6 += w[j + 6] * w[j + 6]
        a7 += w[j + 7] * w[j + 7]
    ss = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    for j in range(whole, F):
        ss = _fma(w[j], w[j], ss) if fma else ss + w[j] * w[j]
    return np.sqrt(ss)


@njit(parallel=True, cache=True, nogil=True)
def adam_rows(W, G, M, V, lerp_w, beta2, grad_w2, bc2_sqrt, eps, neg_step, fma, unit, out_bits, write):
    """In place over rows of W, G, M, V [L, F] (float32): Adam, then (``unit``) each row divided by its norm
    (:func:`_row_norm`, clamped at 1e-12), then (``write``) the row's bf16 bits into out_bits [L, F] (uint16). The
    scalars are float32, as torch's kernel rounds its double coefficients to float32 before use. Each row is
    read from memory once: the norm, the division and the copy read it back from cache."""
    L, F = W.shape
    for r in prange(L):
        w = W[r]
        _adam_row(w, G[r], M[r], V[r], lerp_w, beta2, grad_w2, bc2_sqrt, eps, neg_step, fma)
        if unit:
            n = _row_norm(w, fma)
            if not n >= _TINY:  # clamp_min(1e-12) (a NaN norm stays NaN)
                n = n if np.isnan(n) else _TINY
            for j in range(F):
                w[j] = w[j] / n
        if write:
            o = out_bits[r]
            for j in range(F):
                o[j] = _bf16_bits(w[j])
