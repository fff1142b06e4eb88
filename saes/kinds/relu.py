"""``relu``: the ReLU + L1 baseline (Bricken et al. 2023), the L1 weighted by each latent's decoder norm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..comm import StepInputs, shard_bias, shard_sum
from .common import pre_activations
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


@dataclass
class L1Settings:
    """Settings of the L1-penalised kinds (relu, crosscoder-l1)."""

    l1_coeff: float = field(default=0.4, metadata={"help": (
        "Weight of the L1 penalty sum_j f_j sum_s ||d_j^s||, over the batch's RMS norm of x - mean (for "
        "crosscoder-l1 the paper's lambda); 0.4 measured on planted atoms (docs/results/defaults.md).")})


def l1_weight(inputs: StepInputs) -> float:
    """The run's ``l1_coeff``; 0 outside a training run (no settings handed over)."""
    return inputs.settings.l1_coeff if inputs.settings is not None else 0.0


def train_forward(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    acts = torch.relu(pre_activations(model, x))
    x_hat = shard_sum(acts @ model.W_dec + shard_bias(model.b_dec, inputs.comm), inputs.comm)  # latent shards' sum
    # L1 on f_j * sum_s |d_j^s| per row, averaged over the WHOLE batch's rows and divided by its RMS norm of
    # x - mean, so the coefficient does not depend on the scale of x (nor on how the batch is split)
    penalty = (acts * model.decoder_norms().sum(dim=0)).sum() / inputs.stats.rows
    scale = inputs.stats.row_var.sqrt().detach()
    active = acts > 0
    return TrainOutput(x_hat, active.any(dim=0), active.sum(dim=1).float().mean().detach(),
                       l1_weight(inputs) * penalty / scale, None, None)


def encode(model: "SparseCoder", x: Tensor) -> Tensor:
    return torch.relu(pre_activations(model, x))


KINDS = (KindSpec(train_forward, encode, uses_aux=False, uses_threshold=False, name="relu", settings=L1Settings,
                  shardable=True, saelens="standard"),)
