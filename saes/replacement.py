"""A replacement model's dictionary side: what replaces every MLP of a model at once, as the two functions
``activations.replacement.replacement_losses`` splices in (``encode(l, x_l)`` -> layer l's code, ``decode(l, codes of
layers 0..l)`` -> layer l's predicted MLP output, all [n, D] in raw activation units).

Two makes: one cross-layer transcoder over every layer (:func:`clt_replacement`: layer l's output sums the decodes of
the codes of layers <= l), or a set of per-layer transcoders, one per MLP (:func:`transcoder_replacement`: layer l's
output is its own transcoder's prediction from its own input).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from .model import SparseCoder


class Replacement(NamedTuple):
    """What replaces the MLPs of ``n_layers`` layers (see the module's docstring)."""

    n_layers: int
    encode: Callable[[int, Tensor], Any]
    decode: Callable[[int, list], Tensor]


def clt_replacement(model: SparseCoder) -> Replacement:
    """A cross-layer transcoder as a replacement model: layer l's code is its block of the kind's inference code,
    layer l's output sums f_j W_dec^{j -> l} over the codes of layers <= l, plus b_dec_l."""
    if not model.spec.layered:
        raise ValueError(f"a {model.kind} is not a cross-layer transcoder; pass one per-layer transcoder per MLP "
                         f"(transcoder_replacement)")
    S, D = model.n_sources, model.d_in
    P = model.n_latents // S
    if not isinstance(model, SparseCoder):
        return _lazy_clt_replacement(model, S, D, P)
    W = model.W_dec.detach()

    def encode(l: int, x: Tensor) -> Tensor:
        full = x.new_zeros(x.shape[0], S * D)  # each layer's block reads only its own layer's input
        full[:, l * D:(l + 1) * D] = x.to(full)
        with torch.no_grad():
            return model.spec.encode(model, full.to(W))[:, l * P:(l + 1) * P]

    def decode(l: int, codes: list) -> Tensor:
        out = model.b_dec.detach()[l * D:(l + 1) * D]
        for j, f in enumerate(codes[: l + 1]):
            out = out + f @ W[j * P:(j + 1) * P, l * D:(l + 1) * D]
        return out

    return Replacement(S, encode, decode)


def _lazy_clt_replacement(model, S: int, D: int, P: int) -> Replacement:
    """:func:`clt_replacement` of a CLT read a block of latents at a time (``saes.lazy_clt.LazyCLT``), through its
    whole-CLT ``encode`` and ``decode``: layer l's code is the code of the rows whose other layers' inputs are zero
    (a layer's latents read only its own input), layer l's output the layer-l slice of the decode of the codes of
    layers <= l (a latent writes only to its own layer and the ones after it, so the later layers' codes, not yet
    known, add nothing there). Each call reads every block once: slower than the whole CLT's, in its memory."""

    def encode(l: int, x: Tensor) -> Tensor:
        full = x.new_zeros(x.shape[0], S, D, dtype=torch.float32)
        full[:, l] = x.float()
        return model.encode(full)[:, l * P:(l + 1) * P]

    def decode(l: int, codes: list) -> Tensor:
        f = codes[0].new_zeros(codes[0].shape[0], S * P)
        for j, c in enumerate(codes[: l + 1]):
            f[:, j * P:(j + 1) * P] = c
        return model.decode(f)[:, l]

    return Replacement(S, encode, decode)


def transcoder_replacement(models: Sequence[SparseCoder]) -> Replacement:
    """One transcoder (or skip transcoder) per layer, layer l's output its own prediction from its own input."""
    bad = [m.kind for m in models if not m.spec.transcodes or m.spec.layered]
    if bad or not models:
        raise ValueError(f"a replacement model of per-layer transcoders needs one transcoder per MLP; got kinds "
                         f"{bad or 'none'}")

    def encode(l: int, x: Tensor) -> tuple[Tensor, Tensor]:
        m = models[l]
        x = x.to(m.W_dec)
        with torch.no_grad():
            return x, m.spec.encode(m, x)

    def decode(l: int, codes: list) -> Tensor:
        with torch.no_grad():
            return models[l].reconstruct(*codes[l])

    return Replacement(len(models), encode, decode)
