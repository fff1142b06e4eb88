"""``topk``: per-row TopK (OpenAI, Gao et al. 2024) with the L1 tie-break on the kept codes (docs/results/batchtopk.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import kernels
from ..comm import StepInputs
from .common import shard_code, sparse_train_forward
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def train_forward(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    return sparse_train_forward(model, x, inputs, batch=False, tie_break=True)


def encode(model: "SparseCoder", x: Tensor) -> Tensor:
    code = kernels.encode_topk(x - model.b_dec, model.W_enc, model.b_enc, model.k, impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device).scatter_(
        1, code.indices, code.values
    )


def shard_encode(model: "SparseCoder", x: Tensor, comm) -> Tensor:
    """Inference over latent shards: each shard's per-row top k, kept where it is among the row's k largest of
    every shard's (``common.shard_code``)."""
    code = kernels.encode_topk(x - model.b_dec, model.W_enc, model.b_enc, model.k, impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device).scatter_(
        1, code.indices, shard_code(code.values, model.k, comm))


# topk keeps the shared defaults (saes.kinds.spec.SHARED_DEFAULTS; docs/results/defaults.md)
KINDS = (KindSpec(train_forward, encode, uses_aux=True, uses_threshold=False, name="topk", mixed_precision=True,
                  shard_encode=shard_encode, shardable=True, saelens="topk"),)
