"""The building blocks several kinds share: pre-activations, the row scale of the row-relative rules, the TopK /
BatchTopK training code through the fused kernel (one process or a batch spread over processes), the L1 tie-break
on the kept codes, and the threshold inference rules.

Shapes: B batch rows, D input width per source, S sources, L latents, K kept entries per row.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .. import kernels
from ..comm import Comm, StepInputs, job_gather, job_min, shard_bias, shard_sum
from .spec import TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def pre_activations(model: "SparseCoder", x: Tensor) -> Tensor:
    """x_flat [B, S*D] -> pre-activations [B, L] = (x - b_dec) W_enc + b_enc (x W_enc + b_enc for transcoders; a
    layered kind: each layer's input x_l [B, D] times its encoder block)."""
    if model.spec.layered:
        S, D = model.n_sources, model.d_in
        W = model.W_enc.view(D, S, model.n_latents // S).transpose(0, 1)  # [S, D, L/S]
        return torch.bmm(x.view(-1, S, D).transpose(0, 1), W).transpose(0, 1).reshape(x.shape[0], -1) + model.b_enc
    return (x if model.spec.transcodes else x - model.b_dec) @ model.W_enc + model.b_enc


def fired_from_code(values: Tensor, indices: Tensor, n_latents: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """(which latents fired [L] bool, the mean L0) of a zero-padded code values/indices [B, K]
    (``kernels.code_fired``: one numba pass over the code on a CPU, ~60 ms of torch at SpaDE's ~1,100 entries a
    row and B 4096)."""
    fired, count = kernels.code_fired(values.detach(), indices, n_latents, impl=impl)
    return fired, count.float().mean()


def scaled_smallest(values: Tensor, indices: Tensor, weight: Tensor) -> Tensor:
    """Smallest kept f_j * weight_j of a zero-padded code values/indices [B, K] (0 when nothing is kept)."""
    kept = values > 0
    scaled = values.detach() * weight[indices]
    return scaled[kept].min().detach() if kept.any() else values.new_zeros(())


def row_scale(model: "SparseCoder", x: Tensor) -> Tensor:
    """s(x) [B, 1] = |(x - b_dec) * norm_scale| / sqrt(S*D): each row's centred norm in training units, relative
    to the norm sqrt(S*D) that training normalises rows to on average (``norm_scale`` is 1 while training and
    the folded normalisation factor afterwards, so s(x) is the same number before and after folding)."""
    c = math.sqrt(model.n_sources * model.d_in)
    w = model.norm_scale.repeat_interleave(model.d_in)
    return ((x - model.b_dec) * w).norm(dim=1, keepdim=True).clamp_min(1e-6 * c) / c


class TrainCode(NamedTuple):
    """The code of a TopK-style training pass (:func:`train_code`), before its decode."""

    values: Tensor  # [B_r, K] kept values (zero-padded), differentiable
    indices: Tensor  # [B_r, K] int64
    fired: Tensor  # [L] bool
    l0: Tensor  # 0-dim, detached
    smallest: Tensor | None  # BatchTopK threshold estimate, else None
    aux: kernels.SparseCode | None  # AuxK code over the dead latents when asked for


def sparse_train_forward(model: "SparseCoder", x: Tensor, inputs: StepInputs, *, batch: bool,
                         scale: Tensor | None = None, relative: bool = False, tie_break: bool = False) -> TrainOutput:
    """:func:`train_code`, then :func:`decode_train_code`."""
    return decode_train_code(model, train_code(model, x, inputs, batch=batch, scale=scale, relative=relative), inputs,
                             tie_break=tie_break)


def decode_train_code(model: "SparseCoder", c: "TrainCode", inputs: StepInputs, *, tie_break: bool) -> TrainOutput:
    """The sparse decode of a training code ``c``; ``tie_break``: with :func:`add_code_l1`'s penalty."""
    rows = inputs.matmul_dtype if inputs.matmul_dtype == torch.bfloat16 else None  # a bf16 step reads bf16 rows
    x_hat = sharded_decode(model, c.values, c.indices, inputs.comm, rows_dtype=rows)
    penalty = add_code_l1(None, c.values, inputs) if tie_break else None
    return TrainOutput(x_hat, c.fired, c.l0, penalty, c.smallest, c.aux)


def sharded_decode(model: "SparseCoder", values: Tensor, indices: Tensor, comm: Comm,
                   skip_zero_grads: bool | Tensor = True, rows_dtype: torch.dtype | None = None) -> Tensor:
    """x_hat [B_r, F] = b_dec + the code values/indices [B_r, K] (this shard's latents) decoded
    (``kernels.sparse_decode``, its rows read rounded to ``rows_dtype`` when given): each latent shard decodes its
    own entries and the partial reconstructions are summed over the shards (differentiable)."""
    part = kernels.sparse_decode(values, indices, model.W_dec, shard_bias(model.b_dec, comm), impl=model.kernel_impl,
                                 skip_zero_grads=skip_zero_grads, rows_dtype=rows_dtype)
    return shard_sum(part, comm)


def shard_keep(values: Tensor, k: int, comm: Comm) -> Tensor | None:
    """bool [B_r, K]: which of this latent shard's candidates ``values`` [B_r, K] (each row's best entries among
    its latents) are among the row's ``k`` largest over every shard's candidates (gathered, N K per row), chosen
    alike on every shard; None without latent shards. The global TopK (and the AuxK code's) out of local ones."""
    shards = comm.shards
    if shards.size == 1:
        return None
    B, K = values.shape
    width = int(-shards.all_min(torch.tensor(-K)))  # the widest shard's candidates (AuxK: its dead latents)
    padded = values.detach().new_full((B, max(width, 1)), -math.inf)
    padded[:, :K] = values.detach()
    every = shards.gather_rows(padded.unsqueeze(0)).permute(1, 0, 2).reshape(B, -1)  # [B, N W]
    chosen = torch.zeros_like(every, dtype=torch.bool)
    chosen.scatter_(1, every.topk(min(k, every.shape[1]), dim=1).indices, True)
    return chosen.view(B, shards.size, -1)[:, shards.rank, :K]


def shard_code(values: Tensor, k: int, comm: Comm) -> Tensor:
    """``values`` [B_r, K] with the entries :func:`shard_keep` drops set to 0 (unchanged without latent shards)."""
    keep = shard_keep(values, k, comm)
    return values if keep is None else values * keep


def train_code(model: "SparseCoder", x: Tensor, inputs: StepInputs, *, batch: bool,
               scale: Tensor | None = None, relative: bool = False) -> TrainCode:
    """The TopK-style training pass through the fused kernel: one encoder matmul, per-row TopK
    (``batch=False``) or BatchTopK over the whole batch ranked by ``acts * scale`` (``batch=True``), the AuxK
    code from the same pre-activations (decoded by :func:`sparse_train_forward`). Crosscoder kinds call this with their ranking
    ``scale`` [L]. When other processes hold part of the batch, BatchTopK takes its cut from the seam
    (:func:`_global_batch_forward`).

    ``relative=True`` is the row-relative rule (:func:`row_scale`): the kernel encodes (x - b_dec) / s(x), so it
    ranks pre / s, and the kept values are multiplied back by s: codes relu((x - b_dec) W_enc + s(x) b_enc),
    compared across the batch relative to their row's norm."""
    dead, k_aux = inputs.dead, inputs.k_aux if inputs.dead is not None else 0
    s = row_scale(model, x) if relative else x.new_ones(x.shape[0], 1)
    if batch and (inputs.comm.size > 1 or inputs.comm.shards.size > 1):
        return _global_batch_forward(model, x, inputs, scale, s)
    # (x - b_dec) / s inside the encoder, whose backward makes b_dec's (and s's) gradient from the entries'
    enc = kernels.encode(x, model.W_enc, model.b_enc, model.k, batch=batch, scale=scale, dead=dead, k_aux=k_aux,
                         impl=model.kernel_impl, mm_dtype=inputs.matmul_dtype, shift=model.b_dec,
                         row_scale=s if relative else None)
    kept = shard_code(enc.values, model.k, inputs.comm)  # latent shards: the row's global top k
    values = kept * s if relative else kept
    fired, l0 = fired_from_code(kept, enc.indices, model.n_latents)
    aux = None
    if dead is not None:
        aux_values = shard_code(enc.aux_values, k_aux, inputs.comm)
        aux = kernels.SparseCode(aux_values * s if relative else aux_values, enc.aux_indices)
    smallest = None
    if batch:
        smallest = enc.smallest.detach() if scale is None else scaled_smallest(enc.values, enc.indices, scale)
    return TrainCode(values, enc.indices, fired, l0, smallest, aux)


def _global_batch_forward(model: "SparseCoder", x: Tensor, inputs: StepInputs,
                          scale: Tensor | None, s: Tensor) -> TrainCode:
    """BatchTopK over a batch spread over processes: each keeps its local top ``k * B`` candidates (a
    superset of its share of the global selection), the seam gathers their scores, and the ``k * B``-th
    largest is the cut every process applies; ``smallest`` is the global smallest kept score. ``s`` [B_r, 1]:
    the row scale of the relative rule (ones otherwise), as in :func:`sparse_train_forward`. Latent shards are
    more processes of the same gather: each holds its latents' candidates of its rows."""
    comm, rows, B_r = inputs.comm, inputs.stats.rows, x.shape[0]
    k_local = min(-(-model.k * rows // B_r), model.n_latents)  # k_local * B_r >= k * B
    enc = kernels.encode((x - model.b_dec) / s, model.W_enc, model.b_enc, k_local, batch=True, scale=scale,
                         dead=inputs.dead, k_aux=inputs.k_aux if inputs.dead is not None else 0,
                         impl=model.kernel_impl, mm_dtype=inputs.matmul_dtype)
    values = enc.values.detach()
    scores = values if scale is None else values * scale[enc.indices]
    alive = values > 0
    everything = job_gather(comm, scores[alive].reshape(-1))  # in the scores' dtype: a float64 run's cut
    n_keep = model.k * rows
    cut = (everything.topk(n_keep, sorted=False).values.min() if everything.numel() > n_keep
           else scores.new_tensor(-math.inf))
    keep = alive & (scores >= cut)
    width = max(1, int(keep.sum(dim=1).max()) if keep.numel() else 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    vals = (enc.values * s * keep).gather(1, order)
    idx = enc.indices.gather(1, order)
    fired, l0 = fired_from_code(vals.detach(), idx, model.n_latents)
    kept_scores = scores.masked_fill(~keep, math.inf)
    smallest = job_min(comm, kept_scores.min() if kept_scores.numel() else x.new_tensor(math.inf))
    smallest = torch.where(torch.isfinite(smallest), smallest, torch.zeros_like(smallest))
    aux = None
    if inputs.dead is not None:
        aux = kernels.SparseCode(shard_code(enc.aux_values, inputs.k_aux, comm) * s, enc.aux_indices)
    return TrainCode(vals, idx, fired, l0, smallest, aux)


def add_code_l1(loss: Tensor | None, values: Tensor, inputs: StepInputs) -> Tensor | None:
    """``loss`` (None: none yet) plus ``inputs.code_l1`` (the run's resolved ``code_l1``) x the lr's schedule
    factor x the L1 norm of this process's kept codes ``values`` [B_r, K], per row of the whole batch and over its
    RMS norm of x - mean; ``loss`` unchanged when that weight is 0, as it is outside a training run. The tie-break
    of the selection kinds (topk, batchtopk, matryoshka, crosscoder) and of jumprelu's two rules: docs/results/batchtopk.md."""
    coeff = inputs.code_l1 * inputs.schedule
    if not coeff:
        return loss
    penalty = coeff * values.sum() / inputs.stats.rows / inputs.stats.row_var.sqrt().detach()
    return penalty if loss is None else loss + penalty


def relative_acts(model: "SparseCoder", x: Tensor) -> tuple[Tensor, Tensor]:
    """(relu((x - b_dec) W_enc / s + b_enc) [B, L], s [B, 1]) for x_flat [B, S*D]: the activations of the
    row-relative kinds before selection, relative to the row scale s(x) (:func:`row_scale`)."""
    s = row_scale(model, x)
    return torch.relu((x - model.b_dec) @ model.W_enc / s + model.b_enc), s


def relative_scores(model: "SparseCoder", x: Tensor) -> Tensor:
    """What the row-relative threshold is compared with: relu(pre(x) / s(x)) [B, L]."""
    return relative_acts(model, x)[0]


def relative_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    """Inference of ``batchtopk``: s(x) relu(pre / s) where pre / s exceeds the threshold."""
    acts, s = relative_acts(model, x)
    return acts * (acts > model.threshold) * s


def relu_scores(model: "SparseCoder", x: Tensor) -> Tensor:
    """relu(pre) [B, L]: what a JumpReLU threshold is compared with."""
    return torch.relu(pre_activations(model, x))


def threshold_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    """JumpReLU inference: relu(pre) where it exceeds the per-latent ``threshold``, else 0."""
    acts = relu_scores(model, x)
    return acts * (acts > model.threshold)
