"""SpaDE, the Sparsemax Distance Encoder (Hindupur, Lubana, Fel, Ba 2025, "Projecting Assumptions: The Duality
Between Sparse Autoencoders and Concept Geometry", arXiv 2503.01822), registered as kind ``spade``.

Encoder: ``f(x) = sparsemax(-lambda |x - b_dec - p_j|^2)`` over the latents j, with learned prototypes p_j and
a learned scale lambda > 0 (lambda = softplus(lambda_pre)); the code lies on the probability simplex and its
support adapts to the row (how many prototypes are near it), so receptive fields are not half-spaces and the
number of active latents varies. Decoder: linear, ``x_hat = f W_dec + b_dec``, rows NOT held at unit norm (the
code sums to 1, the decoder carries the magnitude). Loss: FVU + ``spade_coeff`` times the distance-weighted
L1 ``sum_j f_j |x - b_dec - p_j|^2`` (the paper's code: weight 0.1), both divided by the batch's mean squared
distance to its mean.

Sparsemax is shift-invariant per row, so -lambda |x - p_j|^2 ranks like the affine scores
``2 lambda (x - b_dec).p_j - lambda |p_j|^2``: training computes them with ONE matmul (W_enc holds the
prototypes as columns), finds each row's support from its top candidates and packs the code
(``kernels.encode_sparsemax``), so the decode is a sparse decode. At the end of training the affine form is
written into the weights, ``W_enc = 2 lambda P^T``, ``b_enc = -lambda |p_j|^2``: the saved dictionary is an
ordinary [D, L] encoder whose inference rule is sparsemax((x - b_dec) W_enc + b_enc), with the usual folding
of the normalisation and no extra tensor.

Departures from the paper (and its code): distances are taken to ``x - b_dec`` (b_dec initialised like every
kind's; the paper has no biases, b_dec only moves the origin of the prototypes, and the decoder bias is
redundant with simplex codes); prototypes and decoder rows start as the same random directions (the
paper's W_dec = W_enc^T at init) at the first rows' mean centred norm (the paper: N(0, 1) entries, norm
~sqrt(D), the scale of the rows here); lambda starts at 1 / (2 D) as in the paper's toy code (D = S*D for
several sources); the loss is FVU-scaled like every kind here; Adam without weight decay (the paper: AdamW).
``k`` is not a sparsity target: training looks for the support among each row's top max(4k, 16) scores and
falls back to the whole row where that may not suffice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .comm import StepInputs
from .model import KINDS, KindSpec, SparseCoder, TrainOutput, fired_from_code

DEFAULT_COEFF = 0.1


def n_candidates(model: SparseCoder) -> int:
    """Scores per row among which the support is sought first (more are taken where it may be larger)."""
    return min(model.n_latents, max(4 * model.k, 16))


def scale(model: SparseCoder) -> Tensor:
    """lambda = softplus(lambda_pre) (0-dim), during training."""
    return F.softplus(model.spade_lambda_pre)[0]


def _train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    lam, P = scale(model), model.W_enc
    xc = x - model.b_dec
    f, idx, z, kept = kernels.encode_sparsemax(xc, P, -0.5 * P.square().sum(dim=0), 2 * lam, n_candidates(model),
                                               impl=model.kernel_impl)
    x_hat = kernels.sparse_decode(f, idx, model.W_dec, model.b_dec, impl=model.kernel_impl, skip_zero_grads=True)
    # |xc - p_j|^2 = |xc|^2 - z_j / lambda at the support (z_j = 2 lambda xc.p_j - lambda |p_j|^2)
    dist = (xc.square().sum(dim=1, keepdim=True) - z / lam).clamp_min(0)
    coeff = inputs.settings.spade_coeff if inputs.settings is not None else DEFAULT_COEFF
    penalty = coeff * (f * dist * kept).sum() / inputs.stats.total_var
    fired, l0 = fired_from_code(f.detach(), idx, model.n_latents)
    return TrainOutput(x_hat, fired, l0, penalty, None, None)


def _train_params(model: SparseCoder) -> dict[str, Tensor]:
    lam = 1.0 / (2 * model.n_sources * model.d_in)
    return {"spade_lambda_pre": torch.tensor([lam + math.log(-math.expm1(-lam))])}  # softplus^-1(lam)


@torch.no_grad()
def _init(model: SparseCoder, rows: Tensor) -> None:
    """Prototypes and decoder rows: the initial random unit directions at the rows' mean centred norm."""
    c = (rows - model.b_dec).norm(dim=1).mean()
    model.W_enc.mul_(c)
    model.W_dec.mul_(c)


@torch.no_grad()
def _finish(model: SparseCoder) -> None:
    """Write the affine inference form: W_enc = 2 lambda P^T, b_enc = -lambda |p_j|^2."""
    lam = scale(model)
    model.b_enc.copy_(-lam * model.W_enc.square().sum(dim=0))
    model.W_enc.mul_(2 * lam)


def _encode(model: SparseCoder, x: Tensor) -> Tensor:
    """sparsemax((x - b_dec) W_enc + b_enc) per row, dense [B, L]."""
    f, idx, _, _ = kernels.encode_sparsemax(x - model.b_dec, model.W_enc, model.b_enc, x.new_ones(()),
                                            n_candidates(model), impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=f.dtype, device=f.device).scatter_add_(1, idx, f)


KINDS["spade"] = KindSpec(_train, _encode, uses_aux=False, uses_threshold=False, train_params=_train_params,
                          init=_init, finish=_finish, unit_decoder=False)
