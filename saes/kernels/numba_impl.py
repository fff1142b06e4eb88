"""The ``numba`` implementation (CPU): numba kernels from ``numba_kernels.py`` behind the sparse autograd.

numba is imported when this module is (first use of ``impl="numba"`` or of "auto" on CPU), never at
package import. Kernels compute in float32; bf16 pre-activations and weight rows are read as they are (their bits,
each element the float32 it is exactly: ``numba_kernels.at_f32``), other dtypes are converted at the boundary.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import numba_batch as nb
from . import numba_kernels as nk
from . import numba_wide as nw
from . import reference
from .select import Candidates
from .sparse import Backend, make_ops

_NO_COLS = np.empty(0, np.int64)


def _start_pool_keeping_torch_threads() -> None:
    """Start numba's thread pool now, with torch's intra-op thread count kept as it was.

    Under numba's OpenMP layer the pool's start sets the calling thread's OpenMP thread count, which torch reads as
    its own, to numba's. Left to the first parallel kernel, a training run's first step ran torch on the count the
    user (or ``OMP_NUM_THREADS``) gave and every later step on numba's, while a second run in the same process stayed
    on the user's: where the rounding of a torch operation depends on its thread count, two runs of one seed
    differed, and a notebook's ``torch.set_num_threads`` was silently undone."""
    threads = torch.get_num_threads()
    nk.numba.get_num_threads()  # starts the pool
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_start_pool_keeping_torch_threads()

# Recycled [L, D] outputs (the W_dec and W_enc gradients): a fresh 50 MB array per step is a fresh mmap,
# faulted in page by page by the parallel kernel and unmapped when the gradient is dropped; that cost
# 60-190 ms per step at D=768, L=16384 (bench/train_step.py). An array is handed out again only when no
# tensor uses it any more: torch.from_numpy's storage holds a reference to the array, so any live tensor
# or view over it (a parameter's .grad included) shows in the array's reference count.
_RECYCLED: dict[tuple, list[np.ndarray]] = {}
_RECYCLE_PER_SHAPE = 4


def _recycled(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised array of ``shape`` and ``dtype``, reused from an earlier call when nothing holds it."""
    arrays = _RECYCLED.setdefault((shape, np.dtype(dtype).str), [])
    for a in arrays:
        if sys.getrefcount(a) == 3:  # the list, this loop's name and getrefcount's argument
            return a
    a = np.empty(shape, dtype)
    if len(arrays) < _RECYCLE_PER_SHAPE:
        arrays.append(a)
    return a


def release_buffers() -> None:
    """Drop the recycled arrays (those still in use stay alive with their tensors) and the last code's buckets."""
    _RECYCLED.clear()
    _LAST_CODE.clear()


def _f32(t: Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _rows(t: Tensor) -> np.ndarray:
    """A tensor the kernels read element by element as float32: a bf16 one as its bits (uint16, no copy), else
    float32."""
    if t.dtype == torch.bfloat16:
        return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
    return _f32(t)


def _scores(pre: Tensor, bias: Tensor | None) -> torch.dtype:
    """The dtype of the scores pre + bias: the wider of the two (float32 for bf16 pre-activations and a float32
    bias, as the kernel computed them)."""
    return pre.dtype if bias is None else torch.promote_types(pre.dtype, bias.dtype)


def _i64(t: Tensor) -> np.ndarray:
    return t.detach().to(torch.int64).contiguous().numpy()


def _check_cpu(t: Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"impl='numba' runs on CPU only but got a tensor on {t.device}; use impl='torch' or 'auto'")


def row_topk(pre: Tensor, k: int, cols: Tensor | None, bias: Tensor | None = None,
             scale: Tensor | None = None, floor: float = float("-inf")) -> tuple[Tensor, Tensor]:
    _check_cpu(pre)
    B = pre.shape[0]
    values = np.empty((B, k), np.float32)
    indices = np.empty((B, k), np.int64)
    nk.row_topk(_rows(pre), k, _NO_COLS if cols is None else _i64(cols), None if bias is None else _f32(bias),
                None if scale is None else _f32(scale), np.float32(floor), values, indices)
    return torch.from_numpy(values).to(_scores(pre, bias)), torch.from_numpy(indices)


def row_above(pre: Tensor, tau: float, cap: int, bias: Tensor | None = None,
              scale: Tensor | None = None, out: tuple[Tensor, Tensor] | None = None):
    """``Backend.row_above``; with ``out`` (scores [B, cap] float32 and indices [B, cap] int64, C-contiguous: rows of
    ``select.BatchCandidates``'s buffer) written there, and only the count returned."""
    _check_cpu(pre)
    B = pre.shape[0]
    if out is not None and not (out[0].dtype == torch.float32 and out[1].dtype == torch.int64
                                and all(t.is_contiguous() and t.shape == (B, cap) for t in out)):
        raise ValueError(f"row_above(out=) writes into C-contiguous float32 / int64 [{B}, {cap}] tensors; got "
                         f"{[(t.dtype, tuple(t.shape), t.is_contiguous()) for t in out]}")
    values, indices = (np.empty((B, cap), np.float32), np.empty((B, cap), np.int64)) if out is None else (
        out[0].numpy(), out[1].numpy())
    count = np.empty(B, np.int64)
    nk.row_above(_rows(pre), np.float32(tau), cap, None if bias is None else _f32(bias),
                 None if scale is None else _f32(scale), values, indices, count)
    if out is not None:
        return torch.from_numpy(count)
    return torch.from_numpy(values).to(_scores(pre, bias)), torch.from_numpy(indices), torch.from_numpy(count)


def batch_pack(cand: Candidates, n_keep: int, full_rows, width: Tensor | None = None):
    """``Backend.batch_pack``: ``select.batch_from_candidates``'s code (values [B, K], indices [B, K], smallest) from
    float32 candidates by ``numba_batch``'s radix cut and row packing (``width`` [B]: each row's filled slots, zeros
    after them; None: every slot read); None (take the torch form) where it does not apply: other dtypes, or a NaN
    or negative score."""
    if cand.score.dtype != torch.float32 or cand.value.dtype != torch.float32 or not cand.score.shape[0]:
        return None
    score, value, index, floor = (t.contiguous().numpy() for t in cand)
    B, W = score.shape
    width = np.full(B, W, np.int64) if width is None else _i64(width)
    keep_all = np.zeros(B, np.bool_)
    t = nb.kth_largest([(score, width, keep_all, -np.inf)], n_keep)
    if t is None:
        return None
    bad = np.empty(B, np.bool_)
    full_row = np.full(B, -1, np.int64)
    full_score = full_value = np.zeros((0, 1), np.float32)
    t_good = t_full = t
    if nb.unproven_rows(floor, t, bad):  # recomputed; the cut among the pool of every entry >= t (as the torch form)
        rows = np.flatnonzero(bad)
        full_score, full_value = (_f32(a) for a in full_rows(torch.from_numpy(rows)))
        full_row[rows] = np.arange(rows.size)
        every, whole = np.zeros(rows.size, np.bool_), np.full(rows.size, full_score.shape[1], np.int64)
        lower, pool = t, [(score, width, bad, t), (full_score, whole, every, t)]
        high = nb.high_counts(pool)
        if high is None:
            return None
        if high.sum() < n_keep:
            lower, pool = -np.inf, [(score, width, bad, t), (full_score, whole, every, -np.inf)]
            high = None
        t2 = nb.kth_largest(pool, n_keep, high)
        if t2 is None:
            return None
        t_good = max(t, t2)
        t_full = t_good if lower == t else t2  # (too few entries >= t: every entry of the unproven rows in the pool)
    counts = np.empty(B, np.int64)
    nb.row_counts(score, value, width, full_row, full_score, full_value, t_good, t_full, counts)
    K = max(int(counts.max()), 1)
    out_val, out_idx, row_min = np.empty((B, K), np.float32), np.empty((B, K), np.int64), np.empty(B, np.float32)
    nb.pack_rows(score, value, index, width, full_row, full_score, full_value, t_good, t_full, out_val, out_idx,
                 row_min)
    least = row_min.min()
    smallest = torch.tensor(least if np.isfinite(least) else 0.0, dtype=torch.float32)
    return torch.from_numpy(out_val), torch.from_numpy(out_idx), smallest


def row_above_floor(pre: Tensor, bias: Tensor, floor: Tensor, cap: int) -> tuple[Tensor, Tensor, Tensor]:
    _check_cpu(pre)
    B = pre.shape[0]
    values = np.empty((B, cap), np.float32)
    indices = np.empty((B, cap), np.int64)
    count = np.empty(B, np.int64)
    nk.row_above_floor(_rows(pre), _f32(bias), _f32(floor), cap, values, indices, count)
    return torch.from_numpy(values).to(pre.dtype), torch.from_numpy(indices), torch.from_numpy(count)


def gather_sum(idx: Tensor, val: Tensor, W: Tensor, bias: Tensor | None) -> Tensor:
    _check_cpu(W)
    D = W.shape[1]
    out = np.empty((idx.shape[0], D), np.float32)
    b = np.zeros(D, np.float32) if bias is None else _f32(bias)
    nk.gather_sum(_i64(idx), _f32(val), _rows(W), b, out)
    return torch.from_numpy(out).to(torch.promote_types(W.dtype, val.dtype))


def gather_dot(idx: Tensor, G: Tensor, W: Tensor, val: Tensor | None = None) -> Tensor:
    out = np.empty(tuple(idx.shape), np.float32)
    nk.gather_dot(_i64(idx), _f32(G), _rows(W), None if val is None else _f32(val), out)
    return torch.from_numpy(out).to(G.dtype)


def scatter_rows(idx: Tensor, val: Tensor, A: Tensor, L: int) -> Tensor:
    out = _recycled((L, A.shape[1]))  # every row is written
    nk.scatter_rows(_i64(idx), _f32(val), _f32(A), out)
    return torch.from_numpy(out).to(A.dtype)


class Buckets(NamedTuple):
    """A code's entries with a nonzero value bucketed by latent (``numba_wide.bucket``), for the passes by latent."""

    start: np.ndarray  # [L + 1] int64
    row: np.ndarray  # [N] int32
    value: np.ndarray  # [N] float32
    entry: np.ndarray  # [N] int32: b * K + j
    rows: int  # B
    width: int  # K
    dtype: torch.dtype  # the values'


def by_latent(idx: Tensor, val: Tensor, L: int) -> Buckets | None:
    """The code's entries bucketed by latent when it is wide (``numba_wide.WIDE_ENTRIES`` nonzero entries per latent
    on average: SpaDE's), else None (the row-ordered kernels; a padded code such as Matryoshka's regrouped one or a
    BatchTopK code counts its nonzero entries only)."""
    if idx.numel() < nw.WIDE_ENTRIES * L or L == 0 or idx.numel() >= 2**31:  # entry ids are int32
        return None
    nonzero = int(nw.count_nonzero(val.detach().contiguous().numpy().reshape(-1))) if val.dtype == torch.float32 \
        else int(torch.count_nonzero(val))  # (numba's: one pass at memory speed; torch's was ~8 ms a SpaDE code)
    if nonzero < nw.WIDE_ENTRIES * L:
        return None
    code = _same_entries(idx, val, nonzero)
    if code is None:
        _LAST_CODE.clear()  # (before the new buckets exist)
        code = Buckets(*nw.bucket(_i64(idx), _f32(val), L), idx.shape[0], idx.shape[1], val.dtype)
        _LAST_CODE.append((idx, idx._version, nonzero, code))
    return code


_LAST_CODE: list = []
"""The last code bucketed: (its indices tensor, that tensor's version, its nonzero count, its Buckets)."""


def _same_entries(idx: Tensor, val: Tensor, nonzero: int) -> Buckets | None:
    """The last bucketing with its values taken from ``val`` when val's nonzero entries are exactly its entries (the
    same indices tensor, unchanged since, and ``nonzero`` nonzero values all at its entries), else None. SpaDE's step
    buckets its code for the decode and the encoder's gradient on the same indices for the encoder backward: the
    same entries (the support) where no value rounds to 0, so the second bucketing is a gather of the values in the
    first's order, the arrays it would build bit for bit (~100 ms of CPU a step at the benchmark's shapes, one
    thread)."""
    if not _LAST_CODE:
        return None
    last, version, count, code = _LAST_CODE[0]
    if count != nonzero or last.data_ptr() != idx.data_ptr() or last.shape != idx.shape or \
            last.stride() != idx.stride() or idx._version != version or val.shape != idx.shape:
        return None
    value = np.empty(code.entry.shape[0], np.float32)
    if int(nw.take_nonzero(_f32(val).reshape(-1), code.entry, value)) != nonzero:  # (numpy's take: ~60 ms a step)
        return None
    return code._replace(value=value, dtype=val.dtype)


def latent_gather_sum(code: Buckets, W: Tensor, bias: Tensor | None) -> Tensor:
    """``gather_sum`` of a bucketed code: [B, D] = bias + sum_j val W[idx], by latent over blocks of rows."""
    _check_cpu(W)
    B, D = code.rows, W.shape[1]
    out = np.empty((B, D), np.float32)
    b = np.zeros(D, np.float32) if bias is None else _f32(bias)
    nw.gather_sum(code.start, code.row, code.value, _rows(W), b, nw.block_rows(B, D), out)
    return torch.from_numpy(out).to(torch.promote_types(W.dtype, code.dtype))


def latent_gather_dot(code: Buckets, G: Tensor, W: Tensor) -> Tensor:
    """``gather_dot`` of a bucketed code with ``skip_zero_grads``: [B, K] = <G[b], W[idx[b, j]]>, 0 where the value
    is 0; by latent over blocks of G's rows (``numba_wide.gather_dot``)."""
    out = np.empty((code.rows, code.width), np.float32)
    nw.gather_dot(code.start, code.row, code.entry, _f32(G), _rows(W), nw.block_rows(*G.shape), out)
    return torch.from_numpy(out).to(G.dtype)


def latent_scatter(code: Buckets, A: Tensor) -> Tensor:
    """``scatter_rows`` of a bucketed code: [L, D] = sum over entries of val A[b] into row idx, by latent and tiled
    over D, into a recycled array."""
    out = _recycled((code.start.shape[0] - 1, A.shape[1]))  # every row is written
    nw.scatter(code.start, code.row, code.value, _f32(A), nw.tile_width(code.rows, A.shape[1]), out)
    return torch.from_numpy(out).to(A.dtype)


def encoder_backward(idx: Tensor, g: Tensor, x: Tensor, W_enc: Tensor,
                     want_x: bool = True) -> tuple[Tensor | None, Tensor]:
    """grad_x [B, D] (None with ``want_x=False`` and latent-major W_enc: its gather-sum is skipped) and grad_W_enc
    [D, L], the latter in W_enc's memory layout.

    Latent-major W_enc (a transposed view of [L, D] storage, as SparseCoder keeps it): grad_x is the
    decode's gather-sum over W_enc^T rows and grad_W_enc^T the decode's bucketed row scatter of x, both
    with contiguous rows; a wide code (``by_latent``) is bucketed once for both and they run by latent.
    Row-major W_enc: the tiled kernel (transposes 16-latent tiles in cache)."""
    _check_cpu(W_enc)
    if W_enc.t().is_contiguous() and W_enc.dtype in (torch.float32, torch.bfloat16):
        code = by_latent(idx, g, W_enc.shape[1])
        if code is not None:
            grad_W = latent_scatter(code, x)  # [L, D]; in W_enc's [D, L] layout a tensor of its own, not a view
            # (float32: the recycled array read through its transpose), so autograd can add another term into it
            grad_W = torch.from_numpy(grad_W.numpy().T) if grad_W.dtype == torch.float32 else grad_W.t()
            return (latent_gather_sum(code, W_enc.t(), None) if want_x else None), grad_W
        grad_x = gather_sum(idx, g, W_enc.t(), None) if want_x else None
        return grad_x, scatter_rows(idx, g, x, W_enc.shape[1]).t()
    grad_x = np.empty(tuple(x.shape), np.float32)
    grad_W = np.empty(tuple(W_enc.shape), np.float32)
    nk.encoder_backward(_i64(idx), _f32(g), _f32(x), _f32(W_enc), grad_x, grad_W)
    return torch.from_numpy(grad_x), torch.from_numpy(grad_W)


def project_rows(W: Tensor, G: Tensor) -> None:
    """``reference.project_rows`` in one numba pass (float32, contiguous CPU tensors; the reference otherwise)."""
    if W.dtype != torch.float32 or G.dtype != torch.float32 or not (W.is_contiguous() and G.is_contiguous()) or \
            W.device.type != "cpu":
        reference.project_rows(W, G)
        return
    nk.project_rows(W.detach().numpy(), G.detach().numpy())



def adam_rows(W: Tensor, G: Tensor, M: Tensor, V: Tensor, step: Tensor, lr: float, beta1: float, beta2: float,
              eps: float, unit: bool, copy: Tensor | None) -> None:
    """``reference.adam_rows`` in one numba pass over the rows (``numba_update.adam_rows``), bit for bit: on
    contiguous float32 CPU tensors whose rows are whole groups of 8 and whose size is whole groups of 16 (there
    torch's kernels run their vectorised code on every element; their scalar tails round otherwise), with a bf16
    ``copy`` or none; the reference otherwise."""
    from . import numba_update as nu

    tensors = (W, G, M, V) + ((copy,) if copy is not None else ())
    if W.dim() != 2 or W.shape[1] % 8 or W.numel() % 16 or any(
            t.device.type != "cpu" or not t.is_contiguous() or t.shape != W.shape for t in tensors) or \
            any(t.dtype != torch.float32 for t in (W, G, M, V)) or (copy is not None and copy.dtype != torch.bfloat16):
        reference.adam_rows(W, G, M, V, step, lr, beta1, beta2, eps, unit, copy)
        return
    t = float(step)  # torch's kernel: its coefficients in double, each rounded to float32 where it is used
    f = np.float32
    bc2_sqrt = math.sqrt(1 - beta2 ** t)
    bits = copy.view(torch.int16).numpy().view(np.uint16) if copy is not None else np.empty((0, 0), np.uint16)
    nu.adam_rows(W.detach().numpy(), G.detach().numpy(), M.numpy(), V.numpy(), f(1 - beta1), f(beta2), f(1 - beta2),
                 f(bc2_sqrt), f(eps), f(-(lr / (1 - beta1 ** t))), torch.backends.cpu.get_cpu_capability() != "DEFAULT",
                 unit, bits, copy is not None)


def sparsemax_support(pre: Tensor, scale: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """``kernels.sparsemax_support`` in one numba pass per row (``numba_sparsemax``) on float32 CPU scores, the
    scale fused in; torch's search (``torch_impl.sparsemax_support``) for other dtypes. The support rows are written
    into a recycled uninitialised [n, L] int32 array (``_recycled``: a fresh one costs a page fault for each row's
    first pages at every call, 200 ms of CPU a step at the benchmark's shapes; 32 MiB for ``kinds.ROW_CHUNK`` rows at
    L 16384, which ``saes.sizing`` counts), of which only each row's first pages are ever touched."""
    from . import torch_impl

    if not _searched_here(pre, scale):
        return torch_impl.sparsemax_support(pre, scale, m)
    idx, size, _ = sparsemax_pack(pre, scale, m)
    return idx, size


def _searched_here(pre: Tensor, scale: Tensor) -> bool:
    _check_cpu(pre)
    return pre.dtype == torch.float32 and scale.dtype == torch.float32 and pre.shape[1] > 0


def sparsemax_pack(pre: Tensor, scale: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """``kernels.sparsemax_pack``: the search of :func:`sparsemax_support`, then the support's int64 indices and its
    scores packed in one pass (``numba_sparsemax.pack_rows``); torch's for other dtypes."""
    from . import numba_sparsemax as ns
    from . import torch_impl

    if not _searched_here(pre, scale):
        return torch_impl.sparsemax_pack(pre, scale, m)
    n, L = pre.shape
    out = _recycled((n, L), np.int32)
    size = np.empty(n, np.int64)
    rows = pre.detach().contiguous().numpy()
    ns.sparsemax_rows(rows, np.float32(float(scale)), out, size)
    K = max(int(size.max()) if n else 0, 1)
    idx, scores = np.empty((n, K), np.int64), np.empty((n, K), np.float32)
    ns.pack_rows(rows, out, size, idx, scores)
    return torch.from_numpy(idx), torch.from_numpy(size), torch.from_numpy(scores)


def code_fired(values: Tensor, indices: Tensor, n_latents: int) -> tuple[Tensor, Tensor]:
    """``kernels.code_fired`` in one pass over the code (``numba_wide.code_fired``); the reference for a code that
    is not on the CPU."""
    if values.device.type != "cpu" or indices.device.type != "cpu":
        return reference.code_fired(values, indices, n_latents)
    fired, count = nw.code_fired(_f32(values), _i64(indices), n_latents)
    return torch.from_numpy(fired), torch.from_numpy(count)


class _PrefixErrors(torch.autograd.Function):
    """``kinds.prefix_errors`` from the code as it is (``numba_prefix``): (values [B, K] float32, W_dec [L, D], b_dec
    [D]; indices, bounds, x) -> (x_hat [B, D], the inner prefixes' squared errors, 0-dim each). The generic path's
    operations in its order (the regrouped decode, ``kinds._PrefixErrors``, the decode's backward): its results bit for
    bit. The inner residuals [G - 1, B, D] and the backward's gradient rows [G, B, D] go to recycled arrays (fresh
    ones cost a page fault for each of their pages at every step)."""

    @staticmethod
    def forward(ctx, values, W_dec, b_dec, indices, bounds, x):
        from . import numba_prefix

        _check_cpu(W_dec)
        B, D, G = values.shape[0], W_dec.shape[1], len(bounds)
        idx = _i64(indices)
        grp = np.minimum(np.searchsorted(np.asarray(bounds), idx, side="right"), G - 1)  # torch.bucketize(right=True)
        res = _recycled((G - 1, B, D))
        x_hat = np.empty((B, D), np.float32)
        numba_prefix.prefix_residuals(idx, _f32(values), grp, _f32(W_dec), _f32(x), _f32(b_dec), res, x_hat)
        res_t = torch.from_numpy(res)
        ctx.save_for_backward(values, indices, W_dec, res_t)
        ctx.grp, ctx.bounds = grp, np.asarray(bounds)
        return (torch.from_numpy(x_hat), *(torch.dot(r.flatten(), r.flatten()) for r in res_t))

    @staticmethod
    def backward(ctx, grad_x_hat, *grad_errors):
        values, indices, W_dec, res = ctx.saved_tensors
        (B, K), (L, D), G = values.shape, W_dec.shape, len(ctx.bounds)
        acc = torch.from_numpy(_recycled((G, B, D)))  # acc[g]: d loss / d (the sum of the parts up to g)
        acc[G - 1].copy_(grad_x_hat)
        for g in range(G - 2, -1, -1):
            torch.add(acc[g + 1], res[g], alpha=-2.0 * float(grad_errors[g]), out=acc[g])
        idx, val, W, A = _i64(indices), _f32(values), _f32(W_dec), acc.numpy()
        grad_v = grad_W = None
        if ctx.needs_input_grad[0]:  # each group's entries against their own gradient rows; zero values get 0
            from . import numba_prefix

            grad_v = np.empty((B, K), np.float32)
            numba_prefix.gather_dot_by_group(idx, ctx.grp, val, A, W, grad_v)
            grad_v = torch.from_numpy(grad_v).to(values.dtype)
        if ctx.needs_input_grad[1]:
            grad_W = _recycled((L, D))  # every row is written
            nk.scatter_rows_by_group(idx, val, A, ctx.bounds, grad_W)
            grad_W = torch.from_numpy(grad_W)
        grad_b = acc[0].sum(dim=0) if ctx.needs_input_grad[2] else None
        return grad_v, grad_W, grad_b, None, None, None


def prefix_errors(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, bounds: list[int],
                  x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``kinds.prefix_errors`` for float32 CPU tensors (``_PrefixErrors``); x is data (no gradient)."""
    x_hat, *errors = _PrefixErrors.apply(values, W_dec, b_dec, indices, list(bounds), x.detach())
    return x_hat, errors


BACKEND = Backend(row_topk, gather_sum, gather_dot, scatter_rows, encoder_backward, row_above, row_above_floor,
                  batch_pack=batch_pack, reads_bf16=True, by_latent=by_latent, latent_gather_sum=latent_gather_sum,
                  latent_gather_dot=latent_gather_dot, latent_scatter=latent_scatter)
encode, encode_topk, batch_topk, sparse_decode, encode_aux, gather_pre, encode_above = make_ops(BACKEND)
