"""Rounded copies of weights (bf16) for the kernels: the encoder matmul and the gathers of a bf16 step read them.

A step in ``precision bf16`` reads each weight matrix several times in bf16 (the encoder matmul; the decoder rows of
the sparse decode and its backward; the encoder rows of the encoder backward) while the weights themselves, Adam
and the loss stay float32. :func:`rounded` hands out one copy per weight matrix and dtype and remakes it only when the
weights changed since it was made, which torch's version counter of the weights' storage tells: every in-place
write through torch's in-place operations on the parameter or a view of it (the decoder renormalisation,
``load_state_dict``, an optimizer's ``foreach`` update) bumps it, so a copy is made once per update, not once per
read. A kernel that writes weights without telling autograd must bump the counter itself
(``torch.autograd.graph.increment_version``): torch's fused Adam kernel does not, and ``saes.adam.Adam`` bumps it
after each step. An update that writes the copy itself (``kernels.adam_rows``) takes the buffer with :func:`kept`
and marks it current with :func:`refreshed`.

The copies live as long as their parameter (a weak reference drops them with it) and at most :data:`MAX_COPIES`
of them are kept; :func:`release_copies` drops them all.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch import Tensor

MAX_COPIES = 8
"""Copies kept at most (least recently used dropped first): a step reads two (encoder and decoder)."""

# id(base) -> (weak reference to the base, its version when copied, the copy); most recently used last
_COPIES: OrderedDict[tuple[int, torch.dtype], tuple[weakref.ref, int, Tensor]] = OrderedDict()


def _drop(key: tuple[int, torch.dtype]) -> None:
    _COPIES.pop(key, None)


@torch.no_grad()
def rounded(W: Tensor, dtype: torch.dtype) -> Tensor:
    """``W`` rounded to ``dtype``, with W's shape and strides (a transposed view stays one), detached.

    The copy is made of W's whole storage (its base: the parameter W is a view of, in the base's layout, e.g. the
    transposed latent-major ``W_enc``) and cached: a later call for the same weights returns it without copying
    again unless they were written in place since (``Tensor._version``). A base that is neither contiguous nor a
    transposed contiguous matrix is copied every call."""
    if W.dtype == dtype:
        return W.detach()
    base = W if W._base is None else W._base
    if not (base.is_contiguous() or (base.dim() == 2 and base.t().is_contiguous())):
        return W.detach().to(dtype)
    key = (id(base), dtype)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is base and hit[1] == base._version and hit[2].shape == base.shape:
        _COPIES.move_to_end(key)
        copy = hit[2]
    else:
        if hit is None or hit[0]() is not base:  # a new base (or a reused id): forget the copy when it dies
            weakref.finalize(base, _drop, key)
        copy = hit[2] if hit is not None and hit[0]() is base and hit[2].shape == base.shape else \
            torch.empty_strided(base.shape, base.stride(), dtype=dtype, device=base.device)
        copy.copy_(base)
        _COPIES[key] = (weakref.ref(base), base._version, copy)
        _COPIES.move_to_end(key)
        while len(_COPIES) > MAX_COPIES:
            _COPIES.popitem(last=False)
    return copy.as_strided(W.shape, W.stride(), W.storage_offset() - base.storage_offset())


def kept(W: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The buffer of W's cached copy in ``dtype`` (current or not), shaped and strided as W, or None when there is
    none: a kernel that updates W may write the new copy into it and then call :func:`refreshed`."""
    base = W if W._base is None else W._base
    hit = _COPIES.get((id(base), dtype))
    if hit is None or hit[0]() is not base or hit[2].shape != base.shape:
        return None
    return hit[2].as_strided(W.shape, W.stride(), W.storage_offset() - base.storage_offset())


def refreshed(W: Tensor, dtype: torch.dtype) -> None:
    """Mark W's cached copy in ``dtype`` (:func:`kept`) as made from W's current values: the caller wrote it after
    its last write to W (and after bumping W's version counter)."""
    base = W if W._base is None else W._base
    key = (id(base), dtype)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is base:
        _COPIES[key] = (hit[0], base._version, hit[2])


def release_copies() -> None:
    """Drop every cached copy (the next :func:`rounded` copies again)."""
    _COPIES.clear()
