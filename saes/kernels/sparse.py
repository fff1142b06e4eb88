"""Sparse autograd shared by every fast implementation, parameterised by a small ``Backend``.

A TopK step computes the pre-activations once (one dense matmul, ``pre [B, L]``), selects, and from then
on touches only the B*K selected entries: the encoder backward is ``grad_x = S_g W_enc^T`` and
``grad_W_enc = x^T S_g`` with ``S_g`` the sparse [B, L] gradient at the selected entries; the decode is
an embedding-bag sum and its backward a gather-dot (values) and a scatter (W_dec rows).
``pre`` is computed in row chunks on CPU and freed as soon as each chunk is selected; nothing saved for
backward is [B, L].

A backend supplies the primitives (``torch``, ``numba``, ``triton``); ``torch_impl.torch_backend()`` is the
portable one (index_add / embedding_bag), usable on any device.

Shapes: x [B, D], W_enc [D, L], b_enc [L], W_dec [L, D], b_dec [D], idx / val [B, K].
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .copies import rounded
from .select import BatchCandidates, Selection, dense_aux, row_floor, select_batch, select_rows
from .shift import centre, shift_grad


class Backend(NamedTuple):
    """The primitives a fast implementation provides (all without autograd)."""

    row_topk: Callable[..., tuple[Tensor, Tensor]]
    """(pre [B, L], k, cols [C] int64 or None, bias [L] or None, scale [L] or None, floor=-inf) -> scores
    [B, k], indices [B, k]: per row, the k largest scores (pre + bias) * scale (over the columns ``cols``).
    ``floor`` is only a hint (a guess of the rows' k-th largest score) a backend may use to skip work."""
    gather_sum: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
    """(idx [B, K], val [B, K], W [L, D], bias [D] or None) -> [B, D] = bias + sum_j val W[idx]."""
    gather_dot: Callable[..., Tensor]
    """(idx [B, K], G [B, D], W [L, D], val [B, K] or None) -> [B, K] = <G[b], W[idx[b, j]]>, 0 where
    ``val`` (when given) is 0: those entries may be skipped."""
    scatter_rows: Callable[[Tensor, Tensor, Tensor, int], Tensor]
    """(idx [B, K], val [B, K], A [B, D], L) -> [L, D] = sum over entries of val A[b] into row idx."""
    encoder_backward: Callable[..., tuple[Tensor | None, Tensor]]
    """(idx [B, K], g [B, K], x [B, D], W_enc [D, L], want_x=True) -> grad_x [B, D], grad_W_enc [D, L]; with
    ``want_x=False`` grad_x may be None (its gather-sum skipped)."""
    row_above: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
    """Optional (pre [B, L], tau, cap, bias or None, scale or None) -> scores [B, cap], indices [B, cap],
    count [B]: per row the scores (pre + bias) * scale above tau, the first cap of them (0-padded), and
    how many there are; with ``out=(scores, indices)`` (C-contiguous float32 / int64) written there and only the count
    returned. When present, a chunked BatchTopK collects the rows after the first chunk with a cutoff guessed from
    it instead of selecting 4k candidates per row, into its candidate buffer (``select.BatchCandidates``)."""
    row_above_floor: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
    """Optional (pre [B, L], bias [L], floor [L], cap) -> pre there [B, cap], indices [B, cap], count [B]: per
    row the columns with pre + bias > floor in column order, the first cap of them (0-padded), and how many
    there are. When present, ``encode_above`` tests each chunk in one pass instead of a compare and a nonzero,
    and takes the values from it instead of gathering them again."""
    batch_pack: Callable[..., tuple[Tensor, Tensor, Tensor] | None] | None = None
    """Optional (candidates [B, W] (``select.Candidates``), n_keep, full_rows, filled [B]: the slots each row fills, zeros
    after them) -> (values [B, K], indices [B, K], smallest) as ``select.batch_from_candidates`` returns them, or None
    where it does not apply (the torch form then)."""
    reads_bf16: bool = False
    """Whether the row primitives take bf16 pre-activations as they are (each element the float32 it is exactly,
    scores in the bias's float32): the bf16 encoder matmul's chunks are then selected without a float32 copy."""
    by_latent: Callable[[Tensor, Tensor, int], object | None] | None = None
    """Optional (idx [B, K], val [B, K], L) -> the code's entries bucketed by latent, or None where the code is too
    narrow to gain from it. When present, the sparse decode buckets its code once and runs its forward and its
    backward by latent (``latent_gather_sum``, ``latent_gather_dot``, ``latent_scatter``, all then required; the
    gather-dot only with ``skip_zero_grads``, since the buckets hold the nonzero entries only)."""
    latent_gather_sum: Callable[[object, Tensor, Tensor | None], Tensor] | None = None
    """(bucketed code, W [L, D], bias [D] or None) -> [B, D]: ``gather_sum`` of a code from ``by_latent``."""
    latent_gather_dot: Callable[[object, Tensor, Tensor], Tensor] | None = None
    """(bucketed code, G [B, D], W [L, D]) -> [B, K]: ``gather_dot`` of a code from ``by_latent``, 0 at zero values."""
    latent_scatter: Callable[[object, Tensor], Tensor] | None = None
    """(bucketed code, A [B, D]) -> [L, D]: ``scatter_rows`` of a code from ``by_latent``."""


# ---------------------------------------------------------------- autograd


def rows_read(W: Tensor, rows_dtype: torch.dtype | None, backend: Backend) -> Tensor:
    """The weights a gather reads: ``W`` itself (``rows_dtype`` None), else W rounded to ``rows_dtype`` (the cached
    copy of ``copies.rounded``): as it is for a backend that reads bf16 rows, else as W's dtype (same values)."""
    if rows_dtype is None or rows_dtype == W.dtype:
        return W
    low = rounded(W, rows_dtype)
    return low if backend.reads_bf16 and rows_dtype == torch.bfloat16 else low.to(W.dtype)


class _SparseDecode(torch.autograd.Function):
    """x_hat = b_dec + the code's rows of ``W_rows`` (W_dec, or W_dec rounded: ``rows_read``); the gradient of
    W_dec is the scatter of the code's values, which does not read the weights."""

    @staticmethod
    def forward(ctx, values, indices, W_dec, b_dec, backend, skip_zero_grads, W_rows):
        ctx.backend = backend
        # a mask: the values' gradient where it is True only, as gather_dot's ``val`` (0: skipped)
        ctx.mask = skip_zero_grads.to(values.dtype) if isinstance(skip_zero_grads, Tensor) else None
        ctx.skip_zero_grads = ctx.mask is None and skip_zero_grads
        ctx.has_bias = b_dec is not None
        ctx.W_dtype = W_dec.dtype
        ctx.save_for_backward(values, indices, W_rows)
        ctx.code = None if backend.by_latent is None else backend.by_latent(indices, values, W_rows.shape[0])
        if ctx.code is not None:
            return backend.latent_gather_sum(ctx.code, W_rows, b_dec).to(W_dec.dtype)
        return backend.gather_sum(indices, values, W_rows, b_dec).to(W_dec.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, W_rows = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_v = grad_W = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.code is not None and ctx.skip_zero_grads:
                grad_v = ctx.backend.latent_gather_dot(ctx.code, grad_out, W_rows).to(values.dtype)
            else:
                skip = ctx.mask if ctx.mask is not None else values if ctx.skip_zero_grads else None
                grad_v = ctx.backend.gather_dot(indices, grad_out, W_rows, skip).to(values.dtype)
        if ctx.needs_input_grad[2] and ctx.code is not None:
            grad_W = ctx.backend.latent_scatter(ctx.code, grad_out).to(ctx.W_dtype)
        elif ctx.needs_input_grad[2]:
            grad_W = ctx.backend.scatter_rows(indices, values, grad_out, W_rows.shape[0]).to(ctx.W_dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad_out.sum(0)
        return grad_v, None, grad_W, grad_b, None, None, None


class _SparseEncoderGrad(torch.autograd.Function):
    """Identity on the selected values in forward; the sparse encoder backward in backward, its grad_x from the rows
    of ``W_rows`` (W_enc, or W_enc rounded: ``rows_read``; grad_W_enc does not read the weights)."""

    @staticmethod
    def forward(ctx, x, W_enc, b_enc, indices, values, backend, W_rows):
        ctx.backend = backend
        ctx.L = W_enc.shape[1]
        ctx.W_dtype = W_enc.dtype
        ctx.save_for_backward(x, W_rows, indices, values > 0)
        return values.clone()

    @staticmethod
    def backward(ctx, grad_values):
        x, W_rows, indices, alive = ctx.saved_tensors
        g = (grad_values * alive).contiguous()
        grad_x = grad_W = grad_b = None
        if ctx.needs_input_grad[2]:
            grad_b = g.new_zeros(ctx.L, dtype=torch.float32).index_add_(0, indices.reshape(-1), g.reshape(-1).float())
            grad_b = grad_b.to(ctx.W_dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_x, grad_W = ctx.backend.encoder_backward(indices, g, x, W_rows, want_x=ctx.needs_input_grad[0])
            grad_x = grad_x.to(x.dtype) if ctx.needs_input_grad[0] else None
            grad_W = grad_W.to(ctx.W_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_W, grad_b, None, None, None, None


class _SparseGather(torch.autograd.Function):
    """values [B, K] = (x W_enc)[b, idx[b, j]] by a gather-dot (no [B, L]); backward: the sparse encoder
    backward, with no ReLU mask (the consumer decides which entries carry gradient)."""

    @staticmethod
    def forward(ctx, x, W_enc, indices, backend, given=None):
        ctx.backend = backend
        ctx.save_for_backward(x, W_enc, indices)
        if given is not None:  # the values, already computed by the selection (``encode_above``, SpaDE's search):
            return given  # returned as they are (autograd makes the output a view of them; a copy cost ~10 ms)
        return backend.gather_dot(indices, x, W_enc.t(), None).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_values):
        x, W_enc, indices = ctx.saved_tensors
        grad_x, grad_W = ctx.backend.encoder_backward(indices, grad_values.contiguous(), x, W_enc,
                                                      want_x=ctx.needs_input_grad[0])
        return (grad_x.to(x.dtype) if ctx.needs_input_grad[0] else None,
                grad_W.to(W_enc.dtype) if ctx.needs_input_grad[1] else None, None, None, None)


def gather_pre(x: Tensor, W_enc: Tensor, indices: Tensor, backend: Backend, values: Tensor | None = None) -> Tensor:
    """(x W_enc) at ``indices`` [B, K] -> [B, K], differentiable in x and W_enc through those entries only;
    ``values``: those products, already computed (returned as they are, no gather-dot)."""
    return _SparseGather.apply(x, W_enc, indices.contiguous(), backend, values)


def sparse_decode(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor | None, backend: Backend,
                  skip_zero_grads: bool | Tensor = False, rows_dtype: torch.dtype | None = None) -> Tensor:
    """x_hat [B, D] = sum_j values[:, j] W_dec[indices[:, j]] + b_dec (b_dec may be None), sparse backward;
    ``skip_zero_grads``: zero values get gradient 0 (a bool tensor [B, K]: the entries where it is False);
    ``rows_dtype``: the rows read rounded to it
    (``saes.kernels.sparse_decode``)."""
    return _SparseDecode.apply(values, indices.contiguous(), W_dec, b_dec, backend, skip_zero_grads,
                               rows_read(W_dec, rows_dtype, backend))


class Encoded(NamedTuple):
    """The codes of one fused encode: one matmul, then selection, then only sparse work."""

    values: Tensor  # [B, K] kept ReLU(pre) (zero at padding), differentiable in x, W_enc, b_enc
    indices: Tensor  # [B, K] int64
    aux_values: Tensor  # [B, K'] AuxK values among dead latents (K' = 0 when none), differentiable
    aux_indices: Tensor  # [B, K'] int64
    smallest: Tensor  # 0-dim: smallest kept activation (BatchTopK threshold update; 0 for TopK)


def encode(
    x: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    k: int,
    backend: Backend,
    *,
    batch: bool = False,
    scale: Tensor | None = None,
    dead: Tensor | None = None,
    k_aux: int = 0,
    dense_aux_ok: bool = True,
    mm_dtype: torch.dtype | None = None,
    shift: Tensor | None = None,
    row_scale: Tensor | None = None,
) -> Encoded:
    """ReLU(x W_enc + b_enc) -> TopK (per row) or BatchTopK (``batch=True``, top k*B of the batch, ranked
    by ``acts * scale`` when given), plus the AuxK code (top ``k_aux`` among ``dead`` [L] bool), all from
    one matmul. On CPU the matmul runs ROW_CHUNK rows at a time and each chunk is selected while it is
    still in cache, so no [B, L] buffer exists at all (BatchTopK keeps 4k candidates per row of the first
    chunk, then, with a backend that has ``row_above``, every entry above a cutoff guessed from them; the
    rows these cannot prove are recomputed). ``k=0`` skips the main code.

    With few dead latents (at most DENSE_AUX_FACTOR * k_aux) the AuxK code is dense over them, from a
    second, n_dead-wide matmul: values [B, n_dead] (zero outside each row's top k_aux) with indices the
    dead latents broadcast over rows (stride 0), which ``kernels.sparse_decode`` decodes with one matmul
    (``dense_aux``; ``dense_aux_ok=False`` keeps the [B, k_aux] form).

    ``mm_dtype`` (bf16, fp16): the matmul runs in that dtype and only chooses the entries; the kept values are
    recomputed in x's dtype (:func:`_exact_values`), so the selection reads rounded scores while the values, the
    loss and the weights' gradients stay float32 (``TrainConfig.precision``). The matmul reads the cached rounded
    copy of W_enc (``copies.rounded``: made once per update) and, with bf16, so does grad_x (``rows_read``)."""
    B, L = x.shape[0], W_enc.shape[1]
    kk = min(k_aux, 0 if dead is None else int(dead.sum().item()))
    cols = torch.nonzero(dead.to(x.device)).flatten() if kk else None
    dense = dense_aux_ok and bool(kk) and cols.numel() <= DENSE_AUX_FACTOR * kk
    # (``shift.py``; through autograd for a dense AuxK code, and where grad_x reads W_enc rounded to bf16)
    rounded_rows = mm_dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    x, shift, row_scale = centre(x, shift, not dense and not rounded_rows, row_scale)
    if dense:
        enc = encode(x, W_enc, b_enc, k, backend, batch=batch, scale=scale, mm_dtype=mm_dtype)
        return enc._replace(aux_values=dense_aux(x, W_enc, b_enc, cols, kk), aux_indices=cols.expand(B, -1))
    cpu = x.device.type == "cpu"
    step = ROW_CHUNK if cpu else max(B, 1)
    main, aux = [], []
    floor = float("-inf")
    cands = BatchCandidates(B, k, L, scale, step, backend.row_topk, backend.row_above,
                            backend.batch_pack) if batch and k else None
    low = mm_dtype is not None and mm_dtype != x.dtype
    direct = low and cpu and mm_dtype == torch.bfloat16 and backend.reads_bf16  # select the bf16 chunk itself
    with torch.no_grad():
        x_mm, W_mm = (x.to(mm_dtype), rounded(W_enc, mm_dtype)) if low else (x, W_enc)
        buf = x.new_empty(min(step, B), L) if cpu and not direct else None
        buf_mm = x_mm.new_empty(min(step, B), L) if cpu and low else buf
        for s in range(0, B, step):
            xs = x_mm[s : s + step]
            if cpu:  # into one reused chunk buffer; the selection adds b_enc (addmm would copy it in first)
                pre, bias = torch.mm(xs, W_mm, out=buf_mm[: xs.shape[0]]), b_enc
                pre = buf[: xs.shape[0]].copy_(pre) if low and not direct else pre
            else:
                pre, bias = torch.addmm(b_enc.to(W_mm.dtype), xs, W_mm).to(x.dtype), None
            if cands is not None:
                cands.add(pre, bias)
            elif k:
                main.append(select_rows(pre, k, backend.row_topk, bias, floor))
                floor = row_floor(main[0]) if len(main) == 1 else floor
            if kk:
                values, indices = backend.row_topk(pre, kk, cols, bias)
                aux.append(Selection(values.clamp_min(0), indices, None))
            del pre
        if cands is not None:
            sel = cands.select(lambda rows: _full_rows(x, W_enc, b_enc, scale, rows))
        else:
            sel = _join(main, x, B)
        aux_sel = _join(aux, x, B)
        idx = torch.cat([sel.indices, aux_sel.indices], dim=1)
        vals = torch.cat([sel.values, aux_sel.values], dim=1)
        K = sel.indices.shape[1]
        smallest = sel.smallest
        if low:
            vals = _exact_values(x, W_enc, b_enc, idx, vals, backend)
            kept = vals[:, :K][vals[:, :K] > 0]
            smallest = kept.min() if batch and kept.numel() else smallest  # the float32 value, as the code's
    W_rows = rows_read(W_enc, mm_dtype if low and mm_dtype == torch.bfloat16 else None, backend)
    out = _SparseEncoderGrad.apply(x, W_enc, b_enc, idx, vals, backend, W_rows)
    out = shift_grad(out, idx, W_enc, shift, vals > 0, row_scale, b_enc)
    return Encoded(out[:, :K], sel.indices, out[:, K:], aux_sel.indices, smallest)


def _exact_values(x: Tensor, W_enc: Tensor, b_enc: Tensor, idx: Tensor, vals: Tensor, backend: Backend) -> Tensor:
    """The kept entries ``idx`` [B, K] (chosen from a lower-precision matmul) at x's precision: relu(x W_enc + b_enc)
    there by a gather-dot (B*K*D, against B*L*D for the matmul), 0 where ``vals`` is 0 (padding)."""
    exact = backend.gather_dot(idx, x, W_enc.t(), None).to(x.dtype) + b_enc[idx]
    return torch.where(vals > 0, exact.clamp_min(0), vals)


# AuxK: a dense code over the dead latents when there are at most this many times k_aux of them. Dense
# costs ~5 matmuls of B x n_dead x D at the matmul rate, sparse ~5 gathers of B x k_aux rows of D at
# memory speed. TopK+AuxK step at D=768, L=16384, k=32, k_aux=384, B=4096 on 2 CPU cores, dense / sparse:
# 400 dead 806 / -, 1638 dead 1071 / 1488 ms, 3000 dead 1533 / 1965 ms, 6000 dead 2565 / 1665 ms
DENSE_AUX_FACTOR = 8


# CPU: rows of pre-activations computed and selected at a time ([512, 16384] float32 = 32 MiB, one buffer)
ROW_CHUNK = 512


def _join(parts: list[Selection], x: Tensor, B: int) -> Selection:
    """Concatenate per-chunk selections (an empty [B, 0] code when there are none)."""
    zero = x.new_zeros(()).detach()
    if not parts:
        return Selection(x.new_zeros(B, 0).detach(), torch.zeros(B, 0, dtype=torch.long, device=x.device), zero)
    return Selection(torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts]), zero)


def _full_rows(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor | None, rows: Tensor):
    """(score, value) [n, L] of whole rows, recomputed for the batch top-k rows candidates cannot prove."""
    value = torch.addmm(b_enc, x[rows], W_enc).clamp_min_(0)
    return (value if scale is None else value * scale.to(value.dtype)), value


def pack_rows(rows: Tensor, cols: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """(row, column) pairs sorted by row -> (indices [B, K], kept [B, K]) in the pairs' order per row, padded
    with (0, False) to K = the largest row count (at least 1)."""
    counts = torch.bincount(rows, minlength=B)
    K = max(int(counts.max()) if B else 0, 1)
    pos = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    indices = torch.zeros(B, K, dtype=torch.long, device=rows.device)
    kept = torch.zeros(B, K, dtype=torch.bool, device=rows.device)
    indices[rows, pos] = cols
    kept[rows, pos] = True
    return indices, kept


# encode_above: slots per row of the first pass, in units of k (a row with more is tested again, wider)
ABOVE_FLOOR_SLOTS = 4


def encode_above(x: Tensor, W_enc: Tensor, b_enc: Tensor, floor: Tensor, k: int,
                 backend: Backend, shift: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The entries of pre = x W_enc + b_enc above ``floor`` [L] (per latent), per row in latent order: (pre there
    [B, K], indices [B, K], kept [B, K]) padded with (0, 0, False) to the longest row; differentiable in x, W_enc
    and b_enc through those entries (no ReLU mask; b_enc gets none from the padding: mask with ``kept``). On CPU the
    matmul runs ROW_CHUNK rows at a time into one reused buffer; a backend with ``row_above_floor`` adds b_enc,
    tests each chunk in one pass with ABOVE_FLOOR_SLOTS * k slots per row (rows with more are tested again with as
    many slots as the chunk's longest) and returns the values with the entries; else a compare and a nonzero per
    chunk and a gather-dot for the values. ``k``, the expected entries per row, only sizes the slots."""
    x, shift, _ = centre(x, shift)
    B, L = x.shape[0], W_enc.shape[1]
    cpu = x.device.type == "cpu"
    step = ROW_CHUNK if cpu else max(B, 1)
    given = None
    with torch.no_grad():
        if not cpu or backend.row_above_floor is None or not B:
            rows, cols = [], []
            for s in range(0, B, step):
                r, c = (torch.addmm(b_enc, x[s : s + step], W_enc) > floor).nonzero(as_tuple=True)
                rows.append(r + s)
                cols.append(c)
            indices, kept = pack_rows(torch.cat(rows), torch.cat(cols), B) if B else (
                torch.zeros(0, 1, dtype=torch.long, device=x.device), torch.zeros(0, 1, dtype=torch.bool,
                                                                                  device=x.device))
        else:
            buf = x.new_empty(min(step, B), L)
            slots = min(L, ABOVE_FLOOR_SLOTS * max(k, 1))
            parts, counts = [], []
            for s in range(0, B, step):
                pre = torch.mm(x[s : s + step], W_enc, out=buf[: min(step, B - s)])
                val, idx, count = backend.row_above_floor(pre, b_enc, floor, slots)
                over = torch.nonzero(count > slots).flatten()
                wide = None
                if over.numel():  # rows with more entries than slots: again, as wide as the longest (rows copied)
                    again = backend.row_above_floor(pre.index_select(0, over), b_enc, floor, int(count.max()))
                    wide = (over + s, *again[:2])
                parts.append((s, val, idx, wide))
                counts.append(count)
            count = torch.cat(counts)
            K = max(int(count.max()), 1)
            # each chunk's slots copied straight into the [B, K] code (zero beyond each row's count, as the slots are)
            given, indices = torch.zeros(B, K, dtype=parts[0][1].dtype), torch.zeros(B, K, dtype=torch.long)
            for s, val, idx, wide in parts:
                n, w = val.shape[0], min(K, val.shape[1])
                given[s : s + n, :w], indices[s : s + n, :w] = val[:, :w], idx[:, :w]
                if wide is not None:
                    rows, wide_val, wide_idx = wide
                    given[rows, : wide_val.shape[1]], indices[rows, : wide_idx.shape[1]] = wide_val, wide_idx
            kept = torch.arange(K) < count[:, None]
    z = shift_grad(_SparseGather.apply(x, W_enc, indices.contiguous(), backend, given), indices, W_enc, shift)
    return z + _BiasAt.apply(b_enc, indices, kept), indices, kept


class _BiasAt(torch.autograd.Function):
    """b [L] at indices [B, K] -> [B, K]; b's gradient one index_add over the ``kept`` entries in order (b[indices]'s
    backward, an accumulating index_put over every slot: 52-68 ms a step at two threads for a code padded to ~500 slots
    a row at B 4096, ~46 kept, its sums in a thread-dependent order); the padding's gradients are not read."""

    @staticmethod
    def forward(ctx, b, indices, kept):
        flat, at = indices.flatten(), kept.flatten().nonzero().flatten()  # at: the kept entries' positions
        ctx.save_for_backward(flat.index_select(0, at), at)
        ctx.L = b.shape[0]
        return b.index_select(0, flat).view_as(indices)

    @staticmethod
    def backward(ctx, grad):
        columns, at = ctx.saved_tensors
        return grad.new_zeros(ctx.L).index_add_(0, columns, grad.flatten().index_select(0, at)), None, None


def batch_topk(acts: Tensor, k: int, scale: Tensor | None, backend: Backend) -> tuple[Tensor, Tensor, Tensor]:
    """Exact batch top-k of acts [B, L] (already >= 0); values differentiable in acts (by gather)."""
    with torch.no_grad():
        sel = select_batch(acts.detach(), k, scale, backend.row_topk)
        kept = sel.values > 0
    values = acts.gather(1, sel.indices) * kept
    return values, sel.indices, sel.smallest


def make_ops(backend: Backend):
    """The public operations of ``saes.kernels`` bound to ``backend``: (encode, encode_topk, batch_topk,
    sparse_decode, encode_aux, gather_pre, encode_above), with the signatures of ``reference.py``."""

    def _encode(x, W_enc, b_enc, k, *, batch=False, scale=None, dead=None, k_aux=0, mm_dtype=None, shift=None,
                row_scale=None):
        return encode(x, W_enc, b_enc, k, backend, batch=batch, scale=scale, dead=dead, k_aux=k_aux,
                      mm_dtype=mm_dtype, shift=shift, row_scale=row_scale)

    def _encode_topk(x, W_enc, b_enc, k):
        enc = encode(x, W_enc, b_enc, k, backend)
        return enc.values, enc.indices

    def _batch_topk(acts, k, scale=None):
        return batch_topk(acts, k, scale, backend)

    def _sparse_decode(values, indices, W_dec, b_dec, skip_zero_grads=False, rows_dtype=None):
        return sparse_decode(values, indices, W_dec, b_dec, backend, skip_zero_grads, rows_dtype)

    def _encode_aux(x, W_enc, b_enc, dead, k_aux):
        enc = encode(x, W_enc, b_enc, 0, backend, dead=dead, k_aux=k_aux, dense_aux_ok=False)
        return enc.aux_values, enc.aux_indices

    def _gather_pre(x, W_enc, indices, values=None):
        return gather_pre(x, W_enc, indices, backend, values)

    def _encode_above(x, W_enc, b_enc, floor, k=1, shift=None):
        return encode_above(x, W_enc, b_enc, floor, k, backend, shift)

    return _encode, _encode_topk, _batch_topk, _sparse_decode, _encode_aux, _gather_pre, _encode_above
