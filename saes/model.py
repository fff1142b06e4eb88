"""`SparseCoder`: one module for every dictionary kind (TopK, BatchTopK, ReLU-L1; crosscoders with S > 1).

The parameters keep the S sources flattened so one set of kernels serves SAEs and crosscoders:
``W_enc [S*D, L]``, ``b_enc [L]``, ``W_dec [L, S*D]``, ``b_dec [S*D]`` (viewed as ``[S, D, L]`` /
``[S, L, D]`` / ``[S, D]`` on disk when S > 1). What differs between kinds -- how the training step picks
the active latents, its sparsity penalty, the inference rule -- is a row of :data:`KINDS`, so a new kind
(for example a crosscoder ranking) is one table entry, not a subclass.

Shapes: B batch rows, D input width per source, S sources, L latents, K kept entries per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn

from . import kernels
from .comm import StepInputs


class TrainOutput(NamedTuple):
    """What one training forward pass of a kind returns (all for the flattened input [B, S*D])."""

    x_hat: Tensor  # [B, S*D] reconstruction
    fired: Tensor  # [L] bool: latents active on at least one row of the batch
    l0: Tensor  # 0-dim: mean number of active latents per row (detached)
    sparsity_loss: Tensor | None  # 0-dim term added to the loss (ReLU-L1 and JumpReLU penalties, Matryoshka's
    # prefix reconstructions, SpaDE's distance penalty), None for TopK-style kinds
    smallest: Tensor | None  # 0-dim: smallest kept activation (BatchTopK threshold estimate), else None
    aux: kernels.SparseCode | None  # AuxK code [B, K'] over the dead latents when asked for, else None


@dataclass(frozen=True)
class KindSpec:
    """One row of the kind table."""

    train_forward: Callable[["SparseCoder", Tensor, StepInputs], TrainOutput]
    """(model, x_flat [B_r, S*D] already normalised, inputs) -> TrainOutput. ``x_flat`` is this process's
    part of the batch; whatever the kind normalises by the batch (a penalty, a BatchTopK cut) comes from
    ``inputs.stats`` / ``inputs.comm`` (saes.comm), so the one training loop serves one or many processes.
    The loop adds the kind's ``sparsity_loss`` and, when ``uses_aux``, the AuxK loss of ``aux``."""
    encode: Callable[["SparseCoder", Tensor], Tensor]
    """(model, x_flat [B, S*D]) -> dense codes [B, L] under the inference rule."""
    uses_aux: bool
    """Whether the AuxK loss for dead latents applies."""
    uses_threshold: bool
    """Whether inference is JumpReLU with the ``threshold`` buffer (saved with the weights)."""
    trainable: bool = True
    """False for kinds that can only be imported and evaluated."""
    scores: Callable[["SparseCoder", Tensor], Tensor] | None = None
    """Thresholded kinds: (model, x_flat [B, S*D]) -> [B, L], the quantity inference compares with ``threshold``
    (used to calibrate the threshold so that L0 on unseen rows matches k)."""
    scales_thresholds: bool = False
    """Kinds whose threshold per latent is learned (JumpReLU): ``scores`` are the activations over their latent's
    threshold, and calibration multiplies every threshold by one factor, so their learned ratios are kept."""
    relative: bool = False
    """Whether codes and the threshold are relative to each row's centred norm (:func:`row_scale`); such a
    model keeps the folded normalisation in its ``norm_scale`` buffer, saved with the weights."""
    buffers: tuple[str, ...] = ()
    """Extra per-latent buffers [L] the inference rule reads (saved with the weights), e.g. gated's r_mag, b_mag."""
    train_params: Callable[["SparseCoder"], dict[str, Tensor]] | None = None
    """Parameters the kind trains besides the weights (JumpReLU's log-threshold, SpaDE's scale): (model) ->
    name -> initial tensor. Registered for training (:meth:`SparseCoder.add_train_params`), kept in checkpoints,
    never saved with the dictionary: ``finish`` turns them into the inference form."""
    init: Callable[["SparseCoder", Tensor], None] | None = None
    """Fresh run: (model, rows [N, S*D] normalised) -> None, the kind's own initialisation from the first rows,
    after b_dec (e.g. JumpReLU's starting threshold)."""
    finish: Callable[["SparseCoder"], None] | None = None
    """End of training, before the normalisation is folded in: (model) -> None, writes the inference form
    (threshold, weights) from the trained parameters; the ``train_params`` are dropped after it."""
    unit_decoder: bool = True
    """Whether training keeps decoder rows at unit norm (SpaDE's codes lie on the simplex: its decoder rows
    carry the magnitude)."""
    transcodes: bool = False
    """Transcoders (saes.transcoder): the data holds a component's input and output as two sources [B, 2, D];
    the code is computed from the input, uncentred (``x W_enc + b_enc``: ``b_dec`` is the output's bias), and
    the reconstruction targets the output (:meth:`SparseCoder.split`). The weights are single-source."""
    skip: bool = False
    """Adds a linear skip path ``x W_skip`` [D, D] from the input to the reconstruction (initialised to zero)."""

    @property
    def estimates_threshold(self) -> bool:
        """Whether training keeps a running estimate of one threshold (from ``TrainOutput.smallest``), which
        calibration replaces; False for the kinds whose thresholds are learned per latent (or absent)."""
        return self.uses_threshold and self.scores is not None and not self.scales_thresholds


def _pre(model: "SparseCoder", x: Tensor) -> Tensor:
    """x_flat [B, S*D] -> pre-activations [B, L] = (x - b_dec) W_enc + b_enc (x W_enc + b_enc for transcoders)."""
    return (x if model.spec.transcodes else x - model.b_dec) @ model.W_enc + model.b_enc


def fired_from_code(values: Tensor, indices: Tensor, n_latents: int) -> tuple[Tensor, Tensor]:
    active = values > 0
    fired = torch.zeros(n_latents, dtype=torch.bool, device=values.device)
    fired[indices[active]] = True
    return fired, active.sum(dim=1).float().mean().detach()


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
    x_hat = kernels.sparse_decode(c.values, c.indices, model.W_dec, model.b_dec, impl=model.kernel_impl,
                                  skip_zero_grads=True)
    penalty = add_code_l1(None, c.values, inputs) if tie_break else None
    return TrainOutput(x_hat, c.fired, c.l0, penalty, c.smallest, c.aux)


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
    if batch and inputs.comm.size > 1:
        return _global_batch_forward(model, x, inputs, scale, s)
    enc = kernels.encode((x - model.b_dec) / s if relative else x - model.b_dec, model.W_enc, model.b_enc, model.k,
                         batch=batch, scale=scale, dead=dead, k_aux=k_aux, impl=model.kernel_impl)
    values = enc.values * s if relative else enc.values
    fired, l0 = fired_from_code(enc.values, enc.indices, model.n_latents)
    aux = None
    if dead is not None:
        aux = kernels.SparseCode(enc.aux_values * s if relative else enc.aux_values, enc.aux_indices)
    smallest = None
    if batch:
        smallest = enc.smallest.detach() if scale is None else scaled_smallest(enc.values, enc.indices, scale)
    return TrainCode(values, enc.indices, fired, l0, smallest, aux)


def _global_batch_forward(model: "SparseCoder", x: Tensor, inputs: StepInputs,
                          scale: Tensor | None, s: Tensor) -> TrainCode:
    """BatchTopK over a batch spread over processes: each keeps its local top ``k * B`` candidates (a
    superset of its share of the global selection), the seam gathers their scores, and the ``k * B``-th
    largest is the cut every process applies; ``smallest`` is the global smallest kept score. ``s`` [B_r, 1]:
    the row scale of the relative rule (ones otherwise), as in :func:`sparse_train_forward`."""
    comm, rows, B_r = inputs.comm, inputs.stats.rows, x.shape[0]
    k_local = min(-(-model.k * rows // B_r), model.n_latents)  # k_local * B_r >= k * B
    enc = kernels.encode((x - model.b_dec) / s, model.W_enc, model.b_enc, k_local, batch=True, scale=scale,
                         dead=inputs.dead, k_aux=inputs.k_aux if inputs.dead is not None else 0,
                         impl=model.kernel_impl)
    values = enc.values.detach()
    scores = values if scale is None else values * scale[enc.indices]
    alive = values > 0
    everything = comm.gather_rows(scores[alive].float().reshape(-1))
    n_keep = model.k * rows
    cut = (everything.topk(n_keep, sorted=False).values.min().to(scores.dtype) if everything.numel() > n_keep
           else scores.new_tensor(-math.inf))
    keep = alive & (scores >= cut)
    width = max(1, int(keep.sum(dim=1).max()) if keep.numel() else 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    vals = (enc.values * s * keep).gather(1, order)
    idx = enc.indices.gather(1, order)
    fired, l0 = fired_from_code(vals.detach(), idx, model.n_latents)
    kept_scores = scores.masked_fill(~keep, math.inf)
    smallest = comm.all_min(kept_scores.min() if kept_scores.numel() else x.new_tensor(math.inf))
    smallest = torch.where(torch.isfinite(smallest), smallest, torch.zeros_like(smallest))
    aux = kernels.SparseCode(enc.aux_values * s, enc.aux_indices) if inputs.dead is not None else None
    return TrainCode(vals, idx, fired, l0, smallest, aux)


def _topk_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    return sparse_train_forward(model, x, inputs, batch=False, tie_break=True)


def _topk_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    code = kernels.encode_topk(x - model.b_dec, model.W_enc, model.b_enc, model.k, impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device).scatter_(
        1, code.indices, code.values
    )


def _batchtopk_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Row-relative BatchTopK with the tie-break; per row (TopK) while ``inputs.per_row`` (the run's TopK start,
    ``TrainConfig.topk_start``)."""
    return sparse_train_forward(model, x, inputs, batch=not inputs.per_row, relative=True, tie_break=True)


def add_code_l1(loss: Tensor | None, values: Tensor, inputs: StepInputs) -> Tensor | None:
    """``loss`` (None: none yet) plus ``inputs.code_l1`` (the run's resolved ``code_l1``) x the lr's schedule
    factor x the L1 norm of this process's kept codes ``values`` [B_r, K], per row of the whole batch and over its
    RMS norm of x - mean; ``loss`` unchanged when that weight is 0, as it is outside a training run. The tie-break
    of the selection kinds (topk, batchtopk, matryoshka, crosscoder) and of jumprelu's two rules: docs/batchtopk.md."""
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


def _absolute_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    return sparse_train_forward(model, x, inputs, batch=True)


def relu_scores(model: "SparseCoder", x: Tensor) -> Tensor:
    """relu(pre) [B, L]: what a JumpReLU threshold is compared with."""
    return torch.relu(_pre(model, x))


def threshold_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    """JumpReLU inference: relu(pre) where it exceeds the per-latent ``threshold``, else 0."""
    acts = relu_scores(model, x)
    return acts * (acts > model.threshold)


def _gated_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    """Gated SAE (Rajamanoharan et al. 2024): the gate ``(x - b_dec) W_enc + b_enc > 0`` picks the latents, the
    magnitude path ``(x - b_dec) W_enc * exp(r_mag) + b_mag`` (shared encoder directions) gives their values."""
    z = (x - model.b_dec) @ model.W_enc
    return (z + model.b_enc > 0) * torch.relu(z * torch.exp(model.r_mag) + model.b_mag)


def _not_trainable(model: "SparseCoder", x: Tensor, *_: object, **__: object) -> TrainOutput:
    raise ValueError(f"kind {model.kind!r} is imported for inference only; train another kind instead")


def _relu_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    acts = torch.relu(_pre(model, x))
    x_hat = acts @ model.W_dec + model.b_dec
    # L1 on f_j * sum_s |d_j^s| per row, averaged over the WHOLE batch's rows and divided by its RMS norm of
    # x - mean, so the coefficient does not depend on the scale of x (nor on how the batch is split)
    penalty = (acts * model.decoder_norms().sum(dim=0)).sum() / inputs.stats.rows
    scale = inputs.stats.row_var.sqrt().detach()
    active = acts > 0
    return TrainOutput(x_hat, active.any(dim=0), active.sum(dim=1).float().mean().detach(),
                       inputs.l1_coeff * penalty / scale, None, None)


def _relu_encode(model: "SparseCoder", x: Tensor) -> Tensor:
    return torch.relu(_pre(model, x))


KINDS: dict[str, KindSpec] = {
    "topk": KindSpec(_topk_train, _topk_encode, uses_aux=True, uses_threshold=False),
    "batchtopk": KindSpec(_batchtopk_train, relative_encode, uses_aux=True, uses_threshold=True,
                          scores=relative_scores, relative=True),
    "batchtopk-absolute": KindSpec(_absolute_train, threshold_encode, uses_aux=True, uses_threshold=True,
                                   scores=relu_scores),
    "relu": KindSpec(_relu_train, _relu_encode, uses_aux=False, uses_threshold=False),
    # imported from other libraries (saes/formats): gated SAEs. ``jumprelu`` (saes/jumprelu.py) is trainable.
    "gated": KindSpec(_not_trainable, _gated_encode, uses_aux=False, uses_threshold=False, trainable=False,
                      buffers=("r_mag", "b_mag")),
}
"""kind name -> KindSpec. Other stages may register kinds here (e.g. a crosscoder ranking)."""


def kind_spec(kind: str) -> KindSpec:
    """The table row for ``kind``; the error lists the valid kinds."""
    if kind not in KINDS:
        raise ValueError(f"unknown dictionary kind {kind!r}; choose one of {sorted(KINDS)}")
    return KINDS[kind]


class SparseCoder(nn.Module):
    """A sparse dictionary over S sources of width D each (S = 1: an SAE).

    Parameters: ``W_enc [S*D, L]`` (a transposed view of latent-major storage), ``b_enc [L]``,
    ``W_dec [L, S*D]``, ``b_dec [S*D]``; buffer ``threshold [L]`` (the JumpReLU inference threshold of
    BatchTopK; -1 until estimated).
    """

    def __init__(self, d_in: int, n_latents: int, k: int, kind: str = "topk", n_sources: int = 1,
                 kernel_impl: str = "auto", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        kind_spec(kind)
        if d_in < 1 or n_latents < 1 or n_sources < 1:
            raise ValueError(f"d_in={d_in}, n_latents={n_latents}, n_sources={n_sources} must all be >= 1")
        if not 1 <= k < n_latents:
            raise ValueError(f"k={k} must be at least 1 and below n_latents={n_latents}; lower --k or raise --latents")
        self.d_in, self.n_latents, self.k, self.kind, self.n_sources = d_in, n_latents, k, kind, n_sources
        self.kernel_impl = kernel_impl
        width = n_sources * d_in
        kw = {"dtype": dtype, "device": device}
        # stored latent-major ([L, S*D] in memory, a transposed view): each latent's encoder vector is
        # contiguous, so the sparse encoder backward writes whole rows (saes/kernels) and no transpose copy
        # is ever made; the logical shape, the files and every formula stay [S*D, L]
        self.W_enc = nn.Parameter(torch.empty(n_latents, width, **kw).t())
        self.b_enc = nn.Parameter(torch.zeros(n_latents, **kw))
        self.W_dec = nn.Parameter(torch.empty(n_latents, width, **kw))
        self.b_dec = nn.Parameter(torch.zeros(width, **kw))
        if self.spec.skip:
            self.W_skip = nn.Parameter(torch.zeros(width, width, **kw))
        self.register_buffer("threshold", torch.full((n_latents,), -1.0, **kw))
        self.register_buffer("norm_scale", torch.ones(n_sources, **kw))
        for name in self.spec.buffers:
            self.register_buffer(name, torch.zeros(n_latents, **kw))
        self.reset_parameters()

    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.kind)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random unit-norm decoder rows, ``W_enc = W_dec^T``, zero biases. A transcoder's decoder starts at
        zero (sparsify's rule: it predicts another activation, so a tied decoder would start with a random map;
        the first steps give each latent its direction)."""
        with torch.no_grad():
            w = torch.randn(self.W_dec.shape, generator=generator, dtype=torch.float32)
            w /= w.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self.W_dec.copy_(w * (0 if self.spec.transcodes else 1))
            self.W_enc.copy_(w.T)
            self.b_enc.zero_()
            self.b_dec.zero_()
            if self.spec.skip:
                self.W_skip.zero_()

    # -- shapes ---------------------------------------------------------------------------------
    def flatten_input(self, x: Tensor) -> Tensor:
        """x [B, D] (S = 1) or [B, S, D] -> [B, S*D]; the error names the expected shape."""
        S, D = self.n_sources, self.d_in
        ok = (x.dim() == 2 and S == 1 and x.shape[1] == D) or (x.dim() == 3 and x.shape[1:] == (S, D))
        if not ok:
            want = f"[B, {D}]" if S == 1 else f"[B, {S}, {D}]"
            raise ValueError(f"input of shape {list(x.shape)} does not fit this dictionary: expected {want} "
                             f"(d_in={D}, n_sources={S})")
        return x.reshape(x.shape[0], S * D)

    @property
    def data_sources(self) -> int:
        """Sources in a training / evaluation batch: 2 (input, output) for transcoders, else ``n_sources``."""
        return 2 if self.spec.transcodes else self.n_sources

    def flatten_batch(self, x: Tensor) -> Tensor:
        """A training / evaluation batch -> [B, data_sources * D]: a transcoder's [B, 2, D] (input, output)
        pairs, else :meth:`flatten_input`."""
        if not self.spec.transcodes:
            return self.flatten_input(x)
        if x.dim() != 3 or x.shape[1:] != (2, self.d_in):
            raise ValueError(f"a {self.kind} trains and evaluates on (input, output) pairs [B, 2, {self.d_in}]; got "
                             f"{list(x.shape)}: give two hookpoints, the component's input then its output")
        return x.reshape(x.shape[0], 2 * self.d_in)

    def split(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """A flattened batch (:meth:`flatten_batch`) -> (encoder input, reconstruction target): the same rows
        for an SAE or crosscoder, the input and output halves for a transcoder."""
        if not self.spec.transcodes:
            return batch, batch
        return batch[:, : self.d_in], batch[:, self.d_in:]

    def reconstruct(self, x: Tensor, f: Tensor) -> Tensor:
        """The flattened reconstruction [B, S*D] of the target from the encoder input x and the code f [B, L]:
        f W_dec + b_dec, plus x W_skip for kinds with a skip path."""
        out = f @ self.W_dec + self.b_dec
        return out + x @ self.W_skip if self.spec.skip else out

    def unflatten_output(self, x_flat: Tensor) -> Tensor:
        """[B, S*D] -> [B, D] (S = 1) or [B, S, D]."""
        if self.n_sources == 1:
            return x_flat
        return x_flat.view(x_flat.shape[0], self.n_sources, self.d_in)

    # -- inference ------------------------------------------------------------------------------
    def encode(self, x: Tensor) -> Tensor:
        """x [B, D] or [B, S, D] -> dense codes [B, L] under the kind's inference rule."""
        return self.spec.encode(self, self.flatten_input(x))

    def dense_activations(self, x: Tensor) -> Tensor:
        """x [B, D] or [B, S, D] -> [B, L]: every latent's ReLU activation before the kind's selection (TopK,
        threshold): relu(pre), or s(x) relu(pre / s(x)) for the row-relative kinds (``row_scale``)."""
        x = self.flatten_input(x)
        if not self.spec.relative:
            return torch.relu(_pre(self, x))
        acts, s = relative_acts(self, x)
        return acts * s

    def decode(self, f: Tensor) -> Tensor:
        """f [B, L] -> x_hat [B, D] or [B, S, D]."""
        return self.unflatten_output(f @ self.W_dec + self.b_dec)

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction of x, same shape as x (a transcoder: its prediction of the output from the input x)."""
        flat = self.flatten_input(x)
        return self.unflatten_output(self.reconstruct(flat, self.spec.encode(self, flat)))

    def decoder_norms(self) -> Tensor:
        """Per-source decoder row norms [S, L]."""
        return self.W_dec.view(self.n_latents, self.n_sources, self.d_in).norm(dim=2).T

    def decoder_directions(self) -> Tensor:
        """Decoder rows in raw activation units: [L, D] (S = 1) or [L, S, D]."""
        w = self.W_dec.detach()
        return w if self.n_sources == 1 else w.view(self.n_latents, self.n_sources, self.d_in)

    # -- training helpers -----------------------------------------------------------------------
    def add_train_params(self) -> None:
        """Register the kind's extra training parameters (``KindSpec.train_params``), after the weights."""
        for name, t in (self.spec.train_params(self) if self.spec.train_params else {}).items():
            self.register_parameter(name, nn.Parameter(t.to(self.W_dec)))

    def drop_train_params(self) -> None:
        """Remove the extra training parameters (after ``KindSpec.finish`` wrote the inference form)."""
        for name in (self.spec.train_params(self) if self.spec.train_params else {}):
            delattr(self, name)

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every (flattened) decoder row to unit norm."""
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_decoder_grad(self) -> None:
        """Drop the component of W_dec.grad parallel to each (unit) decoder row, so a step keeps norms ~1."""
        if self.W_dec.grad is None:
            return
        W, g = self.W_dec, self.W_dec.grad
        # g -= (g.w / |w|^2) w, without [L, D] temporaries (31 against 70 ms at L=16384, D=768)
        coef = torch.linalg.vecdot(W, g) / W.norm(dim=1).square().clamp_min(1e-24)
        g.addcmul_(W, coef[:, None], value=-1)

    @torch.no_grad()
    def fold_input_scale(self, scale: Tensor) -> None:
        """Make a dictionary trained on ``x * scale`` work on raw x (scale [S], one factor per source).

        pre = (c x - b) W + e = (x - b/c) (c W) + e and x_hat = x_hat'/c, so W_enc rows are multiplied by c,
        W_dec columns and b_dec divided by c; codes (and thresholds) are unchanged. A transcoder's scale is
        [c_in, c_out]: the encoder takes c_in, the decoder c_out, the skip path c_in / c_out."""
        scale = scale.to(self.W_enc)
        c_in = c_out = scale.repeat_interleave(self.d_in)
        if self.spec.transcodes:
            c_in, c_out, scale = scale[0].expand(self.d_in), scale[1].expand(self.d_in), scale[:1]
        self.W_enc.mul_(c_in[:, None])
        self.W_dec.div_(c_out[None, :])
        self.b_dec.div_(c_out)
        if self.spec.skip:
            self.W_skip.mul_(c_in[:, None] / c_out[None, :])
        self.norm_scale.mul_(scale.to(self.norm_scale))

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, d_in={self.d_in}, n_latents={self.n_latents}, k={self.k}, "
                f"n_sources={self.n_sources}")
