"""JumpReLU training (Rajamanoharan et al. 2024, "Jumping Ahead"; Gemma Scope), kinds ``jumprelu`` and ``jumprelu-relative``.

A JumpReLU latent is ``f_j = z_j H(z_j - theta_j)`` with z = (x - b_dec) W_enc + b_enc and a learned threshold
theta_j = exp(log_threshold_j) > 0 per latent. H has no useful derivative, so training uses the paper's
straight-through estimators with a rectangle kernel K(u) = 1{|u| < 1/2} of bandwidth eps:

- d f_j / d theta_j = -(theta_j / eps) K((z_j - theta_j) / eps); d f_j / d z_j = H(z_j - theta_j) (no STE on z);
- the L0 count sum_j H(z_j - theta_j) has d / d theta_j = -(1 / eps) K((z_j - theta_j) / eps) (and none on z).

Loss: FVU + c * P(L0) with the L0 averaged over the batch's rows and c warmed up linearly
(``JumpReLUSettings.sparsity_warmup_steps``); P is ``(L0 / k - 1)^2`` (``jumprelu_penalty="target"``, the default:
it holds the L0 near k so the run compares with TopK at the same k, as dictionary_learning's target_l0) or
``L0 / k`` (``"linear"``: the paper's penalty, divided by k).

Dead latents (a departure: the paper has no AuxK): both rules take the AuxK loss over the loop's dead latents
(``KindSpec.uses_aux``, batchtopk's weight 1/4 and window of a 64th of the run, ``KindSpec.defaults``),
and each step a dead latent's threshold comes down to just below the largest pre-activation it reaches on the batch
(:func:`lower_dead_thresholds`). AuxK alone cannot revive a JumpReLU latent: its threshold was trained up while it
fired and stays there once it stops, so the encoder AuxK trains never reaches it. Without the rule a quarter to a
third of the latents ended dead on bench/synthetic_recovery.py --small; with it 0-1%, and jumprelu-relative
recovers more planted atoms than batchtopk on the heavy-tailed and hierarchical settings (docs/results/kinds.md#auxk-and-the-dead-threshold-rule).

Sparse form: only entries with z_j > theta_j - eps/2 (the active ones and those inside the kernel's window)
have a value or a gradient, so the step works on the packed code of those entries
(``kernels.encode_above``) and decodes it sparsely: the same numbers as the dense formulas, which
``impl="reference"`` computes.

Departures from the paper, all for short runs: both rules add the selection kinds' L1 tie-break on the codes
(``TrainConfig.code_l1``, fading with the learning rate, docs/results/batchtopk.md): on the planted benchmark it turns the
blends the absolute rule learned onto the atoms (+15-16 points on the heavy-tailed settings) and on the real corpora
it brings the calibrated absolute rule from 15-23% above TopK's FVU-L0 frontier to 1-7% (docs/results/kinds.md#auxk-and-the-dead-threshold-rule). ``jumprelu`` starts as TopK (``TrainConfig.topk_start``, 0.3 of the
run by default, ``KindSpec.defaults``): per-row TopK with the selection kinds' tie-break, the
threshold set (not trained) to the mean of the rows' k-th largest pre-activation, then the JumpReLU rule and its
estimators from there. From a random start a pre-activation is a random projection, proportional to the row's
norm, so a threshold that keeps L0 near k fires on the large rows only and the absolute kind learned 0% of the
planted atoms on heavy-tailed rows and 85% on plain ones; with the start, 31-48% and 98%
(bench/synthetic_recovery.py --small, docs/results/kinds.md#the-other-jumprelu-defaults). theta starts at the (N k)-th
largest pre-activation over the first N rows (so a run without the start runs its first step at L0 ~ k) instead
of 0.001; eps is 0.05 in training units (rows of mean norm sqrt(D); the paper's 0.001 for rows of unit mean
squared norm is ~0.01 here); and the trained parameter is log(theta) / THRESHOLD_RATE, so Adam moves the
thresholds 10x faster than SAELens's log(theta) would (without it the L0 sank to 3-4 for k = 6 and never came back
within a benchmark run). Decoder rows are kept at unit norm like every kind here. Inference is the import-only
kind's rule, ``relu(z) * (relu(z) > threshold)``, so the dictionary exports to SAELens (``jumprelu``) unchanged.
With the target penalty the learned thresholds are then multiplied by one factor, set on rows never trained on so
that their mean L0 is k (saes.calibration; on small real corpora the thresholds as trained fired 2-4.5x k on unseen
rows): the saved thresholds carry it.

``jumprelu-relative`` is the same training on the row-relative scale of ``batchtopk`` (saes.kinds.common.row_scale,
docs/results/batchtopk.md): z = (x - b_dec) W_enc / s(x) + b_enc is compared with theta_j and the kept values are
multiplied back by s(x). With absolute thresholds, heavy-tailed row norms break JumpReLU the way they break the
published BatchTopK (one threshold cannot separate interference in large rows from signal in small ones):
on ``bench/synthetic_recovery.py --small --settings heavy`` ``jumprelu`` recovered 0% of the atoms at held-out FVU
0.31 before its TopK start and 44% at 0.15 with it (``batchtopk-absolute``: 0%), ``jumprelu-relative`` 81%
(docs/results/kinds.md). The start does not help the relative kind (it lost 1-6 points on three settings), so it has none. Its
inference is ``batchtopk``'s rule with a per-latent threshold, so it does not export to SAELens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from .. import kernels
from ..comm import LOCAL, Comm, StepInputs, job_sum
from .batchtopk import BATCHTOPK_DEFAULTS
from .common import (add_code_l1, decode_train_code, fired_from_code, relative_encode, relative_scores, relu_scores,
                     row_scale, shard_code, sharded_decode, threshold_encode, train_code)
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder

DEFAULT_BANDWIDTH = 0.05


@dataclass
class JumpReLUSettings:
    """Settings of both JumpReLU rules."""

    l0_coeff: float = field(default=1.0, metadata={"help": (
        "Weight of the L0 penalty (straight-through L0): target: l0_coeff * (L0 / k - 1)^2; linear: "
        "l0_coeff * L0 / k (the paper's).")})
    jumprelu_penalty: Literal["target", "linear"] = field(default="target", metadata={"help": (
        "The sparsity penalty: target (quadratic around L0 = k, comparable with TopK at the same k) or linear "
        "(the paper's, its L0 follows the coefficient).")})
    jumprelu_bandwidth: float = field(default=DEFAULT_BANDWIDTH, metadata={"help": (
        "Width of the straight-through estimators' rectangle kernel, in training units (rows of mean norm "
        "sqrt(D)); 0.05 measured on planted atoms (docs/results/defaults.md).")})
    sparsity_warmup_steps: int | None = field(default=None, metadata={"help": (
        "Steps over which the sparsity coefficient rises linearly from 0; None: the learning rate's warm-up.")})

    def __post_init__(self) -> None:
        if not self.jumprelu_bandwidth > 0:
            raise ValueError(f"jumprelu_bandwidth={self.jumprelu_bandwidth} must be positive")

THRESHOLD_RATE = 10.0
"""theta = exp(THRESHOLD_RATE * scaled_log_threshold): Adam moves each parameter by about the learning rate per
step, so this multiplies the thresholds' step by 10 (about 4.5% of theta per step at the default lr of L=512).
At rate 1 (log theta itself as the parameter, as SAELens) theta moves 0.45% per step while the encoder moves the
pre-activations several percent: on bench/synthetic_recovery.py --small the L0 sank to 2-4 for k=6 and the
quadratic target could not pull it back within 182 steps (jumprelu-relative ended at L0 4.2, jumprelu at 3.3-3.8);
at rate 10 both hold L0 at 5.8-6.4 (docs/results/kinds.md)."""


def _rectangle(u: Tensor) -> Tensor:
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class JumpReLU(torch.autograd.Function):
    """f = z H(z - theta) elementwise; STE for theta (kernel of bandwidth eps), plain H for z."""

    @staticmethod
    def forward(ctx, z: Tensor, theta: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(z, theta)
        ctx.eps = eps
        return z * (z > theta)

    @staticmethod
    def backward(ctx, g: Tensor):
        z, theta = ctx.saved_tensors
        eps = ctx.eps
        return g * (z > theta), -(theta / eps) * _rectangle((z - theta) / eps) * g, None


class Step(torch.autograd.Function):
    """H(z - theta) elementwise; STE for theta only (the L0 count's pseudo-derivative)."""

    @staticmethod
    def forward(ctx, z: Tensor, theta: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(z, theta)
        ctx.eps = eps
        return (z > theta).to(z.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        z, theta = ctx.saved_tensors
        eps = ctx.eps
        return None, -(1.0 / eps) * _rectangle((z - theta) / eps) * g, None


def sparsity_penalty(l0: Tensor, k: int, rule: str) -> Tensor:
    """P(L0) for the mean L0 of the batch (0-dim): (L0 / k - 1)^2 (target) or L0 / k (linear)."""
    return (l0 / k - 1).square() if rule == "target" else l0 / k


def _topk_start(model: SparseCoder, x: Tensor, inputs: StepInputs, relative: bool) -> TrainOutput:
    """A step of the run's TopK start (``TrainConfig.topk_start``): TopK per row (on the kind's scale) with the
    tie-break, the threshold out of the loss (its gradient is zero); theta is set to the mean over the batch's rows
    of their k-th largest pre-activation, so the threshold rule takes over at L0 ~ k with an encoder that already
    holds the atoms."""
    c = train_code(model, x, inputs, batch=False, relative=relative)
    with torch.no_grad():
        z = c.values.detach() / row_scale(model, x) if relative else c.values.detach()
        kth = inputs.comm.shards.all_min(z.masked_fill(z <= 0, math.inf).min(dim=1).values)  # over every latent
        found = torch.isfinite(kth)
        total = inputs.comm.all_sum(torch.stack([kth[found].sum(), found.sum().to(kth.dtype)]).double())
        if total[1] > 0:
            theta = max(float(total[0] / total[1]), 1e-3)
            model.scaled_log_threshold.fill_(math.log(theta) / THRESHOLD_RATE)
    # the threshold is not in the loss: the loop gives it a zero gradient (training.apply_update)
    return decode_train_code(model, c, inputs, tie_break=True)


DEAD_MARGIN = 1e-3
"""A lowered threshold sits this fraction below the best pre-activation, so that row fires on every machine: at
the pre-activation itself, exp(log(z)) and the encoder's own matmul round either way by an ulp, and whether the
row fired depended on the CPU's libm (tests/test_golden.py's jumprelu entry moved by one entry's L0 between two
machines)."""


@torch.no_grad()
def lower_dead_thresholds(model: SparseCoder, centred: Tensor, inputs: StepInputs) -> None:
    """Each dead latent (``inputs.dead``) whose threshold lies above every pre-activation it reaches on the whole batch
    (``centred``: this process's rows on the kind's scale) gets the largest of them, less :data:`DEAD_MARGIN`, as its
    threshold: its best row fires and lies inside the estimator's window, and the reconstruction decides from there
    whether it keeps firing. A threshold only comes down here. Why: a threshold trained up while its latent fired stays
    where it was once the latent stops firing (the estimators reach only entries within eps / 2 of it), so AuxK, which
    trains the dead latents' encoders, could not bring them back: on bench/synthetic_recovery.py --small a quarter of
    jumprelu-relative's latents ended dead with thresholds 3x the alive ones' median and activations at a third of them
    (docs/results/kinds.md#auxk-and-the-dead-threshold-rule)."""
    cols = inputs.dead.nonzero().flatten()
    if cols.numel() == 0:
        return
    best = -inputs.comm.all_min(-(centred @ model.W_enc[:, cols] + model.b_enc[cols]).max(dim=0).values)
    theta = threshold_of(model)[cols]
    low = (best > 0) & (best < theta)
    if low.any():
        model.scaled_log_threshold[cols[low]] = (best[low] * (1 - DEAD_MARGIN)).log() / THRESHOLD_RATE


def _train(model: SparseCoder, x: Tensor, inputs: StepInputs, relative: bool = False) -> TrainOutput:
    if inputs.per_row:
        return _topk_start(model, x, inputs, relative)
    cfg = inputs.settings
    eps = cfg.jumprelu_bandwidth if cfg is not None else DEFAULT_BANDWIDTH
    s = row_scale(model, x) if relative else None
    # (not relative: x - b_dec inside encode_above, which makes b_dec's gradient from the entries': ``shift``)
    centred = (x - model.b_dec) / s if relative else x - model.b_dec if inputs.dead is not None else None
    if inputs.dead is not None:  # the loop's dead latents (uses_aux): their thresholds come down, AuxK trains them
        lower_dead_thresholds(model, centred, inputs)
    theta = threshold_of(model)
    z, idx, kept = kernels.encode_above(centred if relative else x, model.W_enc, model.b_enc,
                                        (theta - eps / 2).detach(), model.k, impl=model.kernel_impl,
                                        shift=None if relative else model.b_dec)
    # the estimators run over the window's entries only (row by row: a few rows with hundreds of entries pad the
    # code to several times its mean width), and f goes back into the packed code for the decode; index_select /
    # index_copy, whose backwards are an index_add in order and a gather (advanced indexing's backward is an
    # accumulating index_put: tens of ms at two threads over the padded code, its sums in a thread-dependent order)
    pos = kept.flatten().nonzero().flatten()
    zk, ik = z.flatten().index_select(0, pos), idx.flatten().index_select(0, pos)
    th = theta.index_select(0, ik)
    fk = JumpReLU.apply(zk, th, eps)
    f = zk.new_zeros(z.numel()).index_copy_(0, pos, fk).view_as(z)
    # every packed entry carries its gradient, zeros included: an entry just below theta has f = 0, and its
    # d loss / d f drives the threshold's estimator; the padding (``kept`` False) is skipped by the decode's backward
    x_hat = sharded_decode(model, f * s if relative else f, idx, inputs.comm, skip_zero_grads=kept)
    l0 = Step.apply(zk, th, eps).sum() / inputs.stats.rows  # this process's part of the batch's mean
    l0_all = job_sum(inputs.comm, l0.detach())  # over the rows of every data rank and the latents of every shard
    coeff = (cfg.l0_coeff if cfg is not None else 1.0) * inputs.warmup
    rule = cfg.jumprelu_penalty if cfg is not None else "target"
    # value: this process's share of P(L0 of the whole batch); gradient: P'(L0) times this process's part of the
    # L0, which summed over processes is the gradient of P(L0 of the whole batch)
    whole = sparsity_penalty(l0_all, model.k, rule)
    share = whole / (inputs.comm.size * inputs.comm.shards.size)  # every process of the job holds a share
    penalty = coeff * (share + sparsity_penalty(l0_all + (l0 - l0.detach()), model.k, rule) - whole)
    penalty = add_code_l1(penalty, f * s if relative else fk, inputs)  # (the padding adds nothing)
    fired, l0_all_rows = fired_from_code(fk.detach()[None], ik[None], model.n_latents)  # as one row
    l0_rows = l0_all_rows / z.shape[0]
    aux = None
    if inputs.dead is not None:  # AuxK over the dead latents, on the kind's scale (the loop asks when uses_aux)
        aux = kernels.encode_aux(centred, model.W_enc, model.b_enc, inputs.dead, inputs.k_aux, impl=model.kernel_impl)
        aux = kernels.SparseCode(shard_code(aux.values, inputs.k_aux, inputs.comm), aux.indices)  # global top k_aux
        if relative:
            aux = kernels.SparseCode(aux.values * s, aux.indices)
    return TrainOutput(x_hat, fired, l0_rows, penalty, None, aux)


def _train_params(model: SparseCoder) -> dict[str, Tensor]:
    return {"scaled_log_threshold": torch.full((model.n_latents,), math.log(1e-3) / THRESHOLD_RATE)}


def threshold_of(model: SparseCoder) -> Tensor:
    """The training thresholds theta [L] = exp(THRESHOLD_RATE * scaled_log_threshold), differentiable."""
    return (THRESHOLD_RATE * model.scaled_log_threshold).exp()


def _train_relative(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    return _train(model, x, inputs, relative=True)


@torch.no_grad()
def _init(model: SparseCoder, rows: Tensor, comm: Comm = LOCAL) -> None:
    """theta_j = the (N k)-th largest pre-activation over the N first rows (L0 ~ k at the first step); for the
    relative kind, of the row-relative pre-activations; over every latent shard's latents."""
    centred = rows - model.b_dec
    if model.spec.relative:
        centred = centred / row_scale(model, rows)
    pre = torch.relu(centred @ model.W_enc + model.b_enc).flatten()
    keep = min(pre.numel() * comm.shards.size, max(1, rows.shape[0] * model.k))
    top = pre.topk(min(keep, pre.numel()), sorted=False).values  # this shard's candidates
    top = comm.shards.gather_rows(top) if comm.shards.size > 1 else top
    theta = max(float(top.topk(keep, sorted=False).values.min()), 1e-3)
    model.scaled_log_threshold.fill_(math.log(theta) / THRESHOLD_RATE)


@torch.no_grad()
def _finish(model: SparseCoder) -> None:
    model.threshold.copy_(threshold_of(model))


def _ratio_scores(model: SparseCoder, x: Tensor) -> Tensor:
    """relu(pre) / theta_j [B, L] (on the row-relative scale for jumprelu-relative): a latent fires where this
    exceeds 1, so one factor c on every threshold moves the mean L0 as BatchTopK's cut does (``calibration``)."""
    acts = relative_scores(model, x) if model.spec.relative else relu_scores(model, x)
    return acts / model.threshold.clamp_min(1e-12)


def calibrates(settings: JumpReLUSettings) -> bool:
    """Only the target penalty calibrates: the linear penalty's L0 follows its coefficient rather than k."""
    return settings.jumprelu_penalty == "target"


def sparsity_warmup(settings: JumpReLUSettings) -> int | None:
    return settings.sparsity_warmup_steps


_COMMON = dict(uses_aux=True, uses_threshold=True, train_params=_train_params, init=_init, finish=_finish,
               scores=_ratio_scores, scales_thresholds=True, settings=JumpReLUSettings, calibrated=calibrates,
               sparsity_warmup=sparsity_warmup, mixed_precision=True, shardable=True)
KINDS = (
    # batchtopk's defaults (docs/results/defaults.md)
    KindSpec(_train, threshold_encode, name="jumprelu", defaults=BATCHTOPK_DEFAULTS, saelens="jumprelu",
             **_COMMON),
    # batchtopk's defaults without the TopK start (docs/results/defaults.md)
    KindSpec(_train_relative, relative_encode, relative=True, name="jumprelu-relative",
             defaults={**BATCHTOPK_DEFAULTS, "topk_start": 0.0}, **_COMMON),
)
