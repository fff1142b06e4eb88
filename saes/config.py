"""Settings of a training run: :class:`TrainConfig` (what the user chooses: the settings every kind shares, plus
the chosen kind's own ``settings``) and :class:`Resolved` (what the run uses after the defaults that depend on the
dictionary and the data's length are filled in). Flat names (``l0_coeff=2``): ``saes.train_config``. Where each
default comes from: docs/results/defaults.md."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from .kernels import FLOAT32_ONLY
from .kinds import SHARED_DEFAULTS, check_shards, kind_spec, kinds_help
from .metrics import TRACKERS
from .model import SparseCoder
from .precision import AUTO, MATMUL_DTYPES, check_precision

log = logging.getLogger(__name__)

def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class TrainConfig:
    """Settings of ``conceptdict train`` that every kind shares, and the kind's own ``settings``; defaults
    measured on the synthetic benchmark (bench/synthetic_recovery.py; docs/results/defaults.md)."""

    latents: int = field(metadata=_help("Number of latents L in the dictionary."))
    k: int = field(metadata=_help(
        "Active latents per row (TopK), or on average per row (BatchTopK); must be below latents."))
    kind: str = field(default="topk", metadata=_help(kinds_help()))
    tokens: int | None = field(default=None, metadata=_help(
        "Stop after this many training rows; None (a store): one pass, or more passes up to 2000 steps and 100 "
        "passes (docs/results/defaults.md)."))
    batch_size: int | None = field(default=None, metadata=_help(
        "Rows per step; None: 4096, halved down to 1024 while the run would take fewer than 2000 steps and down to "
        "256 for a small store (docs/results/defaults.md)."))
    lr: float | None = field(default=None, metadata=_help(
        "Adam learning rate; None: 1.6e-3 / sqrt(L / 4096) (docs/results/defaults.md)."))
    warmup_steps: int | None = field(default=None, metadata=_help(
        "Linear learning-rate warm-up steps; None: min(1000, 5 percent of the run), 100 when the run's length is "
        "unknown."))
    decay_fraction: float = field(default=0.2, metadata=_help(
        "Final fraction of the run over which the learning rate decays linearly to 0 (dictionary_learning)."))
    grad_clip: float = field(default=1.0, metadata=_help("Clip the global gradient norm to this value (0 disables)."))
    normalize: bool = field(default=True, metadata=_help(
        "Scale each source to mean norm sqrt(D) during training (Kissane et al.); folded back into the saved "
        "weights."))
    b_dec_init: Literal["geometric_median", "mean", "zero"] = field(default="geometric_median", metadata=_help(
        "Initial decoder bias: geometric median (OpenAI, dictionary_learning) or mean of the first rows, or zero."))
    init_rows: int = field(default=8192, metadata=_help(
        "Rows from the start of the training data used for the normalisation scale and b_dec."))
    aux_k: int | None = field(default=None, metadata=_help(
        "Dead latents used by the AuxK loss per row; None: min(S*D/2, L/2) (dictionary_learning's d_in/2)."))
    aux_alpha: float | None = field(default=None, metadata=_help(
        "Weight of the AuxK loss; None: the kind's default, 1/4 for batchtopk, matryoshka and both jumprelu rules, "
        "OpenAI's 1/32 otherwise (docs/results/defaults.md)."))
    dead_tokens: int | None = field(default=None, metadata=_help(
        "A latent is dead after this many rows without firing; None: a share of the run (a tenth; a 64th for "
        "batchtopk, matryoshka and jumprelu) within bounds (docs/results/defaults.md)."))
    code_l1: float | None = field(default=None, metadata=_help(
        "Weight of the L1 tie-break on the kept codes of the selection kinds, fading with the learning rate (0: as "
        "published); None: the kind's default, 0.15 or 0.1 (docs/results/defaults.md)."))
    topk_start: float | None = field(default=None, metadata=_help(
        "batchtopk, matryoshka, jumprelu: share of the run's steps that select per row (TopK) first; None: the "
        "kind's default, 0.3 or 0 (docs/results/defaults.md)."))
    calibration_batches: int | None = field(default=None, metadata=_help(
        "Thresholded kinds: batches after the held-out ones, never trained on, on which the inference threshold "
        "is set for mean L0 = k (0: keep the running estimate); None: sized to the store, 1 to 2 "
        "(docs/results/defaults.md#held-out-rows)."))
    eval_batches: int | None = field(default=None, metadata=_help(
        "Batches from the start of the data held out of training and evaluated at the end (0: none); None: sized "
        "to the store, 1 to 4 (docs/results/defaults.md#held-out-rows)."))
    stop_patience: int | None = field(default=None, metadata=_help(
        "Stop after this many held-out evaluations without a stop_threshold gain on the best FVU (a final lr decay, "
        "from the lowest FVU's weights if memorising); 0: off; None: 3 for a store run leaving tokens out, else off "
        "(docs/results/defaults.md#stopping-rule)."))
    stop_threshold: float = field(default=0.01, metadata=_help(
        "Stopping rule: an evaluation improves when its held-out FVU is below the best by more than this share of "
        "it (docs/results/defaults.md#stopping-rule)."))
    stop_every: int | None = field(default=None, metadata=_help(
        "Stopping rule: steps between held-out evaluations; None: a 20th of the run's upper bound, at least 10."))
    eval_every: int = field(default=0, metadata={"min": 0, **_help(
        "Evaluate the dictionary on the held-out rows every this many steps and log `metrics` to metrics.jsonl and "
        "the tracker (0: only at the end); the weights are unchanged "
        "(docs/guide/train.md#evaluation-during-training).")})
    metrics: list[str] = field(default_factory=list, metadata=_help(
        "With eval_every: the yardsticks to compute, comma-separated or repeated, as `eval --metrics` names them "
        "(core, sparse-probing, ground-truth, ...); empty: core."))
    eval_contexts: int = field(default=32, metadata={"min": 0, **_help(
        "With eval_every, where a causal LM is at hand (a token store's model, or --model): contexts for core's "
        "spliced CE/KL score at each evaluation; 0 skips it.")})
    seed: int = field(default=0, metadata={"min": 0, **_help(
        "Seed of the initialisation (the data order is the stream's own seed).")})
    checkpoint_every: int = field(default=500, metadata=_help(
        "Write a resumable checkpoint every this many steps and at the end (0: none); needs an output directory."))
    log_every: int = field(default=100, metadata=_help(
        "Log a metrics line every this many steps (and the last step: metrics.jsonl is never empty)."))
    log: str | None = field(default=None, metadata=_help(
        "Also send the metrics to wandb or tensorboard (optional packages; WANDB_PROJECT names the project)."))
    kernel_impl: str = field(default="auto", metadata=_help(
        "Kernel implementation (saes.kernels): auto, reference or a registered fast one."))
    device: str = field(default="auto", metadata=_help("cpu, cuda or auto (cuda when available)."))
    precision: Literal["auto", "float32", "bf16", "fp16", "float64"] = field(default="auto", metadata=_help(
        "auto: bf16 where the device has it natively, else float32 (recorded as resolved); bf16 / fp16: the encoder "
        "matmul's dtype (weights, Adam and loss stay float32); float64: the whole step (docs/guide/train.md#precision)."))
    d_in: int | None = field(default=None, metadata=_help("Expected input width D per source; None: taken from the data."))
    latent_shards: int = field(default=1, metadata={"min": 1, **_help(
        "Split the latents over N processes under torchrun (nproc = N x data ranks; docs/guide/distributed.md).")})
    single_file_gib: float = field(default=2.0, metadata={"min": 0, **_help(
        "Latent shards: up to this many GiB of weights are saved as one file, more as a file per shard (distributed.md).")})
    settings: Any = field(default=None, metadata=_help(
        "The kind's own settings (an instance of its KindSpec.settings dataclass); None: its defaults."))

    @property
    def kind_settings(self) -> Any:
        """``settings``, or the kind's defaults when None (None for a kind without settings)."""
        return self.settings if self.settings is not None else kind_spec(self.kind).default_settings()

    def __post_init__(self) -> None:
        spec = kind_spec(self.kind)
        if not spec.trainable:
            raise ValueError(f"kind {self.kind!r} is imported for inference only; train another kind (--help lists them)")
        if self.latents < 1:
            raise ValueError(f"latents={self.latents} must be at least 1")
        for owner in (self, self.settings):  # inf / nan anywhere would train to a NaN dictionary and exit 0
            for f in dataclasses.fields(owner) if dataclasses.is_dataclass(owner) else ():
                value = getattr(owner, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{f.name}={value} must be a finite number")
        if self.log not in (None, *TRACKERS):
            raise ValueError(f"log={self.log!r} is not a tracker; use one of {sorted(TRACKERS)} (metrics.jsonl is "
                             f"always written)")
        if not 1 <= self.k < self.latents:
            raise ValueError(f"k={self.k} must be at least 1 and below latents={self.latents}; "
                             f"lower --k or raise --latents")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1 (or None for the default)")
        for name in ("stop_patience", "stop_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative (0 or None: the default)")
        if not 0 <= self.stop_threshold < 1:
            raise ValueError(f"stop_threshold={self.stop_threshold} must lie in [0, 1) (a share of the best FVU)")
        self.metrics = [n.strip() for item in ([self.metrics] if isinstance(self.metrics, str) else self.metrics)
                        for n in str(item).split(",") if n.strip()]
        if self.metrics and not self.eval_every:
            raise ValueError(f"metrics={','.join(self.metrics)} are computed during training every eval_every steps; "
                             f"pass --eval-every N (eval_every=N), or measure the saved dictionary: conceptdict eval "
                             f"DICT --metrics ...")
        if self.eval_every and self.eval_batches == 0:
            raise ValueError(f"eval_every={self.eval_every} evaluates on the held-out rows, but eval_batches=0 holds "
                             f"none out: leave eval_batches at its default or set it to 1 or more")
        for name in ("init_rows", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("eval_batches", "calibration_batches", "checkpoint_every", "grad_clip", "eval_every",
                     "eval_contexts"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens={self.tokens} must be at least 1 (or None for the default, "
                             f"saes.config.default_tokens)")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must lie in [0, 1]")
        for name in ("aux_alpha", "code_l1"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 trains the kind as published; None "
                                 "for the kind's default)")
        if self.topk_start is not None and not 0 <= self.topk_start <= 1:
            raise ValueError(f"topk_start={self.topk_start} must lie in [0, 1] (or None for the kind's default)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}: use cpu, cuda, cuda:N or auto")
        if self.precision not in MATMUL_DTYPES and self.precision != AUTO:
            raise ValueError(f"precision={self.precision!r}: use one of {sorted([AUTO, *MATMUL_DTYPES])}")
        if self.precision in ("bf16", "fp16") and not spec.mixed_precision:
            raise ValueError(f"precision={self.precision!r}: kind {self.kind!r} trains in float32 only; use "
                             f"precision float32 or a kind with the fused encoder (topk, batchtopk, crosscoder, ...)")
        if self.precision == "float64" and self.kernel_impl in FLOAT32_ONLY:
            raise ValueError(f"kernel_impl={self.kernel_impl!r} computes in float32; precision float64 needs "
                             f"kernel_impl auto, torch or reference")
        if self.device != "auto":
            check_precision(self.precision, torch.device(self.device), warn=False)
        if self.settings is not None and (spec.settings is None or not isinstance(self.settings, spec.settings)):
            want = spec.settings.__name__ if spec.settings is not None else "None (it has no settings)"
            raise ValueError(f"settings={self.settings!r} do not belong to kind {self.kind!r}, whose settings are "
                             f"{want}; build the config with saes.train_config(kind=..., <setting>=...)")
        check_shards(self.kind, self.latents, self.k, self.latent_shards)
        if self.single_file_gib < 0:
            raise ValueError(f"single_file_gib={self.single_file_gib} must not be negative (0: one file per shard)")
        check = getattr(self.kind_settings, "check", None)
        if check is not None:
            check(self)


# -- resolved defaults ----------------------------------------------------------------------------

DEFAULT_BATCH = 4096
"""The default batch size of a long run (SAELens's train_batch_size_tokens)."""
SMALLEST_DEFAULT_BATCH = 1024
"""A short run's default batch does not fall below this (the in-repo planted benchmark's batch)."""
SMALL_STORE_BATCH = 256
"""A small store's default batch does not fall below this (the demo's sentence dictionary and bench/real_heldout.py
train at 256)."""
STORE_BATCHES = 64
"""The default batch halves (down to :data:`SMALL_STORE_BATCH`) while the store holds fewer batches than this, so
the held-out batches (4 to 6) stay under a tenth of a small store."""
TARGET_STEPS = 2000
"""The default batch halves while a run would take fewer steps than this, and ``tokens`` None runs this many steps
when one pass over the store is shorter (at most :data:`MAX_PASSES` passes)."""
MAX_PASSES = 100
"""``tokens`` None reads a small store at most this many times."""
MIN_BATCH = 8
"""Smaller batches make BatchTopK's per-batch selection and the held-out metrics meaningless."""
DEFAULT_STOP_PATIENCE = 3
"""``stop_patience`` of a store run that leaves ``tokens`` out (docs/results/defaults.md#stopping-rule)."""
DEFAULT_EVAL_BATCHES = 4
"""Held-out evaluation batches of a large store or of data without a known size."""
DEFAULT_CALIBRATION_BATCHES = 2
"""Threshold-calibration batches of a large store or of data without a known size."""
EVAL_SHARE = 0.05
"""A store's evaluation rows aim at this share of it (at least one batch, at most DEFAULT_EVAL_BATCHES)."""
CALIBRATION_SHARE = 0.025
"""A store's calibration rows aim at this share of it (at least one batch, at most DEFAULT_CALIBRATION_BATCHES)."""
HELDOUT_SHARE = 0.1
"""Held out above this share of a store, the default batch halves (down to MIN_STORE_BATCH) and a warning says so."""
MIN_STORE_BATCH = 64
"""The default batch of a small store does not halve below this to keep the held-out rows under a tenth."""


def default_batch_size(run_rows: int | None, store_rows: int | None = None) -> int:
    """Rows per step for a run of ``run_rows`` training rows (None: unknown) over a store of ``store_rows`` rows
    (None: a stream without an end): :data:`DEFAULT_BATCH`, halved while the run would take fewer than
    :data:`TARGET_STEPS` steps, down to :data:`SMALLEST_DEFAULT_BATCH`, then while the store holds fewer than
    :data:`STORE_BATCHES` batches, down to :data:`SMALL_STORE_BATCH`."""
    batch = DEFAULT_BATCH
    while run_rows is not None and batch > SMALLEST_DEFAULT_BATCH and run_rows < TARGET_STEPS * batch:
        batch //= 2
    while store_rows is not None and batch > SMALL_STORE_BATCH and store_rows < STORE_BATCHES * batch:
        batch //= 2
    return batch


def one_pass_rows(cfg: TrainConfig, rows: int) -> int:
    """Training rows of one pass over a store of ``rows`` rows in batches of ``cfg.batch_size``: its whole batches
    less the held-out ones (:func:`heldout_batch_count`)."""
    return (rows // cfg.batch_size - heldout_batch_count(cfg)) * cfg.batch_size


def default_tokens(pass_rows: int, batch: int) -> int:
    """Training rows of a run that leaves ``tokens`` None, over a store whose training rows (the held-out batches left
    out) are ``pass_rows``: one pass when it takes at least :data:`TARGET_STEPS` steps of ``batch`` rows, else more
    passes up to that many steps, at most :data:`MAX_PASSES` passes. Measured (docs/results/batchtopk.md#the-default-batch-size-and-run-length): ten passes over a 200k-row planted store recover nearly as many atoms as one pass over 2M
    fresh rows, and more passes over the small real corpora lower their held-out FVU."""
    return max(pass_rows, min(TARGET_STEPS * batch, MAX_PASSES * pass_rows))


def fit_to_store(cfg: TrainConfig, rows: int) -> TrainConfig:
    """``cfg`` for a store of ``rows`` rows, as a run on it trains: the default batch size filled in
    (:func:`default_batch_size` of ``tokens``, or of one pass over the store, halved down to
    :data:`MIN_STORE_BATCH` while the held-out rows would exceed a tenth of a small store), the held-out counts
    sized to the store (:func:`heldout_for_store`), the batch clamped to what the store holds beside its held-out
    batches, and ``tokens`` None filled in by :func:`default_tokens`. Warns when more than a tenth of the store is
    held out. Raises ValueError for a store too small to train on, saying how many rows it needs."""
    if cfg.batch_size is None:
        batch = default_batch_size(cfg.tokens or rows, rows)
        while batch > MIN_STORE_BATCH and _heldout_rows_any_kind(heldout_for_store(cfg, rows, batch)) > \
                HELDOUT_SHARE * rows:
            batch //= 2
        cfg = replace(cfg, batch_size=batch)
    fitted = heldout_for_store(cfg, rows, cfg.batch_size)
    held = heldout_batch_count(fitted)
    need = (held + 1) * cfg.batch_size
    if rows < need:
        batch = rows // (held + 4)
        if batch < MIN_BATCH:
            raise ValueError(f"the store has {rows} rows, too few to train on: {held} batches are held out (for "
                             f"evaluation and threshold calibration) and batches need at least {MIN_BATCH} rows, "
                             f"so it needs at least {(held + 4) * MIN_BATCH} rows; cache more (--tokens), or lower "
                             f"--eval-batches / --calibration-batches")
        log.warning("store has %d rows, fewer than (held-out batches %d + 1) * batch_size = %d; using batch_size %d",
                    rows, held, need, batch)
        cfg = replace(cfg, batch_size=batch)
        fitted = heldout_for_store(cfg, rows, batch)
    cfg = fitted
    held = heldout_batch_count(cfg) * cfg.batch_size
    if held > HELDOUT_SHARE * rows:
        log.warning("%d of the store's %d rows (%.0f%%) are held out of training (%d evaluation + %d calibration "
                    "batches of %d rows); a larger store (cache more) keeps more for training", held, rows,
                    100 * held / rows, eval_batch_count(cfg), calibration_batch_count(cfg), cfg.batch_size)
    if cfg.tokens is None:
        patience = cfg.stop_patience
        if patience is None:
            patience = DEFAULT_STOP_PATIENCE if eval_batch_count(cfg) else 0
        cfg = replace(cfg, tokens=default_tokens(one_pass_rows(cfg, rows), cfg.batch_size), stop_patience=patience)
    return cfg


def _heldout_rows_any_kind(cfg: TrainConfig) -> int:
    # evaluation + calibration rows whether or not the kind calibrates, so every kind of a store gets one batch
    return (cfg.eval_batches + cfg.calibration_batches) * cfg.batch_size


def heldout_for_store(cfg: TrainConfig, rows: int, batch: int) -> TrainConfig:
    """``cfg`` with ``batch_size`` = ``batch`` and the held-out counts it leaves None sized to a store of ``rows``
    rows: evaluation :data:`EVAL_SHARE` of the store (1 to :data:`DEFAULT_EVAL_BATCHES` batches), calibration
    :data:`CALIBRATION_SHARE` (1 to :data:`DEFAULT_CALIBRATION_BATCHES` batches). A store of 80 batches or more
    keeps today's 4 + 2."""
    ev = cfg.eval_batches if cfg.eval_batches is not None else \
        min(DEFAULT_EVAL_BATCHES, max(1, math.ceil(EVAL_SHARE * rows / batch)))
    ca = cfg.calibration_batches if cfg.calibration_batches is not None else \
        min(DEFAULT_CALIBRATION_BATCHES, max(1, math.ceil(CALIBRATION_SHARE * rows / batch)))
    return replace(cfg, batch_size=batch, eval_batches=ev, calibration_batches=ca)


def default_lr(latents: int) -> float:
    """1.6e-3 / sqrt(L / 4096): the literature's 1/sqrt(L) scaling, 4x its constant (short-run tuning)."""
    return 1.6e-3 / math.sqrt(latents / 4096)


def kind_default(cfg: TrainConfig, name: str) -> float:
    """``cfg.<name>`` when set, else the default of ``cfg.kind`` (``KindSpec.defaults``, else
    :data:`saes.kinds.SHARED_DEFAULTS`)."""
    value = getattr(cfg, name, None)
    if value is not None:
        return value
    return kind_spec(cfg.kind).defaults.get(name, SHARED_DEFAULTS[name])


def default_dead_tokens(latents: int, k: int, run_rows: int | None = None,
                        share: float = SHARED_DEFAULTS["dead_share"]) -> int:
    """Dead window in rows. A latent used uniformly fires every L/k rows (its period). With the run's length
    known: ``share`` of the run (a tenth by default: AuxK then has the other nine tenths to revive what died),
    at least 50 periods (a latent merely rarer than average is not dead) and at most 5000 periods and 10M rows
    (OpenAI's window). Unknown length: 5000 periods in [100k, 10M]."""
    period = latents / k
    if run_rows is None:
        return int(min(10_000_000, max(100_000, 5000 * period)))
    return int(min(10_000_000, 5000 * period, max(50 * period, run_rows * share)))


def eval_batch_count(cfg: TrainConfig) -> int:
    """How many batches at the start of the data a run holds out for its final evaluation (``eval_batches``; None
    outside a store, whose size :func:`fit_to_store` fits it to: :data:`DEFAULT_EVAL_BATCHES`)."""
    return DEFAULT_EVAL_BATCHES if cfg.eval_batches is None else cfg.eval_batches


def calibration_batch_count(cfg: TrainConfig) -> int:
    """How many batches after the ``eval_batches`` held-out ones a run sets aside to calibrate its threshold."""
    if not kind_spec(cfg.kind).calibrates(cfg.settings):
        return 0
    return DEFAULT_CALIBRATION_BATCHES if cfg.calibration_batches is None else cfg.calibration_batches


def with_heldout_defaults(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its held-out counts filled in for data without a known size (a model's forward)."""
    return replace(cfg, eval_batches=eval_batch_count(cfg), calibration_batches=(
        DEFAULT_CALIBRATION_BATCHES if cfg.calibration_batches is None else cfg.calibration_batches))


def heldout_batch_count(cfg: TrainConfig) -> int:
    """Batches at the start of the data that training never uses (evaluation + calibration); a multi-epoch
    stream must leave their rows out of later epochs (``stream_batches(holdout_batches=)``)."""
    return eval_batch_count(cfg) + calibration_batch_count(cfg)


def resolve_device(name: str) -> torch.device:
    """Turn ``auto`` into cuda when available, else cpu, and log why."""
    if name == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device %s (auto: CUDA %s)", dev, "available" if dev.type == "cuda" else "not available")
        return dev
    return torch.device(name)


@dataclass(frozen=True)
class Resolved:
    """The settings a run actually uses: TrainConfig's ``None`` defaults filled in from the dictionary's shape
    and the run's length. Checkpoints keep it (``asdict``) so a resumed run must resolve identically."""

    lr: float
    """Adam learning rate (``TrainConfig.lr`` or :func:`default_lr`)."""
    warmup_steps: int
    """Warm-up steps (``TrainConfig.warmup_steps`` or min(1000, 5 percent of the run), 100 without a length)."""
    dead_tokens: int
    """Rows without firing after which a latent is dead (``TrainConfig.dead_tokens`` or :func:`default_dead_tokens`)."""
    aux_k: int
    """Dead latents per row in the AuxK code (``TrainConfig.aux_k`` or min(S*D/2, L/2))."""
    aux_alpha: float
    """Weight of the AuxK loss (``TrainConfig.aux_alpha`` or the kind's default, :func:`kind_default`)."""
    code_l1: float
    """Weight of the selection kinds' L1 tie-break (``TrainConfig.code_l1`` or the kind's default)."""
    topk_steps: int
    """batchtopk, matryoshka, jumprelu: the first steps that select per row (``TrainConfig.topk_start`` of the run,
    or the kind's default share); 0 without a known run length."""
    threshold_start_step: int
    """First step of the BatchTopK threshold estimate (the kind's ``threshold_start_step`` or min(1000, 3/4 run))."""
    total_steps: int | None
    """Steps of the run; None when neither ``tokens`` nor the data's length says."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(cfg: TrainConfig, model: SparseCoder, total: int | None, batch_rows: int) -> Resolved:
    """Fill in the defaults of ``cfg`` for ``model`` and a run of ``total`` steps of ``batch_rows`` rows."""
    width = model.n_sources * model.d_in
    run_rows = cfg.tokens if cfg.tokens else (total * batch_rows if total else None)
    start = cfg.kind_settings.threshold_start_step if kind_spec(cfg.kind).estimates_threshold else None
    return Resolved(
        lr=cfg.lr if cfg.lr is not None else default_lr(cfg.latents),
        warmup_steps=cfg.warmup_steps if cfg.warmup_steps is not None else
        (min(1000, max(1, total // 20)) if total else 100),
        dead_tokens=cfg.dead_tokens if cfg.dead_tokens is not None else
        default_dead_tokens(cfg.latents, cfg.k, run_rows, kind_default(cfg, "dead_share")),
        aux_k=cfg.aux_k if cfg.aux_k is not None else max(1, min(width // 2, cfg.latents // 2)),
        aux_alpha=kind_default(cfg, "aux_alpha"),
        code_l1=kind_default(cfg, "code_l1"),
        topk_steps=round(kind_default(cfg, "topk_start") * total) if total else 0,
        threshold_start_step=start if start is not None else (min(1000, 3 * total // 4) if total else 1000),
        total_steps=total,
    )
