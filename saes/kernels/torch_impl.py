"""The ``torch`` implementation: sparse autograd with embedding_bag / index_add; any device, any float dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference
from .reference import adam_rows, code_fired, project_rows  # noqa: F401  (torch's ops are the kernel)
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


def _torch_encoder_backward(idx: Tensor, g: Tensor, x: Tensor, W_enc: Tensor,
                            want_x: bool = True) -> tuple[Tensor | None, Tensor]:
    """grad_x by embedding_bag over W_enc^T rows (None with ``want_x=False``), grad_W_enc^T by index_add;
    grad_W_enc comes back in W_enc's layout (no copies for latent-major storage, SparseCoder's)."""
    latent_major = W_enc.t().is_contiguous()
    grad_x = _torch_gather_sum(idx, g, W_enc.t() if latent_major else W_enc.t().contiguous(), None) if want_x \
        else None
    grad_W = _torch_scatter_rows(idx, g, x, W_enc.shape[1]).t()
    return grad_x, grad_W if latent_major else grad_W.contiguous()


def sparsemax_support(pre: Tensor, scale: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The support of sparsemax(pre * scale) per row of pre [n, L] (``kernels.sparsemax_support``), from each row's
    top ``m`` scores and more where needed (``_support``): several passes over the scores (a multiplication, a top-k,
    for the rows whose support fills the m, a comparison with a bound and a gather)."""
    idx, size = _support(pre * scale, m)
    K = max(int(size.max()) if size.numel() else 0, 1)
    idx = idx[:, :K] if idx.shape[1] >= K else torch.cat([idx, idx.new_zeros(idx.shape[0], K - idx.shape[1])], dim=1)
    return idx * (torch.arange(K, device=idx.device) < size[:, None]), size


def sparsemax_pack(pre: Tensor, scale: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """``kernels.sparsemax_pack``: :func:`sparsemax_support` and a gather of the scores there."""
    idx, size = sparsemax_support(pre, scale, m)
    return idx, size, reference.scores_at_support(pre, idx, size)


def _support(z: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Sparsemax support of the rows of z [n, L] from their top m scores: (indices [n, m'], size [n]); the first
    ``size`` indices of a row are its support. A row whose support may exceed m is solved from every score above
    a lower bound of its threshold where few are (``_above_bound``), else from its top 4m scores, and so on; no
    row's L scores are sorted unless its support may exceed L / 4."""
    L = z.shape[1]
    vals, idx = z.topk(min(m, L), dim=1, sorted=True)
    j = torch.arange(1, vals.shape[1] + 1, device=z.device, dtype=z.dtype)
    cums = vals.cumsum(dim=1)
    size = (1 + j * vals > cums).sum(dim=1)
    full = (size == vals.shape[1]) & (vals.shape[1] < L)
    if full.any():
        rows = full.nonzero().flatten()
        # tau = max_j (S_j - 1) / j over the sorted prefixes of the support, which holds the top m: a lower bound
        lower = ((cums[rows] - 1) / j).max(dim=1).values
        sub_idx, sub_size = _above_bound(z[rows], lower, 4 * vals.shape[1])
        width = max(sub_idx.shape[1], vals.shape[1])
        idx = torch.cat([idx, idx.new_zeros(z.shape[0], width - idx.shape[1])], dim=1)
        idx[rows] = torch.cat([sub_idx, sub_idx.new_zeros(rows.shape[0], width - sub_idx.shape[1])], dim=1)
        size[rows] = sub_size
    return idx, size


def _above_bound(z: Tensor, lower: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The support of rows z [n, L] whose threshold is above ``lower`` [n]: when at most ``m`` scores of each row
    lie above it, those are gathered and sorted alone (the support is among them, and they are the top of the
    sorted row, so the rule on them is the rule on the whole row); otherwise ``_support`` from the top m."""
    above = z > lower[:, None]
    count = above.sum(dim=1)
    C = int(count.max())
    if C > m:
        return _support(z, m if m < z.shape[1] // 4 else z.shape[1])
    rows, cols = above.nonzero(as_tuple=True)  # row by row, columns increasing
    pos = torch.arange(rows.shape[0], device=z.device) - (count.cumsum(dim=0) - count)[rows]
    cand = torch.zeros(z.shape[0], C, dtype=torch.long, device=z.device)
    cand[rows, pos] = cols
    vals = z.gather(1, cand).masked_fill(torch.arange(C, device=z.device) >= count[:, None], float("-inf"))
    vals, order = vals.sort(dim=1, descending=True)
    j = torch.arange(1, C + 1, device=z.device, dtype=z.dtype)
    size = (1 + j * vals > vals.cumsum(dim=1)).sum(dim=1)
    return cand.gather(1, order), size


def torch_backend() -> Backend:
    """The portable backend: embedding_bag / index_add / bmm in chunks; any device, any float dtype."""
    return Backend(torch_row_topk, _torch_gather_sum, _torch_gather_dot, _torch_scatter_rows, _torch_encoder_backward)


BACKEND = torch_backend()
encode, encode_topk, batch_topk, sparse_decode, encode_aux, gather_pre, encode_above = make_ops(BACKEND)
