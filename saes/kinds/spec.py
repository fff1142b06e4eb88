"""What a dictionary kind declares (:class:`KindSpec`) and what its training forward returns (:class:`TrainOutput`).

A kind is one module of this folder: its settings dataclass (the fields only it reads, each with a short
``metadata["help"]``), its defaults for the shared fields that differ by kind (:data:`SHARED_DEFAULTS`), how many
sources it reads, whether it calibrates a threshold, and its forward / loss / inference hooks. The registry
(``saes.kinds``) lists the modules; nothing registers itself on import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, NamedTuple

from torch import Tensor

from .. import kernels
from ..comm import StepInputs

if TYPE_CHECKING:
    from ..model import SparseCoder

SHARED_DEFAULTS: Mapping[str, float] = {"code_l1": 0.1, "aux_alpha": 1 / 32, "dead_share": 0.1, "topk_start": 0.0}
"""The defaults of the shared fields that differ by kind, for a kind that does not set its own (``KindSpec.defaults``;
``dead_share`` is the share of the run ``saes.config.default_dead_tokens`` uses). Where they come from:
docs/results/defaults.md."""

Sources = Literal["one", "several", "pair"]


class TrainOutput(NamedTuple):
    """What one training forward pass of a kind returns (all for the flattened input [B, S*D])."""

    x_hat: Tensor  # [B, S*D] reconstruction
    fired: Tensor  # [L] bool: latents active on at least one row of the batch
    l0: Tensor  # 0-dim: mean number of active latents per row (detached)
    sparsity_loss: Tensor | None  # 0-dim term added to the loss (ReLU-L1 and JumpReLU penalties, Matryoshka's
    # prefix reconstructions, SpaDE's distance penalty), None for TopK-style kinds
    smallest: Tensor | None  # 0-dim: smallest kept activation (BatchTopK threshold estimate), else None; [L] for a
    # layered kind (each layer's smallest, over its latents)
    aux: kernels.SparseCode | None  # AuxK code [B, K'] over the dead latents when asked for, else None


@dataclass(frozen=True)
class KindSpec:
    """One dictionary kind: its hooks, flags and settings."""

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
    """Whether codes and the threshold are relative to each row's centred norm (``saes.kinds.common.row_scale``);
    such a model keeps the folded normalisation in its ``norm_scale`` buffer, saved with the weights."""
    buffers: tuple[str, ...] = ()
    """Extra per-latent buffers [L] the inference rule reads (saved with the weights), e.g. gated's r_mag, b_mag."""
    train_params: Callable[["SparseCoder"], dict[str, Tensor]] | None = None
    """Parameters the kind trains besides the weights (JumpReLU's log-threshold, SpaDE's scale): (model) ->
    name -> initial tensor. Registered for training (:meth:`SparseCoder.add_train_params`), kept in checkpoints,
    never saved with the dictionary: ``finish`` turns them into the inference form."""
    init: Callable[["SparseCoder", Tensor, Any], None] | None = None
    """Fresh run: (model, rows [N, S*D] normalised, comm) -> None, the kind's own initialisation from the first rows,
    after b_dec (e.g. JumpReLU's starting threshold; ``comm.shards`` holds the other latents, saes.comm)."""
    finish: Callable[["SparseCoder"], None] | None = None
    """End of training, before the normalisation is folded in: (model) -> None, writes the inference form
    (threshold, weights) from the trained parameters; the ``train_params`` are dropped after it."""
    unit_decoder: bool = True
    """Whether training keeps decoder rows at unit norm (SpaDE's codes lie on the simplex: its decoder rows
    carry the magnitude)."""
    skip: bool = False
    """Adds a linear skip path ``x W_skip`` [D, D] from the input to the reconstruction (initialised to zero)."""
    mixed_precision: bool = False
    """Whether its training forward passes ``StepInputs.matmul_dtype`` to ``kernels.encode`` (its one dense matmul),
    so that it trains with ``TrainConfig.precision`` bf16 / fp16; other kinds train in float32 only."""
    shard_encode: Callable[["SparseCoder", Tensor, Any], Tensor] | None = None
    """(model, x_flat [B, S*D], comm) -> this latent shard's dense codes [B, L_s] for an inference rule that selects
    across latents (per-row TopK: among every shard's, through ``comm.shards``); None: ``encode`` on each shard's
    latents is the rule (thresholds, ReLU)."""
    shardable: bool = False
    """Whether it trains with its latents split over processes (``TrainConfig.latent_shards``): its forward selects
    through the seam's ``shards`` (saes.kinds.common), its per-latent state is what ``SparseCoder.latent_axis``
    names, and it reads no latent's neighbours (Matryoshka's prefixes, SpaDE's simplex do)."""
    name: str = ""
    """The kind's name (``TrainConfig.kind``, config.json's ``kind``)."""
    settings: type | None = None
    """The dataclass of the settings only this kind reads (each field with ``metadata["help"]``), or None; the run
    hands an instance to the forward as ``StepInputs.settings``. A method ``check(cfg)`` on it, when present,
    checks the settings against the rest of the ``TrainConfig`` (e.g. group sizes against ``latents``)."""
    defaults: Mapping[str, float] = field(default_factory=dict)
    """The kind's defaults for the shared fields of :data:`SHARED_DEFAULTS` where they differ."""
    sources: Sources = "one"
    """What the data holds: "one" source per dictionary (a dictionary per hookpoint; a store's several sources
    are flattened), "several" (a crosscoder: one code over every source) or "pair" (a transcoder: the component's
    input then its output, [B, 2, D]; a ``layered`` kind: S layers' inputs then their outputs, [B, 2S, D]; the code is read from the input, uncentred (``x W_enc + b_enc``: ``b_dec``
    is the output's bias), and the reconstruction targets the output; the weights are single-source)."""
    calibrated: bool | Callable[[Any], bool] = False
    """Whether a run sets aside ``calibration_batches`` to calibrate the inference threshold (needs ``scores``); a
    callable of the kind's settings where they decide (JumpReLU: only with the target penalty)."""
    layered: bool = False
    """A cross-layer transcoder (``sources == "pair"`` over S layers): the L latents are S equal blocks, block l reads
    only layer l's input (``W_enc [D, L]``: one encoder [D, L/S] per layer) and decodes only to layers >= l (the
    entries of ``W_dec [L, S*D]`` outside :meth:`SparseCoder.decoder_mask` stay zero)."""
    sparsity_warmup: Callable[[Any], int | None] | None = None
    """(settings) -> steps over which ``StepInputs.warmup`` rises linearly to 1 (None: the learning rate's warm-up)."""
    saelens: str | None = None
    """The SAELens architecture (``cfg.json``'s ``architecture``: standard, topk, jumprelu, gated) a dictionary of
    this kind is exported as with the same codes and reconstructions (saes/formats/saelens.py); None: SAELens has no
    equivalent and ``export --format saelens`` refuses it."""

    @property
    def transcodes(self) -> bool:
        """Transcoders (``sources == "pair"``)."""
        return self.sources == "pair"

    @property
    def estimates_threshold(self) -> bool:
        """Whether training keeps a running estimate of one threshold (from ``TrainOutput.smallest``), which
        calibration replaces; False for the kinds whose thresholds are learned per latent (or absent). Such a kind's
        settings hold ``threshold_start_step`` and ``threshold_momentum``."""
        return self.uses_threshold and self.scores is not None and not self.scales_thresholds

    def default_settings(self) -> Any:
        """An instance of the kind's settings at their defaults (None for a kind without settings)."""
        return self.settings() if self.settings is not None else None

    def calibrates(self, settings: Any) -> bool:
        """Whether a run with these settings (None: the defaults) calibrates the threshold."""
        if callable(self.calibrated):
            return self.calibrated(settings if settings is not None else self.default_settings())
        return self.calibrated
