"""Settings of a training run: :class:`TrainConfig` (what the user chooses) and :class:`Resolved` (what the
run uses after the defaults that depend on the dictionary and the data's length are filled in)."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

from .model import SparseCoder, kind_spec

log = logging.getLogger(__name__)

@dataclass
class TrainConfig:
    """Settings of ``conceptdict train``; defaults measured on the synthetic benchmark (bench/synthetic_recovery.py)."""

    latents: int
    """Number of latents L in the dictionary."""
    k: int
    """Active latents per row (TopK), or on average per row (BatchTopK); must be below latents."""
    kind: str = "topk"
    """Dictionary kind: topk, batchtopk (row-relative BatchTopK: the batch's top k*B entries ranked relative to
    each row's norm, see saes.model.row_scale), batchtopk-absolute (BatchTopK as published, Bussmann et al.
    2024), relu (ReLU + L1 baseline), jumprelu (learned per-latent thresholds, Rajamanoharan et al. 2024;
    jumprelu-relative: on the row-relative scale of batchtopk),
    matryoshka (Matryoshka BatchTopK, Bussmann et al. 2025: nested prefixes of the latents each reconstruct x),
    matryoshka-absolute (the same on the absolute BatchTopK rule), spade (sparsemax over distances to learned
    prototypes, Hindupur et al. 2025; its L0 adapts to the row, k only sizes its candidate search),
    crosscoder (BatchTopK over several sources) or crosscoder-l1 (the classical L1 crosscoder; needs several
    sources), transcoder / skip-transcoder (TopK from a component's input hookpoint to its output hookpoint, the
    skip one plus a linear x W_skip; two hookpoints: input, then output; saes/transcoder.py). Why batchtopk is
    row-relative: docs/batchtopk.md; the newer kinds: docs/kinds.md."""
    tokens: int | None = None
    """Stop after this many training rows; None (a store): one pass over its training rows, or more passes when one
    pass takes fewer than 2000 steps, up to 2000 steps and at most 100 passes (:func:`default_tokens`; one pass over
    a 200k-row store learns 5-7% of bench/cli_planted.py's planted atoms, ten passes 97%: docs/batchtopk.md, "The
    default batch size and run length")."""
    batch_size: int | None = None
    """Rows per step (used by the command line when it builds the data stream); None: :func:`default_batch_size`
    of the run's rows, 4096 (SAELens's default), halved down to 1024 while the run would take fewer than 2000 steps,
    so a run of 1-8M rows still takes about 2000 steps, and down to 256 while the store holds fewer than 64
    batches. Recovery of planted atoms follows the number of steps, not the rows (bench/cli_planted.py, 768 atoms,
    L = 1536, k = 8: 1M rows in batches of 4096, 244 steps, recover 37-41% of the atoms; the same rows in batches of
    1024, 976 steps, 86-87%): docs/batchtopk.md, "The default batch size and run length"."""
    lr: float | None = None
    """Adam learning rate; None: 1.6e-3 / sqrt(L / 4096), the literature's 1/sqrt(L) scaling (2e-4 / sqrt(L / 2^14),
    dictionary_learning / sparsify) with a 4x larger constant for short runs. Measured (2026-12-01, after the
    planted atoms stopped coinciding with the initial decoder, generators.synthetic.ATOM_SEED_OFFSET) on the test-sized
    planted problem (256 atoms in D=128, L=512, k=6, 116 steps of 1024 rows), recovery at cos 0.9 / held-out FVU:
    the literature's 1.13e-3: topk 0% / 0.487, batchtopk 0% / 0.495; this default 4.5e-3: 99.6% / 0.067, 97.3% /
    0.068; twice it: 100% / 0.055, 99.2% / 0.054 (more dead latents: 19% / 30%). The earlier figures behind this
    default came from the flawed benchmark and are void."""
    warmup_steps: int | None = None
    """Linear learning-rate warm-up steps; None: min(1000, 5 percent of the run) (dictionary_learning's 1000 steps,
    capped so short runs reach the full rate), or 100 when the run's length is unknown (no ``tokens`` and
    data without a length)."""
    decay_fraction: float = 0.2
    """Final fraction of the run over which the learning rate decays linearly to 0 (dictionary_learning)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    normalize: bool = True
    """Scale each source to mean norm sqrt(D) during training (Kissane et al.); folded back into the saved weights."""
    b_dec_init: Literal["geometric_median", "mean", "zero"] = "geometric_median"
    """Initial decoder bias: geometric median (OpenAI, dictionary_learning) or mean of the first rows, or zero."""
    init_rows: int = 8192
    """Rows from the start of the training data used for the normalisation scale and b_dec."""
    aux_k: int | None = None
    """Dead latents used by the AuxK loss per row; None: min(S*D/2, L/2) (dictionary_learning's d_in/2;
    OpenAI used 512)."""
    aux_alpha: float | None = None
    """Weight of the AuxK loss; None: the kind's default (:data:`KIND_DEFAULTS`): 1/4 for batchtopk, matryoshka
    and both jumprelu rules, OpenAI's 1/32 for every other kind."""
    dead_tokens: int | None = None
    """A latent is dead after this many rows (tokens) without firing, counted in rows, not steps;
    None: ``default_dead_tokens``: a share of the run (a tenth; a 64th for batchtopk, matryoshka and jumprelu,
    :data:`KIND_DEFAULTS`),
    at least 50 and at most 5000 firing periods (a latent used uniformly fires every L/k rows) and at most
    OpenAI's 10M, so AuxK engages on short and long runs alike (the former window, 5000 L/k rows, was longer
    than a whole 2M-row run at L/k = 256, and 20% of the latents ended dead). Without a known run length:
    min(10M, max(100k, 5000 L/k))."""
    l1_coeff: float = 0.4
    """relu and crosscoder-l1 kinds (for crosscoder-l1 it is the paper's lambda; bench/crosscoder_diff.py uses 1.5):
    weight of the L1 penalty sum_j f_j sum_s ||d_j^s||, divided by the batch's RMS norm of
    x - mean (so it does not depend on the scale of x). On the 256-atom recovery problem (k=6 for TopK):
    0.4 gives L0 12.8 at FVU 0.380, 0.1 gives L0 32.8 at FVU 0.119 (TopK: L0 6, FVU 0.061)."""
    code_l1: float | None = None
    """topk, batchtopk, matryoshka, jumprelu, jumprelu-relative, crosscoder (not the -absolute rules); None: the kind's
    default (:data:`KIND_DEFAULTS`), 0.15 for batchtopk, matryoshka and both jumprelu rules, 0.1 for topk and
    crosscoder. Weight of an L1 penalty on the kept codes (sum of the selected f_j over the batch / B, divided by the
    batch's RMS norm of x - mean: scale-free, like ``l1_coeff``), times the learning rate's schedule factor, so it is
    gone by the end of the run and leaves no shrinkage in the final codes; 0 trains them as published. The selection
    fixes the L0; the penalty breaks a tie that the reconstruction leaves open: two latents cos(t) a +- sin(t) u that
    co-fire on atom a reconstruct it equally well at every t, and a cut with room to spare keeps both halves
    (BatchTopK's global cut; TopK's per-row cut on every row that holds fewer than k atoms), so atoms stayed split
    between two latents at cosine ~0.85. Their summed codes are smallest at t = 0: the penalty turns them onto the atom.
    0.1 measured on bench/synthetic_recovery.py at its default size (4 settings x 2 seeds; 0.05 / 0.1 / 0.2 compared:
    0.2 costs FVU, 0.05 leaves atoms split) and --small, and on the sentence embeddings of three real corpora
    (bench/cbm_accuracy.py): docs/batchtopk.md, "The L1 tie-break" and "TopK gets the tie-break too". With batchtopk's
    TopK start, 0.15 recovers about as many planted atoms as TopK with few dead latents at a held-out FVU within 1.3% of
    0.1's on the real corpora (0.2: more atoms, but 1.7-3.7% FVU and more dead latents there): bench/real_heldout.py,
    docs/batchtopk.md "A tie-break of 0.15 for BatchTopK". jumprelu (absolute) at 0.1: +15-16 points of planted atoms on
    the heavy-tailed settings and 1-7% above TopK's FVU at the same L0 on the real corpora (15-23% without it); 0.3
    recovers more planted atoms there but costs 4 points and 55% FVU on plain rows and raises the dead latents on the
    real corpora (docs/kinds.md, "JumpReLU gets the tie-break"). Both jumprelu rules take 0.15 together with batchtopk's
    AuxK (docs/kinds.md, "JumpReLU with AuxK"; jumprelu-relative, --small, heavy and zipf-corr, 2 seeds): without AuxK
    0.15 recovered 1-3 points fewer planted atoms than 0.1 and left 36-38% of the latents dead; with AuxK it recovers
    5-9 points more than 0.1."""
    topk_start: float | None = None
    """batchtopk, matryoshka and jumprelu (both rules of each): the share of the run's steps that select per row
    (TopK, k per row) before the kind's own rule takes over; None: the kind's default (:data:`KIND_DEFAULTS`), 0.3
    for batchtopk, matryoshka and jumprelu, 0 for the absolute rules of the first two and for jumprelu-relative (no
    other kind reads it). Early in training the batch's cut spends the budget
    on the rows it already fits and splits atoms between pairs of latents, and an absolute threshold fires on the
    large rows only; a per-row start learns the atoms first. 0 trains them as published. Measured on
    bench/synthetic_recovery.py: batchtopk with its other defaults at the default size (docs/batchtopk.md,
    "BatchTopK starts as TopK"), jumprelu at --small (docs/kinds.md, "JumpReLU starts as TopK"). Needs the run's
    length (``tokens`` or a finite dataset); without it there is no TopK start."""
    l0_coeff: float = 1.0
    """jumprelu: weight of the L0 penalty, with the L0 counted by a straight-through estimator (Rajamanoharan
    et al. 2024). With ``jumprelu_penalty`` target: l0_coeff * (L0 / k - 1)^2, which holds the mean L0 near k;
    linear: l0_coeff * L0 / k (the paper's penalty, its L0 then follows the coefficient)."""
    jumprelu_penalty: Literal["target", "linear"] = "target"
    """jumprelu: the sparsity penalty, target (quadratic around L0 = k, so that the run is comparable with
    TopK at the same k; as dictionary_learning's target_l0) or linear (the paper's)."""
    jumprelu_bandwidth: float = 0.05
    """jumprelu: width epsilon of the rectangle kernel of the straight-through estimators, in training units
    (rows of mean norm sqrt(D)). The paper's 0.001 is for rows of unit mean squared norm and runs of 100k+
    steps; in these units that is ~0.01 and too few pre-activations fall in the window in short runs;
    0.05 measured on bench/synthetic_recovery.py (docs/kinds.md)."""
    sparsity_warmup_steps: int | None = None
    """jumprelu: steps over which the sparsity coefficient rises linearly from 0 (Gemma Scope warms it up);
    None: the learning rate's warm-up length."""
    matryoshka_groups: list[int] | None = None
    """matryoshka kinds: sizes of the nested groups of latents, in order, summing to ``latents``; prefix i (the
    first i groups) reconstructs x on its own and the losses are summed. None: prefixes L/16, L/8, L/4, L/2, L
    (groups L/16, L/16, L/8, L/4, L/2; Bussmann et al. 2025 used similar doubling groups)."""
    matryoshka_inner_weight: float = 0.03
    """matryoshka kinds: weight of the summed FVUs of the inner prefixes (every prefix but the whole dictionary,
    whose FVU has weight 1). Bussmann et al.'s and SAELens's loss is 1.0 (each prefix counts as much as the
    whole): there the narrow prefixes hedge (their latents blend atoms they cannot all hold) and recover 12
    points fewer planted atoms than BatchTopK on average. With BatchTopK's defaults (:data:`KIND_DEFAULTS`),
    0.03 recovers at least as many planted atoms as batchtopk on average over 2 seeds in each of the four
    settings of bench/synthetic_recovery.py --small at a lower or equal FVU, and 0.1 recovers 3-7 points fewer
    on the heavy-tailed ones; on the hierarchical setting, where the nested losses are meant to help, every
    weight below 1 leaves the parents' latents about as absorbed as batchtopk's (docs/kinds.md, "Matryoshka
    takes BatchTopK's defaults"). Under a budget as tight as the atoms per row (k = 3, one seed) the trade turns:
    0.3 recovers the most atoms and 1.0 halves the absorption, where 0.03 behaves like batchtopk; set 0.3-1.0 when
    absorption is the concern (docs/kinds.md, "The inner weight under a tight budget"). 1.0 reproduces the paper."""
    spade_coeff: float = 0.1
    """spade: weight of the distance-weighted L1 penalty sum_j f_j |x - p_j|^2 (the paper's code: 0.1), on the
    same scale as the FVU term (divided by the batch's mean squared distance to its mean)."""
    threshold_start_step: int | None = None
    """BatchTopK: step from which the inference threshold is estimated; None: min(1000, 3/4 of the run)
    (dictionary_learning's 1000 on long runs; on the 76-step recovery test, inference L0 5.70 for k=6 when
    starting at 3/4 of the run, 5.05 when starting at half, as the cut falls while the dictionary learns)."""
    threshold_momentum: float = 0.999
    """BatchTopK: theta <- m * theta + (1 - m) * smallest kept activation of the batch (the running estimate,
    replaced at the end by the calibrated one when ``calibration_batches`` > 0)."""
    calibration_batches: int = 2
    """Thresholded kinds (batchtopk, matryoshka, crosscoder, jumprelu with the target penalty): batches after the
    held-out ones, never trained on, on which the inference threshold is set at the end so that their mean L0 is
    k (the threshold is the (N k)-th largest score over their N rows; JumpReLU's learned thresholds are all
    multiplied by one factor, found the same way). The running estimate comes from training rows, which a
    dictionary fits better than unseen ones: the demo's sentence dictionary ran at L0 35 for k = 16 on unseen rows,
    and JumpReLU at 2-4.5x k on three small real corpora. 0: keep the running estimate (JumpReLU: the learned
    thresholds); other kinds hold none out."""
    eval_batches: int = 4
    """Batches from the start of the data held out of training and evaluated at the end (0: none); the
    command line's stream leaves their rows out of every later epoch."""
    seed: int = 0
    """Seed of the initialisation (the data order is the stream's own seed)."""
    checkpoint_every: int = 500
    """Write a resumable checkpoint every this many steps (0: only at the end); needs an output directory."""
    log_every: int = 100
    """Log a metrics line every this many steps."""
    kernel_impl: str = "auto"
    """Kernel implementation (saes.kernels): auto, reference or a registered fast one."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    d_in: int | None = None
    """Expected input width D per source; None: taken from the data."""

    def __post_init__(self) -> None:
        if not kind_spec(self.kind).trainable:
            raise ValueError(f"kind {self.kind!r} is imported for inference only; train another kind (--help lists them)")
        if self.latents < 1:
            raise ValueError(f"latents={self.latents} must be at least 1")
        if not 1 <= self.k < self.latents:
            raise ValueError(f"k={self.k} must be at least 1 and below latents={self.latents}; "
                             f"lower --k or raise --latents")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1 (or None for the default)")
        for name in ("init_rows", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("eval_batches", "calibration_batches", "checkpoint_every", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens={self.tokens} must be at least 1 (or None for the default, "
                             f"saes.config.default_tokens)")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must lie in [0, 1]")
        if not 0 <= self.threshold_momentum < 1:
            raise ValueError(f"threshold_momentum={self.threshold_momentum} must lie in [0, 1)")
        for name in ("aux_alpha", "code_l1"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 trains the kind as published; None "
                                 "for the kind's default)")
        if self.topk_start is not None and not 0 <= self.topk_start <= 1:
            raise ValueError(f"topk_start={self.topk_start} must lie in [0, 1] (or None for the kind's default)")
        if not self.jumprelu_bandwidth > 0:
            raise ValueError(f"jumprelu_bandwidth={self.jumprelu_bandwidth} must be positive")
        if not self.matryoshka_inner_weight >= 0:
            raise ValueError(f"matryoshka_inner_weight={self.matryoshka_inner_weight} must be >= 0 (1.0: the paper's)")
        if self.matryoshka_groups is not None and (any(g < 1 for g in self.matryoshka_groups)
                                                   or sum(self.matryoshka_groups) != self.latents):
            raise ValueError(f"matryoshka_groups={self.matryoshka_groups} must be positive sizes summing to "
                             f"latents={self.latents}; fix them or leave them unset for the default schedule")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}: use cpu, cuda, cuda:N or auto")


def sweep_configs(base: TrainConfig, grid: dict[str, list[Any]]) -> list[tuple[str, TrainConfig]]:
    """One config per combination of ``grid``'s values (field -> values; the cartesian product, first field
    outermost), each named ``field-value_field-value`` (its output folder). Every config is checked as
    :class:`TrainConfig` checks one, so a bad combination (k >= latents) names itself."""
    names = list(grid)
    out = []
    for values in itertools.product(*(grid[n] for n in names)):
        name = "_".join(f"{n}-{v}" for n, v in zip(names, values))
        try:
            out.append((name, replace(base, **dict(zip(names, values)))))
        except ValueError as e:
            raise ValueError(f"sweep point {name}: {e}") from None
    return out


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
    passes up to that many steps, at most :data:`MAX_PASSES` passes. Measured (docs/batchtopk.md, "The default batch
    size and run length"): ten passes over a 200k-row planted store recover nearly as many atoms as one pass over 2M
    fresh rows, and more passes over the small real corpora lower their held-out FVU."""
    return max(pass_rows, min(TARGET_STEPS * batch, MAX_PASSES * pass_rows))


def fit_to_store(cfg: TrainConfig, rows: int) -> TrainConfig:
    """``cfg`` for a store of ``rows`` rows: the default batch size filled in (:func:`default_batch_size` of
    ``tokens``, or of one pass over the store), the batch clamped to what the store holds beside its held-out
    batches, and ``tokens`` None filled in by :func:`default_tokens`. Raises ValueError for a store too small to
    train on, saying how many rows it needs."""
    held = heldout_batch_count(cfg)
    if cfg.batch_size is None:
        cfg = replace(cfg, batch_size=default_batch_size(cfg.tokens or rows, rows))
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
    if cfg.tokens is None:
        cfg = replace(cfg, tokens=default_tokens(one_pass_rows(cfg, rows), cfg.batch_size))
    return cfg


def default_lr(latents: int) -> float:
    """1.6e-3 / sqrt(L / 4096): the literature's 1/sqrt(L) scaling, 4x its constant (short-run tuning)."""
    return 1.6e-3 / math.sqrt(latents / 4096)


_BATCHTOPK_DEFAULTS = {"code_l1": 0.15, "aux_alpha": 0.25, "dead_share": 1 / 64, "topk_start": 0.3}

KIND_DEFAULTS: dict[str, dict[str, float]] = {
    "batchtopk": _BATCHTOPK_DEFAULTS,
    "matryoshka": _BATCHTOPK_DEFAULTS,
    "jumprelu": _BATCHTOPK_DEFAULTS,
    "jumprelu-relative": {**_BATCHTOPK_DEFAULTS, "topk_start": 0.0},
}
"""The defaults that differ by kind, for the :class:`TrainConfig` fields left None (``dead_share`` is the share of
the run :func:`default_dead_tokens` uses); a kind not listed takes :data:`GENERAL_DEFAULTS`. batchtopk's start, AuxK
weight and window were measured together on bench/synthetic_recovery.py at its default size (4 settings x 2 seeds)
and on the sentence embeddings of three real corpora (bench/cbm_accuracy.py): the TopK start learns the atoms before
the batch's cut takes over (lower FVU, more atoms), and the shorter window with the stronger AuxK revives the
latents the batch's cut starves (20-23% -> 5-10% dead on the heavy-tailed settings; neither alone does); on the real
corpora both are neutral (docs/batchtopk.md, "BatchTopK starts as TopK"). The same AuxK setting on topk raised its
dead latents (2.1% -> 8.8%, heavy, seed 0), so topk keeps OpenAI's. batchtopk's tie-break of 0.15 (0.1 before)
merges the split pairs its batch's cut leaves: more planted atoms and fewer dead latents on the heavy-tailed
settings, at a held-out FVU within 1.3% of 0.1's on the real corpora (bench/real_heldout.py; docs/batchtopk.md, "A
tie-break of 0.15 for BatchTopK"). jumprelu's TopK start (absolute thresholds: 0-1% -> 31-48% of the atoms on the
heavy-tailed settings, 85% -> 98% on plain rows) was measured on bench/synthetic_recovery.py --small, 4 settings x 2
seeds (docs/kinds.md, "JumpReLU starts as TopK"); jumprelu-relative keeps none (it lost 1-6 points with it on three
of the four settings). matryoshka is batchtopk with nested prefixes and takes all of batchtopk's defaults: with its
inner weight at 0.03 it then recovers at least as many planted atoms as batchtopk (docs/kinds.md, "Matryoshka takes
BatchTopK's defaults"); matryoshka-absolute, like batchtopk-absolute, trains as published. Both jumprelu rules take
batchtopk's AuxK weight, window and tie-break (their own dead-latent rule lowers a dead latent's threshold so that AuxK
can revive it, saes/jumprelu.py): on bench/synthetic_recovery.py --small (5 settings x 3 seeds) jumprelu-relative then
recovers 1.8-6.8 points more planted atoms than batchtopk on the four heavy-tailed and hierarchical settings, is level
on plain rows, and ends with 0-1.2% dead latents (27-34% before); jumprelu 3.7-10.8 points more than before on the
heavy-tailed settings (2 seeds) with at most 0.2% dead; on the three real corpora both stay at x0.99-1.02 of TopK's
held-out FVU at the same L0 (bench/real_heldout.py; docs/kinds.md, "JumpReLU with AuxK")."""

GENERAL_DEFAULTS: dict[str, float] = {"code_l1": 0.1, "aux_alpha": 1 / 32, "dead_share": 0.1, "topk_start": 0.0}
"""The defaults of the kinds :data:`KIND_DEFAULTS` does not list (where each comes from: the fields' docstrings)."""


def kind_default(cfg: TrainConfig, name: str) -> float:
    """``cfg.<name>`` when set, else the default of ``cfg.kind`` (:data:`KIND_DEFAULTS`, :data:`GENERAL_DEFAULTS`)."""
    value = getattr(cfg, name, None)
    if value is not None:
        return value
    return KIND_DEFAULTS.get(cfg.kind, {}).get(name, GENERAL_DEFAULTS[name])


def default_dead_tokens(latents: int, k: int, run_rows: int | None = None,
                        share: float = GENERAL_DEFAULTS["dead_share"]) -> int:
    """Dead window in rows. A latent used uniformly fires every L/k rows (its period). With the run's length
    known: ``share`` of the run (a tenth by default: AuxK then has the other nine tenths to revive what died),
    at least 50 periods (a latent merely rarer than average is not dead) and at most 5000 periods and 10M rows
    (OpenAI's window). Unknown length: 5000 periods in [100k, 10M]."""
    period = latents / k
    if run_rows is None:
        return int(min(10_000_000, max(100_000, 5000 * period)))
    return int(min(10_000_000, 5000 * period, max(50 * period, run_rows * share)))


def calibration_batch_count(cfg: TrainConfig) -> int:
    """How many batches after the ``eval_batches`` held-out ones a run sets aside to calibrate its threshold."""
    spec = kind_spec(cfg.kind)
    if spec.scores is None or (spec.scales_thresholds and cfg.jumprelu_penalty != "target"):
        return 0  # no threshold, or a JumpReLU whose L0 follows its penalty's coefficient rather than k
    return cfg.calibration_batches


def heldout_batch_count(cfg: TrainConfig) -> int:
    """Batches at the start of the data that training never uses (evaluation + calibration); a multi-epoch
    stream must leave their rows out of later epochs (``stream_batches(holdout_batches=)``)."""
    return cfg.eval_batches + calibration_batch_count(cfg)


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
    """First step of the BatchTopK threshold estimate (``TrainConfig.threshold_start_step`` or min(1000, 3/4 run))."""
    total_steps: int | None
    """Steps of the run; None when neither ``tokens`` nor the data's length says."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(cfg: TrainConfig, model: SparseCoder, total: int | None, batch_rows: int) -> Resolved:
    """Fill in the defaults of ``cfg`` for ``model`` and a run of ``total`` steps of ``batch_rows`` rows."""
    width = model.n_sources * model.d_in
    run_rows = cfg.tokens if cfg.tokens else (total * batch_rows if total else None)
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
        threshold_start_step=cfg.threshold_start_step if cfg.threshold_start_step is not None else
        (min(1000, 3 * total // 4) if total else 1000),
        total_steps=total,
    )
