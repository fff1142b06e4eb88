"""The selection scans' vector test of 32 columns (``numba_simd.above_mask``) against the same comparisons made one
element at a time in numpy float32: every bit, for float32 and bf16 rows, with and without bias and scale, one
threshold or one per column, NaN scores and ties at the threshold; a row it cannot read as a vector is refused."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.unit, pytest.mark.equivalence,
              pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")]

L = 200


def _masks(row, bias, scale, thr):
    from conceptdict.saes.kernels import numba_kernels as nk
    from numba import njit

    @njit
    def run(row, bias, scale, thr):
        out = np.zeros(row.shape[0] - nk.SCAN_BLOCK + 1, np.uint32)
        for c0 in range(out.shape[0]):
            out[c0] = nk.block_mask(row, c0, bias, scale, thr)
        return out

    return run(row, bias, scale, thr)


def _expected(scores: np.ndarray, thr) -> np.ndarray:
    above = scores > thr
    out = np.zeros(L - 31, np.uint32)
    for c0 in range(L - 31):
        for u in range(32):
            out[c0] |= np.uint32(above[c0 + u]) << np.uint32(u)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
@pytest.mark.parametrize("bias_on", [False, True])
@pytest.mark.parametrize("scale_on", [False, True])
@pytest.mark.parametrize("per_column", [False, True])
def test_the_vector_mask_is_the_scalar_comparisons_bit_for_bit(dtype, bias_on, scale_on, per_column):
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(L, generator=g)
    pre[5], pre[77] = float("nan"), float("inf")
    pre[10:20] = 0.5  # ties at the threshold below
    row = pre.to(torch.bfloat16) if dtype == "bf16" else pre
    bias = (torch.randn(L, generator=g) * 0.1) if bias_on else None
    scale = (torch.rand(L, generator=g) + 0.5) if scale_on else None
    thr = (torch.rand(L, generator=g)).numpy() if per_column else np.float32(0.5)
    scores = row.float().numpy().copy()
    if bias is not None:
        scores = scores + bias.numpy()
    if scale is not None:
        scores = scores * scale.numpy()
    want = _expected(scores, thr)
    arr = row.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else row.numpy()
    b = None if bias is None else bias.numpy()
    s = None if scale is None else scale.numpy()
    got = _masks(arr, b, s, thr)
    np.testing.assert_array_equal(got, want)
    assert want.any() and (want != np.uint32(0xFFFFFFFF)).any()  # the comparison went both ways
    wide = np.repeat(arr, 2)[::2]  # every other element of a wider row: not contiguous
    with pytest.raises(Exception, match="C-contiguous"):
        _masks(wide, b, s, thr)
