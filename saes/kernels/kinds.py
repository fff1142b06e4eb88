"""Sparse operations of the JumpReLU, Matryoshka and SpaDE kinds, built on the ``gather_pre`` and
``sparse_decode`` kernels so that nothing after the one encoder matmul is dense [B, L] with autograd.

- ``encode_above``: the pre-activations above a per-latent floor (JumpReLU: its active entries and those in
  the threshold's rectangle window), as a packed code whose values are differentiable through those entries.
- ``encode_sparsemax``: sparsemax over a row's affine scores (SpaDE); the support is found from the top
  ``n_candidates`` scores of each row (the whole row is sorted only where the support may be larger), and
  the output is packed, so its decode is a sparse decode.
- ``prefix_decodes``: the reconstructions of nested prefixes of the latents from ONE code (Matryoshka): a
  prefix's reconstruction is a masked sparse decode; the code is split by group (each group's entries
  regrouped into G * B rows of one code), decoded by ONE sparse decode, and the groups summed cumulatively.

``impl="reference"`` runs the dense references of ``reference.py``; every test compares the two, values and
gradients. Codes are packed like every code here: [B, K] values and int64 indices, padded with index 0 and
``kept`` False (the padding's values are not meaningful: mask with ``kept``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference

# CPU rows of the dense scores selected at a time (a [512, L] buffer instead of [B, L])
ROW_CHUNK = 512


def _is_reference(impl: str, device: torch.device) -> bool:
    from . import resolve_impl

    return resolve_impl("gather_pre", impl, device) == "reference"


def _gather_pre(x: Tensor, W_enc: Tensor, indices: Tensor, impl: str) -> Tensor:
    from . import gather_pre

    return gather_pre(x, W_enc, indices, impl=impl)


def _pack_rows(rows: Tensor, cols: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """(row, column) pairs sorted by row -> (indices [B, K], kept [B, K]) in the pairs' order per row."""
    counts = torch.bincount(rows, minlength=B)
    K = max(int(counts.max()) if B else 0, 1)
    pos = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    indices = torch.zeros(B, K, dtype=torch.long, device=rows.device)
    kept = torch.zeros(B, K, dtype=torch.bool, device=rows.device)
    indices[rows, pos] = cols
    kept[rows, pos] = True
    return indices, kept


def encode_above(x: Tensor, W_enc: Tensor, b_enc: Tensor, floor: Tensor,
                 impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """The entries of pre = x W_enc + b_enc above ``floor`` [L] (per latent), per row in latent order:
    (pre there [B, K], indices [B, K], kept [B, K]); the values are differentiable in x, W_enc and b_enc."""
    if _is_reference(impl, x.device):
        return reference.encode_above(x, W_enc, b_enc, floor)
    B = x.shape[0]
    rows, cols = [], []
    with torch.no_grad():
        for s in range(0, B, ROW_CHUNK):
            r, c = (torch.addmm(b_enc, x[s : s + ROW_CHUNK], W_enc) > floor).nonzero(as_tuple=True)
            rows.append(r + s)
            cols.append(c)
        indices, kept = _pack_rows(torch.cat(rows), torch.cat(cols), B) if B else reference.pack(
            torch.zeros(0, W_enc.shape[1], dtype=torch.bool, device=x.device))
    return _gather_pre(x, W_enc, indices, impl) + b_enc[indices], indices, kept


def _support(z: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Sparsemax support of the rows of z [n, L] from their top m scores: (indices [n, m] by decreasing
    score, size [n]); a row whose support may exceed m is recomputed over the whole row."""
    L = z.shape[1]
    vals, idx = z.topk(min(m, L), dim=1, sorted=True)
    j = torch.arange(1, vals.shape[1] + 1, device=z.device, dtype=z.dtype)
    size = (1 + j * vals > vals.cumsum(dim=1)).sum(dim=1)
    full = (size == vals.shape[1]) & (vals.shape[1] < L)
    if full.any():
        rows = full.nonzero().flatten()
        sub_idx, sub_size = _support(z[rows], L)
        width = max(int(sub_size.max()), vals.shape[1])
        idx = torch.cat([idx, idx.new_zeros(z.shape[0], width - idx.shape[1])], dim=1)
        idx[rows] = sub_idx[:, :width]
        size[rows] = sub_size
    return idx, size


def encode_sparsemax(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor, n_candidates: int,
                     impl: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """f = sparsemax((x W_enc + b_enc) * scale) per row (``scale`` a 0-dim tensor), packed by decreasing f:
    (f [B, K], indices [B, K], the scores z there [B, K], kept [B, K]), differentiable in x, W_enc, b_enc
    and scale. The support comes from each row's top ``n_candidates`` scores (more where needed)."""
    if _is_reference(impl, x.device):
        return reference.encode_sparsemax(x, W_enc, b_enc, scale)
    B = x.shape[0]
    parts, sizes = [], []
    with torch.no_grad():
        for s in range(0, B, ROW_CHUNK):
            idx, size = _support(torch.addmm(b_enc, x[s : s + ROW_CHUNK], W_enc) * scale, n_candidates)
            parts.append(idx)
            sizes.append(size)
        size = torch.cat(sizes)
        K = max(int(size.max()), 1)
        indices = torch.cat([p[:, :K] if p.shape[1] >= K else
                             torch.cat([p, p.new_zeros(p.shape[0], K - p.shape[1])], dim=1) for p in parts])
        kept = torch.arange(K, device=x.device) < size[:, None]
        indices = indices * kept
    z = (_gather_pre(x, W_enc, indices, impl) + b_enc[indices]) * scale
    tau = ((z * kept).sum(dim=1, keepdim=True) - 1) / size[:, None].clamp_min(1).to(z.dtype)
    return torch.where(kept, z - tau, 0.0).clamp_min(0), indices, z, kept


def prefix_decodes(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, bounds: list[int],
                   impl: str = "auto") -> list[Tensor]:
    """Reconstructions from the code (values, indices) [B, K] restricted to the latents below each bound of
    the increasing ``bounds``: ``b_dec + sum_{j: index < m} v_j W_dec[index_j]``, [B, D] each. Each entry is
    decoded once, by ONE sparse decode: the code is regrouped into G * B rows, row (g, b) holding row b's
    entries of group g = [bounds[g-1], bounds[g]) (compacted, zero-padded to the largest group count), and
    the G partial sums are accumulated in order. Zero values get zero gradients (``skip_zero_grads``), as
    the codes of ``kernels.encode`` need."""
    if _is_reference(impl, values.device):
        return reference.prefix_decodes(torch.where(values != 0, values, values.detach()), indices, W_dec, b_dec,
                                        bounds)
    from . import sparse_decode

    B, G = values.shape[0], len(bounds)
    with torch.no_grad():
        group = torch.bucketize(indices, torch.tensor(bounds, device=indices.device), right=True).clamp_max(G - 1)
        group = group.masked_fill(values == 0, G)  # padding and zeros: a group of their own, never decoded
        order = torch.argsort(group, dim=1, stable=True)  # each row's entries by group, in code order within one
        group = group.gather(1, order)
        counts = torch.zeros(B, G + 1, dtype=torch.long, device=values.device).scatter_add_(1, group,
                                                                                            torch.ones_like(group))
        width = max(int(counts[:, :G].max()) if B else 0, 1)
        start = counts.cumsum(dim=1) - counts  # [B, G + 1]
        pos = torch.arange(indices.shape[1], device=values.device) - start.gather(1, group)
        rows = group * B + torch.arange(B, device=values.device)[:, None]  # row (g, b) of the regrouped code
        live = (group < G).flatten()
        slot = (rows * width + pos).flatten()[live]
        idx = torch.zeros(G * B * width, dtype=torch.long, device=values.device)
        idx[slot] = indices.gather(1, order).flatten()[live]
    vals = values.new_zeros(G * B * width).index_put((slot,), values.gather(1, order).flatten()[live])
    parts = sparse_decode(vals.view(G * B, width), idx.view(G * B, width), W_dec, None, impl=impl,
                          skip_zero_grads=True).view(G, B, -1)
    return list(parts.cumsum(dim=0) + b_dec)
