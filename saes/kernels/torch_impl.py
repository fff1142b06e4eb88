"""The ``torch`` implementation: sparse autograd with embedding_bag / index_add; any device, any float dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import adam_rows, project_rows  # noqa: F401  (elementwise and row sums: torch's ops are the kernel)
from .sparse import Backend, make_ops

# rows of [chunk, K, D] gathered at a time by the portable gather-dot (bounds its memory)
_CHUNK_ROWS = 1024



def torch_row_topk(pre: Tensor, k: int, cols: Tensor | None, bias: Tensor | None = None,
                    scale: Tensor | None = None, floor: float = float("-inf")) -> tuple[Tensor, Tensor]:
    score = pre if cols is None else pre.index_select(1, cols)
    if bias is not None:
        score = score + (bias if cols is None else bias[cols]).to(score.dtype)
    if scale is not None:
        score = score * (scale if cols is None else scale[cols]).to(score.dtype)
    values, pos = score.topk(k, dim=1, sorted=False)
    return values, (pos if cols is None else cols[pos])


def _torch_gather_sum(idx: Tensor, val: Tensor, W: Tensor, bias: Tensor | None) -> Tensor:
    out = F.embedding_bag(idx, W, per_sample_weights=val.to(W.dtype), mode="sum")
    return out if bias is None else out + bias


def _torch_gather_dot(idx: Tensor, G: Tensor, W: Tensor, val: Tensor | None = None) -> Tensor:
    out = G.new_empty(idx.shape)
    for s in range(0, idx.shape[0], _CHUNK_ROWS):
        rows = W[idx[s : s + _CHUNK_ROWS]]  # [c, K, D]
        out[s : s + _CHUNK_ROWS] = torch.bmm(rows, G[s : s + _CHUNK_ROWS, :, None].to(W.dtype))[..., 0].to(G.dtype)
    return out if val is None else out.masked_fill_(val == 0, 0)


def _torch_scatter_rows(idx: Tensor, val: Tensor, A: Tensor, L: int) -> Tensor:
    out = A.new_zeros(L, A.shape[1])
    for s in range(0, idx.shape[0], _CHUNK_ROWS):
        i, v, a = idx[s : s + _CHUNK_ROWS], val[s : s + _CHUNK_ROWS], A[s : s + _CHUNK_ROWS]
        contrib = (v.to(A.dtype)[:, :, None] * a[:, None, :]).reshape(-1, A.shape[1])
        out.index_add_(0, i.reshape(-1), contrib)
        del contrib
    return out


def _torch_encoder_backward(idx: Tensor, g: Tensor, x: Tensor, W_enc: Tensor) -> tuple[Tensor, Tensor]:
    """grad_x by embedding_bag over W_enc^T rows, grad_W_enc^T by index_add; grad_W_enc comes back in
    W_enc's layout (no copies for latent-major storage, SparseCoder's)."""
    latent_major = W_enc.t().is_contiguous()
    grad_x = _torch_gather_sum(idx, g, W_enc.t() if latent_major else W_enc.t().contiguous(), None)
    grad_W = _torch_scatter_rows(idx, g, x, W_enc.shape[1]).t()
    return grad_x, grad_W if latent_major else grad_W.contiguous()


def torch_backend() -> Backend:
    """The portable backend: embedding_bag / index_add / bmm in chunks; any device, any float dtype."""
    return Backend(torch_row_topk, _torch_gather_sum, _torch_gather_dot, _torch_scatter_rows, _torch_encoder_backward)


BACKEND = torch_backend()
encode, encode_topk, batch_topk, sparse_decode, encode_aux, gather_pre, encode_above = make_ops(BACKEND)
