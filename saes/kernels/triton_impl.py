"""The ``triton`` implementation (GPU): Triton kernels for the sparse decode, its backward, and the encoder
backward, behind the sparse autograd of ``sparse.py``; selection uses torch.topk on the device.

Imported only on first use (``impl="triton"``, or "auto" on CUDA with triton installed). On a machine
without a GPU the kernels run through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before
this module is imported (how the tests check them on CPU at small shapes).

Kernels (fp32 accumulation, any float input dtype, arbitrary strides, so the encoder backward reuses
them on ``W_enc.t()`` without a transpose copy):
  gather_sum   out[b, :] = bias + sum_j val[b, j] W[idx[b, j], :]          grid (B, D / BLOCK_D)
  gather_dot   out[b, j] = <G[b, :], W[idx[b, j], :]>                       grid (B, K)
  scatter_rows out[idx[b, j], :] += val[b, j] A[b, :]  (fp32 atomics)       grid (B, D / BLOCK_D)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import adam_rows, code_fired, project_rows  # noqa: F401  (torch's ops are the kernel)
from .sparse import Backend, make_ops
from .torch_impl import sparsemax_pack, sparsemax_support, torch_row_topk  # noqa: F401  (the search: torch's)

BLOCK_D = 128
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _gather_sum_kernel(idx_ptr, val_ptr, w_ptr, bias_ptr, out_ptr, K, D,
                       s_ib, s_ik, s_vb, s_vk, s_wl, s_wd, s_ob, s_od,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(K):
        r = tl.load(idx_ptr + b * s_ib + j * s_ik)
        v = tl.load(val_ptr + b * s_vb + j * s_vk).to(tl.float32)
        w = tl.load(w_ptr + r * s_wl + d * s_wd, mask=mask, other=0.0).to(tl.float32)
        acc += v * w
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * s_ob + d * s_od, acc, mask=mask)


@triton.jit
def _gather_dot_kernel(idx_ptr, g_ptr, w_ptr, out_ptr, K, D,
                       s_ib, s_ik, s_gb, s_gd, s_wl, s_wd, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    r = tl.load(idx_ptr + b * s_ib + j * s_ik)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        mask = d < D
        g = tl.load(g_ptr + b * s_gb + d * s_gd, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r * s_wl + d * s_wd, mask=mask, other=0.0).to(tl.float32)
        acc += g * w
    tl.store(out_ptr + b * K + j, tl.sum(acc, axis=0))


@triton.jit
def _scatter_rows_kernel(idx_ptr, val_ptr, a_ptr, out_ptr, K, D,
                         s_ib, s_ik, s_vb, s_vk, s_ab, s_ad, s_ol, s_od, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    a = tl.load(a_ptr + b * s_ab + d * s_ad, mask=mask, other=0.0).to(tl.float32)
    for j in range(K):
        r = tl.load(idx_ptr + b * s_ib + j * s_ik)
        v = tl.load(val_ptr + b * s_vb + j * s_vk).to(tl.float32)
        tl.atomic_add(out_ptr + r * s_ol + d * s_od, v * a, mask=mask)


def _check(t: Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"impl='triton' needs CUDA tensors but got {t.device}; use impl='torch' or 'auto' "
                         f"(or set TRITON_INTERPRET=1 before import to run the kernels on CPU, slowly)")


def gather_sum(idx: Tensor, val: Tensor, W: Tensor, bias: Tensor | None) -> Tensor:
    _check(W)
    B, K = idx.shape
    D = W.shape[1]
    out = torch.empty(B, D, dtype=torch.float32, device=W.device)
    if B == 0:
        return out.to(W.dtype)
    grid = (B, triton.cdiv(D, BLOCK_D))
    _gather_sum_kernel[grid](idx, val, W, bias if bias is not None else out, out, K, D,
                             *idx.stride(), *val.stride(), *W.stride(), *out.stride(),
                             HAS_BIAS=bias is not None, BLOCK=BLOCK_D)
    return out.to(W.dtype)


def gather_dot(idx: Tensor, G: Tensor, W: Tensor, val: Tensor | None = None) -> Tensor:
    _check(W)
    B, K = idx.shape
    out = torch.empty(B, K, dtype=torch.float32, device=W.device)
    if B and K:
        _gather_dot_kernel[(B, K)](idx, G, W, out, K, W.shape[1], *idx.stride(), *G.stride(), *W.stride(),
                                   BLOCK=BLOCK_D)
    if val is not None:
        out.masked_fill_(val == 0, 0)
    return out.to(G.dtype)


def _scatter_into(out: Tensor, idx: Tensor, val: Tensor, A: Tensor) -> None:
    B, K = idx.shape
    D = A.shape[1]
    if B and K:
        grid = (B, triton.cdiv(D, BLOCK_D))
        _scatter_rows_kernel[grid](idx, val, A, out, K, D, *idx.stride(), *val.stride(), *A.stride(),
                                   *out.stride(), BLOCK=BLOCK_D)


def scatter_rows(idx: Tensor, val: Tensor, A: Tensor, L: int) -> Tensor:
    _check(A)
    out = torch.zeros(L, A.shape[1], dtype=torch.float32, device=A.device)
    _scatter_into(out, idx, val, A)
    return out.to(A.dtype)


def encoder_backward(idx: Tensor, g: Tensor, x: Tensor, W_enc: Tensor,
                     want_x: bool = True) -> tuple[Tensor | None, Tensor]:
    """grad_x = gather_sum over W_enc^T (a strided view, no copy; None with ``want_x=False``); grad_W_enc^T via
    atomics into [D, L]."""
    _check(W_enc)
    grad_x = gather_sum(idx, g, W_enc.t(), None) if want_x else None
    grad_W = torch.zeros_like(W_enc, dtype=torch.float32)  # W_enc's layout: rows of grad_W^T when latent-major
    _scatter_into(grad_W.t(), idx, g, x)
    return grad_x, grad_W


BACKEND = Backend(torch_row_topk, gather_sum, gather_dot, scatter_rows, encoder_backward)
encode, encode_topk, batch_topk, sparse_decode, encode_aux, gather_pre, encode_above = make_ops(BACKEND)
