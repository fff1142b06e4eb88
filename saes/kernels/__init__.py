"""Sparse kernels for TopK-style dictionaries: one function per operation, each with ``impl=``.

``impl`` is one of ``"auto"``, ``"reference"`` (dense torch autograd, see ``reference.py``) and the fast
implementations registered in ``IMPLS``. ``"auto"`` is resolved at call time from the tensors' device
(never at import; nothing here prints or imports numba/triton at import time).

Operations: ``encode`` (the fused training encoder: one matmul, TopK or BatchTopK selection and the AuxK
code, sparse backward), ``encode_topk``, ``batch_topk``, ``encode_aux``, ``sparse_decode`` and ``gather_pre``
(pre-activations at given entries, sparse backward) and ``encode_above`` (the entries above a per-latent
floor, JumpReLU's); ``kinds.py`` builds the JumpReLU, Matryoshka and
SpaDE operations on them (``prefix_decodes``, ``prefix_errors``, ``encode_sparsemax``); ``adam_rows`` is the update of a weight matrix
(Adam, the decoder renormalisation and its bf16 copy in one pass).
Implementations (``sparse.py`` holds the shared sparse autograd, ``select.py`` the selection):

- ``torch``     embedding_bag / index_add / bmm in chunks; any device and dtype (``torch_impl.py``).
- ``numba``     CPU kernels (``numba_kernels.py``): one-pass row top-k with a block-count scan and the
                bias fused in, race-free bucketed scatters (decode backward, and the encoder backward
                for latent-major W_enc; a tiled kernel otherwise), and for wide codes (SpaDE's, ``numba_wide.py``)
                the decode, its backward and the encoder backward by latent over blocks of rows or packed tiles of
                D in the L2; float32
                inside. Chosen by "auto" on
                CPU: at D=768, L=16384, k=32, B=4096 its step is about 2x ``torch``'s
                (bench/train_step.py, docs/kernels.md).
- ``triton``    GPU kernels for the decode, its backward and the encoder backward (``triton_impl.py``);
                chosen by "auto" on CUDA when triton is installed, else ``torch``.

After the one matmul nothing touches B*L values except the selection: on CPU the pre-activations are
computed and selected 512 rows at a time (no [B, L] buffer), and the exact batch top-k works from 4k
candidates per row of the first chunk and every score above a cutoff guessed from them in the others,
recomputing only the rows those cannot prove.

Shapes: x [B, D] (a crosscoder passes its S sources flattened to [B, S*D]), W_enc [D, L], b_enc [L],
W_dec [L, D], b_dec [D]; codes are (values [B, K], indices [B, K] int64), zero-padded where rows differ.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import reference
from .sparse import Encoded

# operation -> impl name -> "module:function" (imported lazily on first use)
OPS = ("encode", "encode_topk", "batch_topk", "sparse_decode", "encode_aux", "gather_pre", "encode_above",
       "project_rows", "adam_rows", "sparsemax_support", "sparsemax_pack", "code_fired")
IMPLS: dict[str, dict[str, str]] = {
    op: {name: f"{module}:{op}" for name, module in
         (("reference", "reference"), ("torch", "torch_impl"), ("numba", "numba_impl"), ("triton", "triton_impl"))}
    for op in OPS
}

# which implementation "auto" prefers per device type, first available wins
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("numba", "torch", "reference"),
    "cuda": ("triton", "torch", "reference"),
}


class SparseCode(NamedTuple):
    values: Tensor  # [B, K]
    indices: Tensor  # [B, K] int64


# implementations that compute in float32 whatever their inputs (they convert at the boundary)
FLOAT32_ONLY = frozenset({"numba", "triton"})


def resolve_impl(op: str, impl: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Turn ``impl`` (possibly "auto") into a registered implementation name for ``op`` on ``device``; for float64
    tensors (``dtype``) "auto" skips the implementations that compute in float32 and an explicit one is refused."""
    table = IMPLS[op]
    wide = dtype == torch.float64
    if impl == "auto":
        for name in AUTO_ORDER.get(device.type, ("torch", "reference")):
            if name in table and _available(name) and not (wide and name in FLOAT32_ONLY):
                return name
        return "reference"
    if impl not in table:
        raise ValueError(f"impl={impl!r} is not available for {op}; choose one of {sorted(table) + ['auto']}")
    if wide and impl in FLOAT32_ONLY:
        raise ValueError(f"kernel_impl={impl!r} computes in float32 and would round float64 tensors; use kernel_impl "
                         f"auto, torch or reference with precision float64")
    return impl


def _available(name: str) -> bool:
    if name == "numba":
        import importlib.util

        return importlib.util.find_spec("numba") is not None
    if name == "triton":
        import importlib.util

        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    return True


def _fn(op: str, impl: str, t: Tensor):
    """The implementation ``impl`` of ``op`` for tensors like ``t`` (its device and dtype)."""
    import importlib

    name = resolve_impl(op, impl, t.device, t.dtype)
    module, func = IMPLS[op][name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)


def encode_topk(x: Tensor, W_enc: Tensor, b_enc: Tensor, k: int, impl: str = "auto") -> SparseCode:
    """TopK(ReLU(x W_enc + b_enc)) per row: x [B, D] -> SparseCode([B, k], [B, k]), differentiable."""
    values, indices = _fn("encode_topk", impl, x)(x, W_enc, b_enc, k)
    return SparseCode(values, indices)


def batch_topk(acts: Tensor, k: int, scale: Tensor | None = None, impl: str = "auto") -> tuple[SparseCode, Tensor]:
    """Top ``k*B`` entries of acts [B, L] over the whole batch (ranked by ``acts*scale`` when given).

    Returns the zero-padded code and the smallest kept activation (for the inference threshold)."""
    values, indices, smallest = _fn("batch_topk", impl, acts)(acts, k, scale)
    return SparseCode(values, indices), smallest


def sparse_decode(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor, impl: str = "auto", *,
                  skip_zero_grads: bool | Tensor = False, rows_dtype: torch.dtype | None = None) -> Tensor:
    """x_hat [B, D] = sum_j values[:, j] W_dec[indices[:, j]] + b_dec, differentiable in values, W_dec, b_dec.

    ``rows_dtype`` (bf16; None: W_dec's): the rows are read rounded to it, in the forward and in the values'
    gradient, while W_dec's gradient is as without it (it reads no weights) and the sums stay in W_dec's dtype
    (``reference.rounded_rows``). The fast kernels read the cached bf16 copy of W_dec (``copies.rounded``, made once
    per update): half the bytes of the gathers. Training passes its bf16 precision here.

    ``skip_zero_grads=True``: a value exactly 0 gets gradient 0 instead of <grad, W_dec[index]>, and the
    fast kernels skip it. Right for codes from ``encode``, whose zeros are padding or ReLU zeros whose
    gradient its backward discards; a BatchTopK code padded to its longest row (K several times k) then
    costs what its kept entries cost. A bool tensor [B, K] instead: the entries where it is False (padding) get
    gradient 0 and are skipped, every other entry its gradient, zero values included (JumpReLU's code, whose entries
    inside the threshold's window carry the estimator's gradient at value 0).

    A code whose indices are one row broadcast over the batch (stride 0: ``encode``'s dense AuxK code)
    is decoded by one matmul, ``values @ W_dec[indices[0]]``, with any implementation."""
    if indices.dim() == 2 and indices.shape[0] > 1 and indices.stride(0) == 0:
        values = reference.grads_kept(values, skip_zero_grads)
        W = W_dec if rows_dtype is None else reference.rounded_rows(W_dec, rows_dtype)
        out = values @ W.index_select(0, indices[0])
        return out if b_dec is None else out + b_dec
    return _fn("sparse_decode", impl, values)(values, indices, W_dec, b_dec, skip_zero_grads, rows_dtype)


def encode_above(x: Tensor, W_enc: Tensor, b_enc: Tensor, floor: Tensor, k: int = 1,
                 impl: str = "auto", shift: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The entries of pre = x W_enc + b_enc above ``floor`` [L] (one floor per latent), per row in latent order:
    (pre there [B, K], indices [B, K], kept [B, K]) padded with (0, 0, False) to the longest row; the values are
    differentiable in x, W_enc and b_enc through those entries (JumpReLU: its active entries and those in the
    threshold's window; what the padding's values and gradients are is not defined: mask with ``kept``). ``k``, the
    expected entries per row, sizes buffers only. ``shift`` [D]: of ``x - shift``, as :func:`encode`'s."""
    return _fn("encode_above", impl, x)(x, W_enc, b_enc, floor, k, shift=shift)


def gather_pre(x: Tensor, W_enc: Tensor, indices: Tensor, impl: str = "auto", *,
               values: Tensor | None = None) -> Tensor:
    """(x W_enc) at indices [B, K] -> [B, K] without the [B, L] product; differentiable in x and W_enc through
    those entries only (no ReLU mask: every entry carries its gradient). ``values``: those products where the
    caller has them already (from the matmul its selection read): returned as they are, with the same gradient,
    and no gather-dot computed."""
    return _fn("gather_pre", impl, x)(x, W_enc, indices, values)


def encode(
    x: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    k: int,
    *,
    batch: bool = False,
    scale: Tensor | None = None,
    dead: Tensor | None = None,
    k_aux: int = 0,
    impl: str = "auto",
    mm_dtype: torch.dtype | None = None,
    shift: Tensor | None = None,
    row_scale: Tensor | None = None,
) -> Encoded:
    """The fused encoder of a training step: ONE matmul x [B, D] @ W_enc [D, L], then the selection.

    TopK per row (``batch=False``) or BatchTopK (``batch=True``: top ``k*B`` of the whole batch, ranked by
    ``acts * scale`` [L] when given, zero-padded to [B, K]), and, when ``dead`` (bool [L]) and ``k_aux`` are
    given, the AuxK code (top ``k_aux`` among dead latents) from the same pre-activations. ``k=0`` skips
    the main code. Values (main and aux) are differentiable in x, W_enc and b_enc through the kept
    entries only; returns ``Encoded(values, indices, aux_values, aux_indices, smallest)``.

    ``mm_dtype`` (bf16 / fp16, None: x's dtype): the dtype of the matmul that chooses the entries; their values
    are recomputed in x's dtype (``sparse.encode``). With bf16, x's gradient reads W_enc rounded to bf16 (W_enc's
    gradient is as without it), as ``sparse_decode(rows_dtype=)`` reads W_dec. The fast implementations only.

    ``shift`` [D] (the kinds' b_dec): encode ``x - shift``, differentiable in ``shift`` too. The same values and
    the same gradients in value as passing ``x - shift``; the fast implementations make the shift's gradient from
    the entries' gradients summed by latent (minus W_enc times them) when x itself takes none, instead of from x's
    gather-sum over every entry and a sum over the rows (another summation order: ``kernels/shift.py``).
    ``row_scale`` [B, 1] (the row-relative rule's s(x), differentiable): encode ``(x - shift) / row_scale``, its
    gradient made the same way (from the kept values less b_enc: their products with the rows).
    """
    if mm_dtype is None:
        return Encoded(*_fn("encode", impl, x)(x, W_enc, b_enc, k, batch=batch, scale=scale, dead=dead,
                                                      k_aux=k_aux, shift=shift, row_scale=row_scale))
    name = resolve_impl("encode", impl, x.device, x.dtype)
    if name == "reference":
        raise ValueError(f"a {mm_dtype} encoder matmul needs a fast kernel, not kernel_impl='reference'; use "
                         f"kernel_impl auto, torch or numba, or precision float32")
    return Encoded(*_fn("encode", name, x)(x, W_enc, b_enc, k, batch=batch, scale=scale, dead=dead,
                                                  k_aux=k_aux, mm_dtype=mm_dtype, shift=shift, row_scale=row_scale))


def project_rows(W: Tensor, G: Tensor, impl: str = "auto") -> None:
    """In place, for every row r of W [L, F] and G [L, F]: G[r] -= (<G[r], W[r]> / |W[r]|^2) W[r] (the decoder
    gradient without its component along each decoder row). ``numba``: one pass over W and G instead of torch's
    three reductions and an update (``reference.project_rows``)."""
    _fn("project_rows", impl, W)(W, G)



def adam_rows(W: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: float,
              betas: tuple[float, float], eps: float, *, unit: bool = False, copy: Tensor | None = None,
              impl: str = "auto") -> None:
    """The update of one weight matrix W [L, F], in place: Adam (torch's fused kernel's step, with the moments
    ``exp_avg`` / ``exp_avg_sq`` and ``step``, the step count after this step's increment), then with ``unit`` every
    row divided by its norm (clamped at 1e-12: the decoder renormalisation), then with ``copy`` W rounded into it
    (the bf16 copy the next step's kernels read, ``copies.rounded``).

    ``reference`` / ``torch``: those three passes (``reference.adam_rows``). ``numba``: one pass over the rows with
    the same float32 operations in the same order, so W, the moments and the copy are bit for bit the reference's
    (``numba_update``); it takes the reference for shapes, dtypes or layouts it does not cover."""
    _fn("adam_rows", impl, W)(W, grad, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps, unit, copy)

def sparsemax_support(pre: Tensor, scale: Tensor, n_candidates: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """The support of sparsemax(pre * scale) per row of pre [n, L] (``scale`` a 0-dim tensor), without autograd:
    (indices [n, K] by decreasing score, ties by increasing column in ``numba``, zero-padded after each row's
    support; size [n]), K the largest size. SpaDE's support search (``encode_sparsemax``).

    ``reference``: the whole row sorted. ``torch``: from each row's top ``n_candidates`` scores, more where the
    support may be larger (several passes over the scores). ``numba``: one pass per row that finds a lower bound of
    the threshold as it reads the scores and keeps only those above it (``numba_sparsemax``). All three give the
    same support and size (the rule's float32 roundings are the same); only the order of equal scores may differ."""
    return _fn("sparsemax_support", impl, pre)(pre, scale, n_candidates)


def sparsemax_pack(pre: Tensor, scale: Tensor, n_candidates: int,
                   impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`sparsemax_support`'s (indices [n, K], size [n]) and the scores ``pre`` at those indices, 0 after each
    row's support ([n, K], pre's dtype): SpaDE's packed support of one chunk of rows. ``numba`` writes the three in
    one pass after its search; the others gather."""
    return _fn("sparsemax_pack", impl, pre)(pre, scale, n_candidates)


def code_fired(values: Tensor, indices: Tensor, n_latents: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """(fired [L] bool: the latents with a positive entry, count [B] int64: each row's positive entries) of a
    zero-padded code values / indices [B, K], without autograd. ``numba``: one pass over the code; the others
    torch's compare, masked index and row sums (``reference.code_fired``)."""
    return _fn("code_fired", impl, values)(values, indices, n_latents)


def encode_aux(x: Tensor, W_enc: Tensor, b_enc: Tensor, dead: Tensor, k_aux: int, impl: str = "auto") -> SparseCode:
    """Top ``k_aux`` of ReLU(pre) among dead latents (bool [L]) per row, for the AuxK loss."""
    values, indices = _fn("encode_aux", impl, x)(x, W_enc, b_enc, dead, k_aux)
    return SparseCode(values, indices)


# (below the ops above: they use them)
from .kinds import (
    encode_spade,
    encode_sparsemax,
    prefix_decodes,
    prefix_errors,
    square_norms,
)

__all__ = [
    "IMPLS", "Encoded", "SparseCode", "adam_rows", "batch_topk", "code_fired", "encode", "encode_above", "encode_aux",
    "encode_spade",
    "encode_sparsemax", "encode_topk", "gather_pre", "prefix_decodes", "prefix_errors", "project_rows", "resolve_impl",
    "sparse_decode", "sparsemax_pack", "sparsemax_support", "square_norms",
]
