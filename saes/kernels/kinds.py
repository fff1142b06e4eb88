"""Sparse operations of the Matryoshka and SpaDE kinds (JumpReLU's ``encode_above`` is an op of its own), built
on the ``gather_pre`` and ``sparse_decode`` kernels so that nothing after the one encoder matmul is dense [B, L]
with autograd.

- ``encode_sparsemax``: sparsemax over a row's affine scores (SpaDE); the support of each chunk of rows comes from
  ``kernels.sparsemax_support`` (numba: per row the scores above a threshold guessed from the rows before, or one
  pass with a running bound of the threshold where the guess is not proved; torch: the top
  ``n_candidates`` scores, more where needed), and the output is packed, so its decode is a sparse decode.
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


def _gather_pre(x: Tensor, W_enc: Tensor, indices: Tensor, impl: str, values: Tensor | None = None) -> Tensor:
    from . import gather_pre

    return gather_pre(x, W_enc, indices, impl=impl, values=values)


def _support(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor, n_candidates: int,
             impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Without autograd: each row's sparsemax support from ``kernels.sparsemax_pack`` on chunks of the scores,
    packed: (indices [B, K], kept [B, K], size [B], the scores x W_enc + b_enc there [B, K], 0 at the padding)."""
    from . import sparsemax_pack

    B = x.shape[0]
    parts = []
    with torch.no_grad():
        # one chunk buffer for every chunk: a fresh [ROW_CHUNK, L] output is a fresh mapping, its pages faulted in at
        # every chunk (8 x 32 MiB a step at B 4096, L 16384)
        buf = x.new_empty(min(ROW_CHUNK, B), W_enc.shape[1], dtype=torch.result_type(x, W_enc))
        for s in range(0, B, ROW_CHUNK):
            xs = x[s : s + ROW_CHUNK]
            pre = torch.addmm(b_enc, xs, W_enc, out=buf[: xs.shape[0]])
            parts.append(sparsemax_pack(pre, scale, n_candidates, impl=impl))  # zero-padded after each support
        size = torch.cat([p[1] for p in parts])
        K = max(int(size.max()), 1)
        # the chunks' codes copied into the [B, K] code, each row zero-padded from its chunk's width on (one pass)
        indices = torch.empty(B, K, dtype=torch.long, device=x.device)
        scores = torch.empty(B, K, dtype=buf.dtype, device=x.device)
        s = 0
        for idx, n, sc in parts:
            w = idx.shape[1]
            indices[s : s + n.shape[0], :w], scores[s : s + n.shape[0], :w] = idx, sc
            indices[s : s + n.shape[0], w:], scores[s : s + n.shape[0], w:] = 0, 0.0
            s += n.shape[0]
        kept = torch.arange(K, device=x.device) < size[:, None]
        return indices, kept, size, scores


def encode_sparsemax(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor, n_candidates: int,
                     impl: str = "auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """f = sparsemax((x W_enc + b_enc) * scale) per row (``scale`` a 0-dim tensor), packed by decreasing f:
    (f [B, K], indices [B, K], the scores z there [B, K], kept [B, K]), differentiable in x, W_enc, b_enc
    and scale. The support comes from ``kernels.sparsemax_support`` (``n_candidates``: torch's first top-k)."""
    if _is_reference(impl, x.device):
        return reference.encode_sparsemax(x, W_enc, b_enc, scale)
    indices, kept, size, pre = _support(x, W_enc, b_enc, scale, n_candidates, impl)
    # z is the search's scores (x W_enc + b_enc) * scale themselves, not a second product: the gather-dot's
    # backward gives x and W_enc their gradients, b_enc's comes through b - b.detach() (0 in value)
    b = b_enc[indices]
    z = (_gather_pre(x, W_enc, indices, impl, pre) + (b - b.detach())) * scale
    tau = ((z * kept).sum(dim=1, keepdim=True) - 1) / size[:, None].clamp_min(1).to(z.dtype)
    return torch.where(kept, z - tau, 0.0).clamp_min(0), indices, z, kept


def encode_spade(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor, lam: Tensor, row_sq: Tensor,
                 n_candidates: int, impl: str = "auto", *,
                 value_scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SpaDE's code and distance term: f = sparsemax(z), z = (x W_enc + b_enc) * scale per row, packed as
    ``encode_sparsemax``'s, and ``sum_b sum_j f_bj max(row_sq[b] - z_bj / lam, 0)`` (0-dim): (f * value_scale, indices,
    kept, that sum), differentiable in x, W_enc, b_enc, scale, lam and row_sq [B] (``value_scale`` a number, the
    code's unit: SpaDE decodes c f; the numba tail writes it with f, in f's float32 rounding of ``f * value_scale``,
    and takes it out of f's gradient in its backward pass). The ``numba`` implementation (float32 CPU)
    computes tau, f and the sum in one pass per row and their gradients in one more (``numba_sparsemax.tail_*``),
    in place of ~40 torch passes over the [B, K] code forward and backward (~250 ms of CPU a step at SpaDE's ~1,100
    entries a row, B 4096, one thread); the others are ``encode_sparsemax`` and the distance term in torch."""
    if not _numba_float32("sparsemax_support", impl, x, W_enc, b_enc, scale, lam, row_sq):
        f, indices, z, kept = encode_sparsemax(x, W_enc, b_enc, scale, n_candidates, impl=impl)
        dist = (row_sq[:, None] - z / lam).clamp_min(0)
        return f * value_scale if value_scale != 1.0 else f, indices, kept, (f * dist * kept).sum()
    indices, kept, size, pre = _support(x, W_enc, b_enc, scale, n_candidates, impl)
    f, total = _SpadeTail.apply(_gather_pre(x, W_enc, indices, impl, pre), b_enc, indices, size, scale, lam, row_sq,
                                value_scale)
    return f, indices, kept, total


class _SpadeTail(torch.autograd.Function):
    """(u = the packed scores x W_enc + b_enc [B, K] (differentiable through ``gather_pre``), b_enc, indices, size,
    scale, lam, row_sq, value_scale) -> (f * value_scale [B, K], the distance term (0-dim)) by
    ``numba_sparsemax.tail_forward``; b_enc's
    gradient is grad_u summed into its indices, as the gather b_enc[indices] would give it."""

    @staticmethod
    def forward(ctx, u, b_enc, indices, size, scale, lam, row_sq, value_scale):
        import numpy as np

        from . import numba_sparsemax as ns

        B, K = u.shape
        un, rs = u.detach().contiguous().numpy(), row_sq.detach().contiguous().numpy()
        sz = size.numpy()
        f, tau, pen = np.empty((B, K), np.float32), np.empty(B, np.float32), np.empty(B, np.float64)
        ctx.scale_lam = np.float32(float(scale)), np.float32(float(lam))
        ctx.unit = np.float32(value_scale)  # (a number times a float32 tensor: torch multiplies in float32 too)
        ns.tail_forward(un, sz, *ctx.scale_lam, rs, ctx.unit, f, tau, pen)
        ctx.arrays = un, sz, rs, f, tau
        ctx.save_for_backward(indices, b_enc)
        return torch.from_numpy(f), torch.tensor(float(pen.sum()), dtype=u.dtype)

    @staticmethod
    def backward(ctx, grad_f, grad_total):
        import numpy as np

        from . import numba_sparsemax as ns

        un, sz, rs, f, tau = ctx.arrays
        indices, b_enc = ctx.saved_tensors
        s, lam = ctx.scale_lam
        B, K = un.shape
        gu, grs, ps, pl = np.empty((B, K), np.float32), np.empty(B, np.float32), np.empty(B), np.empty(B)
        ns.tail_backward(un, f, tau, sz, s, lam, rs, ctx.unit, grad_f.contiguous().numpy(),
                         np.float32(float(grad_total)), gu, grs, ps, pl)
        grad_u = torch.from_numpy(gu)
        grad_b = None
        if ctx.needs_input_grad[1]:  # index_add_'s sums (one thread, in the code's order) in numba: ~10 ms less a step
            grad_b = np.zeros(b_enc.shape[0], np.float32)
            ns.add_at(indices.contiguous().numpy().reshape(-1), gu.reshape(-1), grad_b)
            grad_b = torch.from_numpy(grad_b).to(b_enc.dtype)
        return (grad_u, grad_b, None, None, torch.tensor(float(ps.sum()), dtype=grad_u.dtype),
                torch.tensor(float(pl.sum()), dtype=grad_u.dtype), torch.from_numpy(grs), None)


def square_norms(W: Tensor, impl: str = "auto") -> Tensor:
    """|W[:, j]|^2 per column of W [D, L] -> [L], differentiable in W (SpaDE's prototype norms). The fast form's
    backward is one product in W's memory layout, ``W * 2 grad``, the reference's autograd value bit for bit
    (square's and sum's backward: the expanded gradient times 2 W): autograd's pow and expand backward, with their
    [D, L] temporaries and a gradient in another layout than W's, cost ~200 ms of CPU a step at L 16384, D 768."""
    if _is_reference(impl, W.device):
        return W.square().sum(dim=0)
    return _SquareNorms.apply(W)


class _SquareNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W: Tensor) -> Tensor:
        ctx.save_for_backward(W)
        return W.square().sum(dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (W,) = ctx.saved_tensors
        return torch.mul(W, (2 * grad)[None, :])  # the output takes W's layout (latent-major storage)


def _group_parts(values: Tensor, indices: Tensor, W_dec: Tensor, bounds: list[int], impl: str) -> Tensor:
    """[G, B, D]: part g is the decode of the code's entries in group g = [bounds[g-1], bounds[g]), no b_dec. The
    code is regrouped into G * B rows, row (g, b) holding row b's entries of group g (compacted, zero-padded to
    the largest group count), and decoded by ONE sparse decode; zero values get zero gradients."""
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
        n = G * B * width  # slot n: where padding and zeros go, cut off below (no boolean index, no nonzero)
        slot = torch.where(group < G, rows * width + pos, n).flatten()
        idx = torch.zeros(n + 1, dtype=torch.long, device=values.device)
        idx[slot] = indices.gather(1, order).flatten()
    vals = values.new_zeros(n + 1).index_put((slot,), values.gather(1, order).flatten())
    return sparse_decode(vals[:n].view(G * B, width), idx[:n].view(G * B, width), W_dec, None, impl=impl,
                         skip_zero_grads=True).view(G, B, -1)


def prefix_decodes(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, bounds: list[int],
                   impl: str = "auto") -> list[Tensor]:
    """Reconstructions from the code (values, indices) [B, K] restricted to the latents below each bound of
    the increasing ``bounds``: ``b_dec + sum_{j: index < m} v_j W_dec[index_j]``, [B, D] each. Each entry is
    decoded once, by ONE sparse decode of the code regrouped per group, and the G partial sums are accumulated
    in order. Zero values get zero gradients (``skip_zero_grads``), as the codes of ``kernels.encode`` need."""
    if _is_reference(impl, values.device):
        return reference.prefix_decodes(torch.where(values != 0, values, values.detach()), indices, W_dec, b_dec,
                                        bounds)
    out, running = [], None
    for part in _group_parts(values, indices, W_dec, bounds, impl).unbind(0):
        running = part if running is None else running + part
        out.append(running + b_dec)
    return out


def prefix_errors(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, bounds: list[int], x: Tensor,
                  impl: str = "auto") -> tuple[Tensor, list[Tensor]]:
    """Matryoshka's loss terms from ONE code: the whole reconstruction x_hat [B, D] (the last prefix's, as
    ``prefix_decodes(...)[-1]``) and, for every inner prefix g, ``|x - x_hat_g|^2`` summed over the batch (0-dim
    each, G - 1 of them); differentiable in values, W_dec and b_dec (x is data: no gradient).

    The fast form never builds the inner reconstructions: with t = x - b_dec and the groups' partial decodes p_h,
    the residuals are e_g = e_{g-1} - p_g, and the backward hands each part the sum of its prefixes' residual
    gradients in one reverse pass (``_PrefixErrors``): about a third of the [B, D] passes of decoding every
    prefix and differentiating G - 1 squared errors through autograd."""
    if _is_reference(impl, values.device):
        recons = prefix_decodes(values, indices, W_dec, b_dec, bounds, impl=impl)
        return recons[-1], [(x - r).pow(2).sum() for r in recons[:-1]]
    if _numba_float32("sparse_decode", impl, values, W_dec, b_dec, x):  # the same numbers from the code as it is, no regrouping
        from .numba_impl import prefix_errors as from_code

        return from_code(values, indices, W_dec, b_dec, bounds, x)
    parts = _group_parts(values, indices, W_dec, bounds, impl)
    x_hat, *errors = _PrefixErrors.apply(parts, b_dec, x.detach())
    return x_hat, errors


def _numba_float32(op: str, impl: str, *tensors: Tensor) -> bool:
    """Whether ``impl`` resolves to numba for ``op`` on these tensors, all float32 (what the numba forms of
    ``prefix_errors`` and ``encode_spade`` take)."""
    from . import resolve_impl

    t = tensors[0]
    return resolve_impl(op, impl, t.device, t.dtype) == "numba" and all(
        u.dtype == torch.float32 for u in tensors)


class _PrefixErrors(torch.autograd.Function):
    """(parts [G, B, D], b_dec [D], x [B, D]) -> (b_dec + sum_g parts_g, |x - b_dec - sum_{h<=g} parts_h|^2 for
    g < G - 1, each 0-dim)."""

    @staticmethod
    def forward(ctx, parts: Tensor, b_dec: Tensor, x: Tensor):
        e = x - b_dec
        residuals, errors = [], []
        for g in range(parts.shape[0]):
            e = e - parts[g]
            if g < parts.shape[0] - 1:
                residuals.append(e)
                errors.append(torch.dot(e.flatten(), e.flatten()))
        ctx.save_for_backward(*residuals)
        ctx.shape = parts.shape
        return (x - e, *errors)

    @staticmethod
    def backward(ctx, grad_x_hat: Tensor, *grad_errors: Tensor):
        residuals = ctx.saved_tensors
        G = ctx.shape[0]
        grad_parts = grad_x_hat.new_empty(ctx.shape)
        acc = grad_x_hat.clone()  # d loss / d (sum of parts up to g), summed over the prefixes g and beyond
        grad_parts[G - 1] = acc
        for g in range(G - 2, -1, -1):
            acc.add_(residuals[g], alpha=-2.0 * float(grad_errors[g]))
            grad_parts[g] = acc
        return grad_parts, acc.sum(dim=0), None


