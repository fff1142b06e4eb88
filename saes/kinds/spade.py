"""SpaDE, the Sparsemax Distance Encoder (Hindupur, Lubana, Fel, Ba 2025, "Projecting Assumptions: The Duality
Between Sparse Autoencoders and Concept Geometry", arXiv 2503.01822), kind ``spade``.

Encoder: ``f(x) = sparsemax(-lambda |x - b_dec - p_j|^2)`` over the latents j, with learned prototypes p_j and
a learned scale lambda > 0 (lambda = softplus(lambda_pre)); the code lies on the probability simplex and its
support adapts to the row (how many prototypes are near it), so receptive fields are not half-spaces and the
number of active latents varies. Decoder: linear, ``x_hat = f W_dec + b_dec``, rows NOT held at unit norm (the
code sums to 1, the decoder carries the magnitude). Loss: FVU + ``spade_coeff`` times the distance-weighted
L1 ``sum_j f_j |x - b_dec - p_j|^2`` (the paper's code: weight 0.1), both divided by the batch's mean squared
distance to its mean.

Sparsemax is shift-invariant per row, so -lambda |x - p_j|^2 ranks like the affine scores
``2 lambda (x - b_dec).p_j - lambda |p_j|^2``: training computes them with ONE matmul (W_enc holds the
prototypes as columns), finds each row's support (``kernels.sparsemax_support``) and packs the code with its
distance term (``kernels.encode_spade``), so the decode is a sparse decode. At the end of training the affine form is
written into the weights, ``W_enc = 2 lambda P^T``, ``b_enc = -lambda |p_j|^2``: the saved dictionary is an
ordinary [D, L] encoder whose inference rule is sparsemax((x - b_dec) W_enc + b_enc), with the usual folding
of the normalisation and no extra tensor.

Training (why it learns): prototypes and decoder rows start at data rows and are stored in units of sqrt(S*D),
the mean row norm training normalises to, so that Adam's step (about lr per coordinate) is relative to the
rows' scale, as it is for the unit-norm decoder rows of the other kinds. With random prototypes stored in the
data's units (the earlier code) SpaDE learned no planted atom from an unrelated start: 0% at mean best cosine
0.39, chance level, L0 33 and FVU 0.60 on the test-sized problem (256 atoms in D=128, L=512, 116 steps); data
rows alone gave 40%, data rows with lr x 2 / x 4 / x 11 (= sqrt(128), what the stored unit amounts to) 58% /
86% / 97% (docs/results/kinds.md). lambda barely moves in short runs (softplus^-1 of 1/(2D) ~ log lambda, which Adam
changes by at most lr per step) and need not: started 12x larger (L0 = k at the start) with lr x 4, it fell back
to 2.2x 1/(2D) and recovered about as many atoms (90% against 86%) at a higher FVU (0.26 against 0.20).

Departures from the paper and its code (github: the authors' ``sparsemax_dist`` SAE):
- distances are taken to ``x - b_dec`` (b_dec initialised like every kind's); the paper has no biases. b_dec
  only moves the origin of the prototypes (and, the code summing to 1, a common offset of the decoder rows);
- prototypes and decoder rows start at the same rows of the initialisation sample (evenly spaced through it,
  repeated where L exceeds it), each moved by 0.1 of its norm along the seed's random direction (so the start
  depends on the seed and repeated rows part): the paper's code has this as its ``weight_init='data'`` option
  (otherwise N(0, 1) entries; W_dec = W_enc^T at init either way);
- weights stored in units of sqrt(S*D) (above); the paper's toy code: Adam at lr 1e-2 in the data's units,
  cosine decay to 1e-4; here the loop's schedule and default lr (warm-up, linear decay), Adam without weight decay;
- the distance-weighted L1 uses the prototypes (the paper's code by default uses the decoder rows, its
  ``encoder_reg`` option the prototypes; measured: 42% against 40% in the short run above, within noise, and
  the prototypes' distances come free from the scores); the loss is FVU-scaled like every kind here;
- lambda starts at 1 / (2 S*D), the paper's toy code's 1 / (2 D);
- ``k`` is not a sparsity target: it only sizes the torch search's first candidates (each row's top max(4k, 16)
  scores, more where the support may be larger); the numba search (the CPU default) reads each row once with a
  running lower bound of its threshold, or only above a threshold guessed from the rows before it where that
  guess is proved (``kernels.sparsemax_support``), whatever k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..comm import LOCAL, Comm, StepInputs
from .common import fired_from_code
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder

DEFAULT_COEFF = 0.1


@dataclass
class SpadeSettings:
    """Settings of SpaDE."""

    spade_coeff: float = field(default=DEFAULT_COEFF, metadata={"help": (
        "Weight of the distance-weighted L1 penalty sum_j f_j |x - p_j|^2 (the paper's code: 0.1), on the FVU's "
        "scale.")})
PERTURB = 0.1
"""Prototypes start at data rows moved by this fraction of the row scale along the seed's random directions."""


def weight_unit(model: SparseCoder) -> float:
    """sqrt(S*D): the mean row norm training normalises to, the unit the prototypes and decoder rows are stored in."""
    return math.sqrt(model.n_sources * model.d_in)


def n_candidates(model: SparseCoder) -> int:
    """Scores per row among which the torch search looks for the support first (more where it may be larger; the
    numba search does not use it)."""
    return min(model.n_latents, max(4 * model.k, 16))


def scale(model: SparseCoder) -> Tensor:
    """lambda = softplus(lambda_pre) (0-dim), during training."""
    return F.softplus(model.spade_lambda_pre)[0]


def _train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    # prototypes P = c W_enc and decoder rows c W_dec, c = weight_unit: the scores 2 lambda xc.p - lambda |p|^2
    # are (xc.W - c |W|^2 / 2) * 2 lambda c, and the code is decoded with values c f
    lam, W, c = scale(model), model.W_enc, weight_unit(model)
    xc = x - model.b_dec
    half_norms = -0.5 * c * kernels.square_norms(W, impl=model.kernel_impl)
    # the distance term sum_j f_j |xc - p_j|^2, with |xc - p_j|^2 = |xc|^2 - z_j / lambda at the support
    # (z_j = 2 lambda xc.p_j - lambda |p_j|^2), comes with the code
    # (the code comes as c f: the decode's values)
    cf, idx, _, dist = kernels.encode_spade(xc, W, half_norms, 2 * c * lam, lam, xc.square().sum(dim=1),
                                            n_candidates(model), impl=model.kernel_impl, value_scale=c)
    x_hat = kernels.sparse_decode(cf, idx, model.W_dec, model.b_dec, impl=model.kernel_impl, skip_zero_grads=True)
    coeff = inputs.settings.spade_coeff if inputs.settings is not None else DEFAULT_COEFF
    penalty = coeff * dist / inputs.stats.total_var
    fired, l0 = fired_from_code(cf.detach(), idx, model.n_latents, impl=model.kernel_impl)  # c > 0: f's positives
    return TrainOutput(x_hat, fired, l0, penalty, None, None)


def _train_params(model: SparseCoder) -> dict[str, Tensor]:
    lam = 1.0 / (2 * model.n_sources * model.d_in)
    return {"spade_lambda_pre": torch.tensor([lam + math.log(-math.expm1(-lam))])}  # softplus^-1(lam)


@torch.no_grad()
def _init(model: SparseCoder, rows: Tensor, comm: Comm = LOCAL) -> None:
    """Prototype j and decoder row j start at the same data row (centred by b_dec), rows taken evenly spaced
    through the initialisation sample (again from the start where L exceeds it), each moved by PERTURB of the
    row scale along latent j's random initial direction (so the start depends on the seed and repeated rows
    part); stored in units of :func:`weight_unit`."""
    c, L = weight_unit(model), model.n_latents
    pick = torch.arange(L, device=rows.device) * rows.shape[0] // L if L <= rows.shape[0] else (
        torch.arange(L, device=rows.device) % rows.shape[0])
    xc = rows[pick] - model.b_dec
    P = xc + PERTURB * xc.norm(dim=1, keepdim=True) * model.W_dec  # W_dec: the random unit directions
    model.W_enc.copy_(P.T / c)
    model.W_dec.copy_(P / c)


@torch.no_grad()
def _finish(model: SparseCoder) -> None:
    """Write the affine inference form of the prototypes P = c W_enc: W_enc = 2 lambda P^T, b_enc = -lambda |p_j|^2,
    and the decoder rows in the data's units (c W_dec)."""
    lam, c = scale(model), weight_unit(model)
    model.b_enc.copy_(-lam * c * c * model.W_enc.square().sum(dim=0))
    model.W_enc.mul_(2 * lam * c)
    model.W_dec.mul_(c)


def _encode(model: SparseCoder, x: Tensor) -> Tensor:
    """sparsemax((x - b_dec) W_enc + b_enc) per row, dense [B, L]."""
    f, idx, _, _ = kernels.encode_sparsemax(x - model.b_dec, model.W_enc, model.b_enc, x.new_ones(()),
                                            n_candidates(model), impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=f.dtype, device=f.device).scatter_add_(1, idx, f)


KINDS = (KindSpec(_train, _encode, uses_aux=False, uses_threshold=False, train_params=_train_params, init=_init,
                  finish=_finish, unit_decoder=False, name="spade", settings=SpadeSettings),)
