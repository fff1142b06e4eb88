"""Crosscoder-specific selection and losses: the kinds of :class:`SparseCoder` that read several sources.

A crosscoder is a :class:`~conceptdict.saes.model.SparseCoder` with ``n_sources = S > 1``: one latent code
shared by S sources (models or layers), ``f = act(sum_s x_s W_enc[s] + b_enc)``, ``x_hat_s = f W_dec[s] + b_dec[s]``.
The parameters stay flattened (``W_enc [S*D, L]``, ``W_dec [L, S*D]``) so the kernels of ``saes.kernels``
serve it unchanged. What is specific lives here:

- ``crosscoder-absolute`` (BatchTopK crosscoder, Minder, Dumas et al. 2025): training keeps the top ``k*B``
  entries of the batch ranked by ``f_j * sum_s |d_j^s|`` but keeps the unscaled ``f_j``; AuxK for dead
  latents; inference keeps ``f_j`` where ``f_j * sum_s |d_j^s| > threshold`` (the threshold is set like a
  BatchTopK SAE's, on the same scaled ranking, and stored in the ``threshold`` buffer).
- ``crosscoder`` (the default): the same, with the ranking and the threshold relative to each row's norm as
  in the SAE kind ``batchtopk`` (docs/results/batchtopk.md): with heavy-tailed activations the absolute ranking spends
  the batch's budget on high-norm rows and learns only a quarter of the one-model concepts.
- ``crosscoder-l1`` (the classical crosscoder, Anthropic 2024): ReLU codes, loss
  ``sum_s |x_s - x_hat_s|^2 + lambda sum_j f_j sum_s |d_j^s|``.

Shapes: B batch rows, S sources, D width per source, L latents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .. import kernels
from ..comm import StepInputs
from .batchtopk import ThresholdSettings
from .common import relative_acts, scaled_smallest, sparse_train_forward
from .relu import L1Settings, l1_weight
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def source_norm_sum(W_dec: Tensor, n_sources: int) -> Tensor:
    """W_dec [L, S*D] -> sum_s |d_j^s| [L], the crosscoder's per-latent decoder weight."""
    L, width = W_dec.shape
    if width % n_sources:
        raise ValueError(f"W_dec width {width} is not a multiple of n_sources={n_sources}")
    return W_dec.view(L, n_sources, width // n_sources).norm(dim=-1).sum(dim=-1)


def crosscoder_pre(x: Tensor, W_enc: Tensor, b_enc: Tensor, b_dec: Tensor) -> Tensor:
    """x [B, S*D] -> pre-activations [B, L] = (x - b_dec) W_enc + b_enc (the shared code's input)."""
    return (x - b_dec) @ W_enc + b_enc


# --------------------------------------------------------------------------- L1 crosscoder


class CrosscoderLoss(NamedTuple):
    """Terms of the L1 crosscoder loss (0-dim tensors, means over the batch)."""

    total: Tensor
    mse: Tensor  # mean_b sum_s |x_s - x_hat_s|^2
    penalty: Tensor  # lambda * mean_b sum_j f_j sum_s |d_j^s|


def crosscoder_l1_penalty(acts: Tensor, W_dec: Tensor, n_sources: int, l1_coeff: float,
                          rows: int | None = None) -> Tensor:
    """lambda * mean_b sum_j f_bj sum_s |d_j^s| for acts [B, L] >= 0 and W_dec [L, S*D] (differentiable in both).

    ``rows``: the mean's denominator when ``acts`` holds only part of the batch (default: B)."""
    return l1_coeff * (acts * source_norm_sum(W_dec, n_sources)).sum() / (rows or acts.shape[0])


def crosscoder_l1_loss(x: Tensor, x_hat: Tensor, acts: Tensor, W_dec: Tensor, n_sources: int,
                       l1_coeff: float) -> CrosscoderLoss:
    """The classical crosscoder loss for x, x_hat [B, S*D] (or [B, S, D]), acts [B, L], W_dec [L, S*D]."""
    mse = (x - x_hat).reshape(x.shape[0], -1).square().sum(dim=1).mean()
    penalty = crosscoder_l1_penalty(acts, W_dec, n_sources, l1_coeff)
    return CrosscoderLoss(mse + penalty, mse, penalty)


def _l1_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Kind ``crosscoder-l1``: dense ReLU code, penalty lambda mean_b sum_j f_j sum_s |d_j^s| (no AuxK).

    The training loop's reconstruction term is the batch FVU = sum |x - x_hat|^2 / (B V) with V the mean
    squared distance of a row to the batch mean; dividing the penalty by the same V makes the total exactly
    (the reference loss sum_s |x_s - x_hat_s|^2 + lambda sum_j f_j sum_s |d_j^s|) / V, so ``l1_coeff`` is the
    reference's lambda (on inputs normalised to mean norm sqrt(D) per source). B and V are the whole
    batch's (``inputs.stats``)."""
    acts = torch.relu(crosscoder_pre(x, model.W_enc, model.b_enc, model.b_dec))
    x_hat = acts @ model.W_dec + model.b_dec
    penalty = crosscoder_l1_penalty(acts, model.W_dec, model.n_sources, l1_weight(inputs),
                                    rows=inputs.stats.rows)
    active = acts > 0
    return TrainOutput(x_hat, active.any(dim=0), active.sum(dim=1).float().mean().detach(),
                       penalty / inputs.stats.row_var.detach(), None, None)


def _l1_encode(model: SparseCoder, x: Tensor) -> Tensor:
    return torch.relu(crosscoder_pre(x, model.W_enc, model.b_enc, model.b_dec))


# --------------------------------------------------------------------------- BatchTopK crosscoder


class CrosscoderSelection(NamedTuple):
    """A BatchTopK crosscoder's training code."""

    code: kernels.SparseCode  # unscaled f_j of the kept entries, [B, K] values and indices
    smallest: Tensor  # 0-dim: smallest kept SCALED activation f_j sum_s |d_j^s| (threshold estimate)


def batchtopk_crosscoder_select(acts: Tensor, W_dec: Tensor, n_sources: int, k: int,
                                impl: str = "auto") -> CrosscoderSelection:
    """Keep the top k*B entries of acts [B, L] (ReLU'd) ranked by f_j * sum_s |d_j^s|, values unscaled.

    The ranking weights are detached: selection is not differentiable; gradients reach the kept f_j
    (and W_dec through the reconstruction)."""
    weight = source_norm_sum(W_dec.detach(), n_sources)
    code, _ = kernels.batch_topk(acts, k, scale=weight, impl=impl)
    return CrosscoderSelection(code, scaled_smallest(code.values, code.indices, weight))


def crosscoder_threshold_codes(acts: Tensor, W_dec: Tensor, n_sources: int, threshold: Tensor) -> Tensor:
    """Inference rule: f_j where f_j * sum_s |d_j^s| > threshold, else 0. acts [B, L], threshold [L] or 0-dim."""
    weight = source_norm_sum(W_dec, n_sources)
    return acts * (acts * weight > threshold)


def input_scale(model: SparseCoder) -> Tensor:
    """The per-source factor [S] that maps raw activations to the units the model was trained in.

    After training, ``saes.train`` folds its normalisation (each source to mean norm sqrt(D)) into the
    weights: the raw decoder column of source s is the trained one divided by this factor. Read from a
    ``source_scale`` buffer when the model has one, else from the training summary (config.json's
    ``normalisation.scale_per_source``), else ones (nothing folded, e.g. during training)."""
    scale = getattr(model, "source_scale", None)
    if scale is None:
        summary = getattr(model, "training_summary", None) or {}
        norm = summary.get("normalisation") or {}
        if norm.get("folded_into_weights") and norm.get("scale_per_source") is not None:
            scale = torch.tensor(norm["scale_per_source"], dtype=torch.float32)
    if scale is None:
        return torch.ones(model.n_sources, device=model.device)
    return scale.to(model.device, torch.float32)


def training_decoder(model: SparseCoder) -> Tensor:
    """W_dec [L, S*D] in training units (see :func:`input_scale`): the ranking f_j sum_s |d_j^s| and its
    inference threshold are defined there, so a folded model multiplies its factor back."""
    return model.W_dec * input_scale(model).to(model.W_dec).repeat_interleave(model.d_in)


def _ranking_weight(model: SparseCoder) -> Tensor:
    """sum_s |d_j^s| [L] of the decoder in training units: the crosscoder's ranking weight per latent."""
    return source_norm_sum(training_decoder(model).detach(), model.n_sources)


def _batchtopk_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Kind ``crosscoder``: BatchTopK ranked by f_j sum_s |d_j^s| relative to each row's norm (the row-relative
    rule of ``batchtopk``, saes.kinds.common.row_scale), the AuxK code over the dead latents from the same
    pre-activations, and the scaled threshold estimate. bench/crosscoder_diff.py with heavy-tailed codes
    (D=64, 224 atoms, L=512): B-only recall 0.25 with the absolute ranking, 0.94 with the relative one.

    With the L1 tie-break of ``batchtopk`` on the kept codes f (``TrainConfig.code_l1``, 0.1): at k = 32 for ~6 atoms
    per row the cut keeps room for an atom's split halves, and without it B-only recall was 0.28-0.31 on
    bench/crosscoder_diff.py and 0.38-0.47 through ``conceptdict diff`` (bench/cli_planted.py --diff); with it 1.00
    (docs/results/crosscoders.md#the-crosscoder-takes-the-tie-break). A version with batchtopk's other defaults (TopK start,
    AuxK 1/4, a short dead window) and the penalty weighted by sum_s |d_j^s| lost precision (0.78-0.84)."""
    return sparse_train_forward(model, x, inputs, batch=True, scale=_ranking_weight(model), relative=True,
                                tie_break=True)


def _absolute_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Kind ``crosscoder-absolute``: the BatchTopK crosscoder as published (Minder, Dumas et al. 2025)."""
    return sparse_train_forward(model, x, inputs, batch=True, scale=_ranking_weight(model))


def _relative_scores(model: SparseCoder, x: Tensor) -> Tensor:
    acts, _ = relative_acts(model, x)
    return acts * source_norm_sum(training_decoder(model), model.n_sources)


def _relative_encode(model: SparseCoder, x: Tensor) -> Tensor:
    """Inference of ``crosscoder``: s f_j where f_j sum_s |d_j^s| > threshold, f = relu(pre / s)."""
    acts, s = relative_acts(model, x)
    return crosscoder_threshold_codes(acts, training_decoder(model), model.n_sources, model.threshold) * s


def _batchtopk_encode(model: SparseCoder, x: Tensor) -> Tensor:
    acts = torch.relu(crosscoder_pre(x, model.W_enc, model.b_enc, model.b_dec))
    return crosscoder_threshold_codes(acts, training_decoder(model), model.n_sources, model.threshold)


def _batchtopk_scores(model: SparseCoder, x: Tensor) -> Tensor:
    """f_j * sum_s |d_j^s| [B, L]: what the inference threshold is compared with."""
    acts = torch.relu(crosscoder_pre(x, model.W_enc, model.b_enc, model.b_dec))
    return acts * source_norm_sum(training_decoder(model), model.n_sources)


# the crosscoders keep the shared defaults (docs/results/defaults.md)
KINDS = (
    KindSpec(_batchtopk_train, _relative_encode, uses_aux=True, uses_threshold=True, scores=_relative_scores,
             relative=True, sources="several", name="crosscoder", settings=ThresholdSettings, calibrated=True,
             mixed_precision=True, shardable=True),
    KindSpec(_absolute_train, _batchtopk_encode, uses_aux=True, uses_threshold=True, scores=_batchtopk_scores,
             sources="several", name="crosscoder-absolute", settings=ThresholdSettings, calibrated=True,
             mixed_precision=True, shardable=True),
    KindSpec(_l1_train, _l1_encode, uses_aux=False, uses_threshold=False, sources="several", name="crosscoder-l1",
             settings=L1Settings),
)

__all__ = [
    "CrosscoderLoss",
    "CrosscoderSelection",
    "batchtopk_crosscoder_select",
    "crosscoder_l1_loss",
    "crosscoder_l1_penalty",
    "crosscoder_pre",
    "crosscoder_threshold_codes",
    "input_scale",
    "scaled_smallest",
    "source_norm_sum",
    "training_decoder",
]
