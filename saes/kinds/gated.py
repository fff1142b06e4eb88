"""``gated``: Gated SAEs (Rajamanoharan et al. 2024), imported from other libraries (saes/formats) for inference
only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def encode(model: "SparseCoder", x: Tensor) -> Tensor:
    """The gate ``(x - b_dec) W_enc + b_enc > 0`` picks the latents, the magnitude path
    ``(x - b_dec) W_enc * exp(r_mag) + b_mag`` (shared encoder directions) gives their values."""
    z = (x - model.b_dec) @ model.W_enc
    return (z + model.b_enc > 0) * torch.relu(z * torch.exp(model.r_mag) + model.b_mag)


def not_trainable(model: "SparseCoder", x: Tensor, *_: object, **__: object) -> TrainOutput:
    raise ValueError(f"kind {model.kind!r} is imported for inference only; train another kind instead")


KINDS = (KindSpec(not_trainable, encode, uses_aux=False, uses_threshold=False, trainable=False,
                  buffers=("r_mag", "b_mag"), name="gated", saelens="gated"),)
