"""Training a `SparseCoder` on any iterable of activation batches.

Data flow of :func:`train`: hold out the first ``eval_batches`` batches -> (resume: load the checkpoint and
skip to its data position | fresh: estimate the normalisation scale and b_dec from the first rows) -> steps
(kind forward, FVU loss + sparsity / AuxK terms, decoder-gradient projection, clipping, Adam with warm-up and
linear decay, decoder renormalisation, dead-latent and threshold bookkeeping, logging, checkpoints) -> fold
the normalisation into the weights -> evaluate on the held-out batches -> save the artifact.

The held-out batches are only held out if the data never repeats their rows: a stream over several
epochs must leave them out of later epochs (``activations.stream_batches(..., holdout_batches=
eval_batches)``, as ``conceptdict train`` and ``conceptdict diff`` do).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import kernels
from .evaluate import evaluate
from .files import read_checkpoint, write_atomic
from .metrics import JsonlSink, MetricsSink, NullSink
from .model import KINDS, SparseCoder, geometric_median, kind_spec, normalisation_scale

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"

Batches = Iterable[Tensor] | Callable[[int], Iterable[Tensor]]
"""Training data: an iterable of [B, D] / [B, S, D] tensors, or a function start_batch -> such an iterable
that starts at that batch (lets ``resume`` skip without reading, e.g. ``stream_batches(start_batch=...)``)."""


@dataclass
class TrainConfig:
    """Settings of ``conceptdict train``; defaults measured on the synthetic benchmark (bench/synthetic_recovery.py)."""

    latents: int
    """Number of latents L in the dictionary."""
    k: int
    """Active latents per row (TopK), or on average per row (BatchTopK); must be below latents."""
    kind: str = "topk"
    """Dictionary kind: topk, batchtopk, relu (ReLU + L1 baseline), crosscoder (BatchTopK over several sources) or
    crosscoder-l1 (the classical L1 crosscoder; needs several sources)."""
    tokens: int | None = None
    """Stop after this many training rows; None: one pass over the data."""
    batch_size: int = 4096
    """Rows per step (used by the command line when it builds the data stream)."""
    lr: float | None = None
    """Adam learning rate; None: 1.6e-3 / sqrt(L / 4096), the literature's 1/sqrt(L) scaling (2e-4 / sqrt(L / 2^14),
    dictionary_learning / sparsify) with a 4x larger constant for short runs. bench/synthetic_recovery.py,
    2048 planted atoms in D=128, L=2048, k=8, 100 steps of 1024 rows, held-out FVU by lr: 5.7e-4 (literature)
    0.205, 1.13e-3 0.170, 2.26e-3 (this default) 0.170, 4.5e-3 0.179; all recover all the atoms."""
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
    aux_alpha: float = 1 / 32
    """Weight of the AuxK loss (OpenAI)."""
    dead_tokens: int | None = None
    """A latent is dead after this many rows (tokens) without firing, counted in rows, not steps;
    None: min(10M, max(100k, 5000 * L / k)) -- a latent used uniformly fires every L/k rows; OpenAI's 10M
    on long runs, a shorter window so that AuxK engages on short ones (SAELens counts steps and never does).
    With AuxK every bench/synthetic_recovery.py run ends with 0 dead latents; tests/test_train_sae.py
    revives 14 of 16 latents killed at init (1 of 16 without AuxK)."""
    l1_coeff: float = 0.4
    """relu and crosscoder-l1 kinds (for crosscoder-l1 it is the paper's lambda; bench/crosscoder_diff.py uses 1.5):
    weight of the L1 penalty sum_j f_j sum_s ||d_j^s||, divided by the batch's RMS norm of
    x - mean (so it does not depend on the scale of x). On the 256-atom recovery problem (k=6 for TopK):
    0.4 gives L0 12.8 at FVU 0.380, 0.1 gives L0 32.8 at FVU 0.119 (TopK: L0 6, FVU 0.061)."""
    threshold_start_step: int | None = None
    """BatchTopK: step from which the inference threshold is estimated; None: min(1000, 3/4 of the run)
    (dictionary_learning's 1000 on long runs; on the 76-step recovery test, inference L0 5.70 for k=6 when
    starting at 3/4 of the run, 5.05 when starting at half, as the cut falls while the dictionary learns)."""
    threshold_momentum: float = 0.999
    """BatchTopK: theta <- m * theta + (1 - m) * smallest kept activation of the batch."""
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
        kind_spec(self.kind)
        if self.latents < 1:
            raise ValueError(f"latents={self.latents} must be at least 1")
        if not 1 <= self.k < self.latents:
            raise ValueError(f"k={self.k} must be at least 1 and below latents={self.latents}; "
                             f"lower --k or raise --latents")
        for name in ("batch_size", "init_rows", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("eval_batches", "checkpoint_every", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens={self.tokens} must be at least 1 (or None for one pass)")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must lie in [0, 1]")
        if not 0 <= self.threshold_momentum < 1:
            raise ValueError(f"threshold_momentum={self.threshold_momentum} must lie in [0, 1)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}: use cpu, cuda, cuda:N or auto")


# -- resolved defaults ----------------------------------------------------------------------------

def default_lr(latents: int) -> float:
    """1.6e-3 / sqrt(L / 4096): the literature's 1/sqrt(L) scaling, 4x its constant (short-run tuning)."""
    return 1.6e-3 / math.sqrt(latents / 4096)


def default_dead_tokens(latents: int, k: int) -> int:
    """Dead window in rows: a latent used uniformly fires every L/k rows; 5000 such periods, in [100k, 10M]."""
    return int(min(10_000_000, max(100_000, 5 * latents / k * 1000)))


def resolve_device(name: str) -> torch.device:
    """Turn ``auto`` into cuda when available, else cpu, and log why."""
    if name == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device %s (auto: CUDA %s)", dev, "available" if dev.type == "cuda" else "not available")
        return dev
    return torch.device(name)


def make_optimizer(model: SparseCoder, lr: float) -> torch.optim.Adam:
    """Adam (betas 0.9, 0.999), fused: the unfused CPU Adam cost ~300 ms against ~80 ms fused per step for
    2.1M parameters in bench/train_step.py, several encoder matmuls' worth at D=768, L=16384.

    It steps each parameter in storage order (``_storage_order``): W_enc is a transposed view of
    latent-major storage, and the fused CPU Adam copies a non-contiguous tensor to a contiguous one and
    back (+45 ms per step at D=768, L=16384); Adam is elementwise, so stepping the contiguous alias is the
    same update. ``apply_update`` points the aliases' gradients at the parameters' before the step."""
    return torch.optim.Adam([_storage_order(p) for p in model.parameters()], lr=lr, betas=(0.9, 0.999), fused=True)


def _storage_order(p: Tensor) -> Tensor:
    """``p``, or for a transposed 2-D parameter a detached alias of its contiguous storage (same memory)."""
    if p.is_contiguous() or p.dim() != 2 or not p.t().is_contiguous():
        return p
    return p.detach().t()


def _link_grads(model: SparseCoder, opt: torch.optim.Optimizer) -> None:
    """Give the optimizer's storage-order aliases (``make_optimizer``) their parameters' gradients."""
    params = [q for group in opt.param_groups for q in group["params"]]
    for p, q in zip(model.parameters(), params):
        if q is not p:
            q.grad = None if p.grad is None else p.grad.t()


def lr_at(step: int, base: float, warmup: int, total: int | None, decay_fraction: float) -> float:
    """Linear warm-up over ``warmup`` steps, constant, then linear decay to 0 over the last fraction of ``total``."""
    factor = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if total:
        decay_steps = int(total * decay_fraction)
        start = total - decay_steps
        if decay_steps > 0 and step >= start:
            factor = min(factor, max(0.0, (total - step) / decay_steps))
    return base * factor


# -- data --------------------------------------------------------------------------------------

def _check_batch(x: Tensor, index: int, source: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"batch {index} from {source} is a {type(x).__name__}, not a torch.Tensor")
    if x.dim() not in (2, 3) or x.shape[0] == 0:
        raise ValueError(f"batch {index} from {source} has shape {list(x.shape)}; expected [B, D] or [B, S, D] "
                         f"with B > 0")
    # a finite float64 sum proves every entry finite (0.7 ms against 14 ms for the count at 4096 x 768)
    bad = 0 if bool(torch.isfinite(x.sum(dtype=torch.float64))) else int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(f"batch {index} from {source} holds {bad} NaN/inf values of {x.numel()}; "
                         f"fix or re-cache the activations (e.g. cache in float32)")
    return x.float()


def _seekable(batches: Batches) -> bool:
    """True for a function start_batch -> iterable (it can start anywhere without reading what it skips)."""
    return callable(batches) and not hasattr(batches, "__iter__")


def _open(batches: Batches, start: int) -> Iterator[Tensor]:
    """Iterator over the batches from batch ``start`` on (skipping by reading when the source cannot seek)."""
    if _seekable(batches):
        return iter(batches(start))
    return itertools.islice(iter(batches), start, None)


def _shape_of(x: Tensor) -> tuple[int, int]:
    """(S, D) of a batch [B, D] or [B, S, D]."""
    return (1, x.shape[1]) if x.dim() == 2 else (x.shape[1], x.shape[2])


# -- checkpoints -------------------------------------------------------------------------------

def _config_key(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the checkpoint (everything except logging/IO cadence)."""
    skip = {"checkpoint_every", "log_every", "device", "kernel_impl"}
    return {k: v for k, v in asdict(cfg).items() if k not in skip}


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic write (temporary name, fsync, rename) of a training state of tensors and plain values."""
    write_atomic(path, lambda fh: torch.save(state, fh))  # no .tmp survives a full disk


def load_checkpoint(path: Path) -> dict[str, Any]:
    return read_checkpoint(path)  # a truncated checkpoint.pt is named, not a traceback


@dataclass
class _State:
    """Mutable training state besides the model and optimizer (all of it goes into checkpoints)."""

    step: int = 0
    position: int = 0  # batches read from the start of the data, held-out ones included
    rows: int = 0  # training rows seen
    threshold_updates: int = 0
    scale: Tensor | None = None  # [S] normalisation factor
    since_fired: Tensor | None = None  # [L] int64 rows since each latent last fired


def _checkpoint_state(model: SparseCoder, opt: torch.optim.Optimizer, st: _State, cfg: TrainConfig,
                      gen: torch.Generator, resolved: dict[str, Any]) -> dict:
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "step": st.step, "position": st.position, "rows": st.rows, "threshold_updates": st.threshold_updates,
        "scale": st.scale, "since_fired": st.since_fired, "rng": gen.get_state(),
        "config": _config_key(cfg), "shape": [model.n_sources, model.d_in], "resolved": resolved,
    }


def _restore(ck: dict, model: SparseCoder, opt: torch.optim.Optimizer, cfg: TrainConfig, source: str) -> _State:
    if ck["config"] != _config_key(cfg):
        diff = {k: (ck["config"].get(k), v) for k, v in _config_key(cfg).items() if ck["config"].get(k) != v}
        raise ValueError(f"--resume with settings that differ from the checkpoint (checkpoint, now): {diff}; "
                         f"use the original settings or start a new run without --resume")
    if list(ck["shape"]) != [model.n_sources, model.d_in]:
        raise ValueError(f"checkpoint has (sources, d_in)={tuple(ck['shape'])} but {source} has "
                         f"{(model.n_sources, model.d_in)}; resume on the same store and hookpoint(s)")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    return _State(ck["step"], ck["position"], ck["rows"], ck["threshold_updates"], ck["scale"], ck["since_fired"])


# -- the steps ---------------------------------------------------------------------------------

def aux_loss(aux: "kernels.SparseCode", W_dec: Tensor, residual: Tensor, impl: str = "auto") -> Tensor:
    """AuxK (OpenAI): the dead latents' code ``aux`` [B, K'] reconstructs the detached residual e [B, F]
    through the decoder WITHOUT b_dec; returns ||e - e_hat||^2 / ||e - mean(e)||^2 (0 when K' = 0)."""
    if aux.values.shape[1] == 0:
        return residual.new_zeros(())
    zero_bias = torch.zeros(W_dec.shape[1], dtype=W_dec.dtype, device=W_dec.device)
    e_hat = kernels.sparse_decode(aux.values, aux.indices, W_dec, zero_bias, impl=impl, skip_zero_grads=True)
    denom = (residual - residual.mean(dim=0)).pow(2).sum().clamp_min(1e-12)
    return (residual - e_hat).pow(2).sum() / denom


def _init_from_sample(model: SparseCoder, sample: Tensor, cfg: TrainConfig) -> Tensor:
    """Normalisation scale [S] and b_dec from the first rows (flattened [N, S*D]); returns the scale."""
    S, D = model.n_sources, model.d_in
    scale = normalisation_scale(sample, S, D) if cfg.normalize else torch.ones(S)
    xs = sample * scale.repeat_interleave(D)
    with torch.no_grad():
        if cfg.b_dec_init == "geometric_median":
            model.b_dec.copy_(geometric_median(xs))
        elif cfg.b_dec_init == "mean":
            model.b_dec.copy_(xs.mean(dim=0))
    log.info("init: scale per source %s, b_dec=%s of %d rows", [round(float(c), 4) for c in scale],
             cfg.b_dec_init, sample.shape[0])
    return scale


def apply_update(model: SparseCoder, opt: torch.optim.Optimizer, loss: Tensor, lr: float, grad_clip: float,
                 reduce_grads: Callable[[SparseCoder], None] | None = None) -> None:
    """Backpropagate ``loss``, (sum the gradients over ranks), remove the decoder-gradient component parallel
    to each row, clip, take the Adam step at ``lr`` and renormalise the decoder rows."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    loss.backward()
    if reduce_grads is not None:
        reduce_grads(model)
    model.remove_parallel_decoder_grad()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    _link_grads(model, opt)
    opt.step()
    model.normalize_decoder()


def record_step(model: SparseCoder, st: _State, fired: Tensor, rows: int, smallest: Tensor | None,
                threshold_start: int, momentum: float) -> None:
    """After a step over ``rows`` rows: dead-latent counters (``fired`` bool [L]), the BatchTopK threshold
    estimate, and the step / row counts."""
    st.since_fired += rows
    st.since_fired[fired.cpu()] = 0
    if smallest is not None and st.step >= threshold_start:
        _update_threshold(model, float(smallest), momentum, st)
    st.step += 1
    st.rows += rows


def _setup(cfg: TrainConfig, first: Tensor, sample: list[Tensor], n_held: int, batches: Batches,
           ck: dict[str, Any] | None, device: torch.device, source: str):
    """(model, generator, total steps, resolved settings, optimizer, state) of a run, fresh or resumed from
    the checkpoint ``ck``: ``first`` (a batch) shapes the model, a fresh run initialises b_dec and the scale
    from the batches ``sample`` and starts after the ``n_held`` held-out batches."""
    model, gen = _build(cfg, first, device, source)
    total = math.ceil(cfg.tokens / first.shape[0]) if cfg.tokens else (
        len(batches) - n_held if hasattr(batches, "__len__") else None)
    r = _resolved(cfg, model, total)
    opt = make_optimizer(model, r["lr"])
    if ck is not None:
        st = _restore(ck, model, opt, cfg, source)
        gen.set_state(ck["rng"])
        if ck.get("resolved", r) != r:
            raise ValueError(f"--resume resolves the run differently from the checkpoint ({ck['resolved']} vs {r}); "
                             f"the data's length changed: pass the same tokens= as the first run")
    else:
        flat = torch.cat([model.flatten_input(x) for x in sample])[: cfg.init_rows]
        st = _State(position=n_held, scale=_init_from_sample(model, flat.to(device), cfg).cpu(),
                    since_fired=torch.zeros(cfg.latents, dtype=torch.int64))
    return model, gen, total, r, opt, st


def _step(model: SparseCoder, opt: torch.optim.Optimizer, x: Tensor, st: _State, cfg: TrainConfig,
          lr: float, dead_tokens: int, k_aux: int, threshold_start: int) -> dict[str, float]:
    """One optimisation step on a normalised flattened batch x [B, S*D]; returns its metrics."""
    spec = model.spec
    dead = st.since_fired >= dead_tokens
    use_aux = spec.uses_aux and bool(dead.any())
    out = spec.train_forward(model, x, l1_coeff=cfg.l1_coeff, dead=dead.to(x.device) if use_aux else None,
                             k_aux=k_aux)
    err = x - out.x_hat
    total_var = (x - x.mean(dim=0)).pow(2).sum().clamp_min(1e-12)
    fvu = err.pow(2).sum() / total_var
    loss = fvu
    aux = torch.zeros(())
    if out.aux is not None:
        aux = aux_loss(out.aux, model.W_dec, err.detach(), model.kernel_impl)
        loss = loss + cfg.aux_alpha * aux
    if out.sparsity_loss is not None:
        loss = loss + out.sparsity_loss
    apply_update(model, opt, loss, lr, cfg.grad_clip)
    record_step(model, st, out.fired, x.shape[0], out.smallest, threshold_start, cfg.threshold_momentum)
    return {"loss": float(loss.detach()), "fvu": float(fvu.detach()), "l0": float(out.l0), "aux": float(aux.detach()),
            "dead": float(dead.float().mean()), "lr": lr}


@torch.no_grad()
def _update_threshold(model: SparseCoder, smallest: float, momentum: float, st: _State) -> None:
    """theta <- m' * theta + (1 - m') * smallest with m' = min(m, n / (n + 1)) after n updates: the plain mean of
    the first 1 / (1 - m) estimates, then the exponential running estimate (short runs get a settled theta)."""
    n = st.threshold_updates
    m = min(momentum, n / (n + 1))
    model.threshold.mul_(m).add_((1 - m) * smallest)
    st.threshold_updates += 1


def _checked(it: Iterator[Tensor], start: int, source: str) -> Iterator[Tensor]:
    for i, x in enumerate(it, start):
        yield _check_batch(x, i, source)


def _take_rows(stream: Iterator[Tensor], rows: int) -> list[Tensor]:
    """Read batches until they hold at least ``rows`` rows (or the data ends)."""
    head, n = [], 0
    for x in stream:
        head.append(x)
        n += x.shape[0]
        if n >= rows:
            break
    return head


def _build(cfg: TrainConfig, first: Tensor, device: torch.device, source: str) -> tuple[SparseCoder, torch.Generator]:
    S, D = _shape_of(first)
    if cfg.d_in is not None and cfg.d_in != D:
        raise ValueError(f"config d_in={cfg.d_in} but {source} has D={D}; pick the matching store/hookpoint "
                         f"or drop --d-in")
    gen = torch.Generator().manual_seed(cfg.seed)
    model = SparseCoder(D, cfg.latents, cfg.k, cfg.kind, n_sources=S, kernel_impl=cfg.kernel_impl)
    model.reset_parameters(generator=gen)
    return model.to(device), gen


def _resolved(cfg: TrainConfig, model: SparseCoder, total: int | None) -> dict[str, Any]:
    width = model.n_sources * model.d_in
    return {
        "lr": cfg.lr if cfg.lr is not None else default_lr(cfg.latents),
        "warmup_steps": cfg.warmup_steps if cfg.warmup_steps is not None else
        (min(1000, max(1, total // 20)) if total else 100),
        "dead_tokens": cfg.dead_tokens if cfg.dead_tokens is not None else default_dead_tokens(cfg.latents, cfg.k),
        "aux_k": cfg.aux_k if cfg.aux_k is not None else max(1, min(width // 2, cfg.latents // 2)),
        "threshold_start_step": cfg.threshold_start_step if cfg.threshold_start_step is not None else
        (min(1000, 3 * total // 4) if total else 1000),
        "total_steps": total,
    }


def _log_line(st: _State, m: dict[str, float], tok_s: float) -> str:
    return (f"step {st.step} | fvu {m['fvu']:.4f} | l0 {m['l0']:.1f} | dead {100 * m['dead']:.2f}% | "
            f"tok/s {tok_s:,.0f}")


def train(cfg: TrainConfig, batches: Batches, *, out: str | Path | None = None, resume: bool = False,
          meta: dict[str, Any] | None = None, sink: MetricsSink | None = None,
          source: str = "the training batches") -> SparseCoder:
    """Train a dictionary on ``batches`` ([B, D] or [B, S, D] tensors); returns it in raw activation units.

    With ``out``: checkpoints (``checkpoint.pt``) and metrics (``metrics.jsonl``) go there and the final
    artifact is saved there (``meta`` is recorded in its config.json, e.g. store paths and hookpoints).
    ``resume=True`` continues from ``out/checkpoint.pt`` and ends with the same weights as an uninterrupted run.
    ``source`` names the data in error messages (e.g. "store runs/x, hookpoint blocks.0.hook_resid_post")."""
    device = resolve_device(cfg.device)
    out = Path(out) if out is not None else None
    if resume and out is None:
        raise ValueError("resume=True needs the output directory holding checkpoint.pt")
    ck = load_checkpoint(out / CHECKPOINT_FILE) if resume else None
    stream = _checked(_open(batches, 0), 0, source)
    held_out = list(itertools.islice(stream, cfg.eval_batches))
    if ck is not None:  # continue at the checkpoint's data position
        start = ck["position"]
        skipped = _open(batches, start) if _seekable(batches) else itertools.islice(stream, start - len(held_out), None)
        stream = _checked(skipped, start, source)
    head = _take_rows(stream, cfg.init_rows if ck is None else 1)
    if not head and not held_out:
        raise ValueError(f"{source} holds no rows: nothing to train on (is the store empty?)")
    if not head and ck is None:
        raise ValueError(f"{source} holds only {len(held_out)} batches, all held out for evaluation; "
                         f"lower eval_batches or add data")
    model, gen, total, r, opt, st = _setup(cfg, (head or held_out)[0], head, len(held_out), batches, ck, device,
                                           source)
    log.info("training %s on %s: resolved %s", model.extra_repr(), device, r)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    sink = sink or (JsonlSink(out / METRICS_FILE, keep_until_step=st.step if ck else None) if out else NullSink())
    scale_vec = st.scale.repeat_interleave(model.d_in).to(device)
    bar = tqdm(total=total, initial=st.step, unit="step", desc=f"train {cfg.kind}", disable=None)
    t_last, rows_last, last_x, m = time.perf_counter(), st.rows, None, None
    for x in itertools.chain(head, stream):
        if cfg.tokens is not None and st.rows >= cfg.tokens:
            break
        last_x = model.flatten_input(x.to(device)) * scale_vec
        lr = lr_at(st.step, r["lr"], r["warmup_steps"], total, cfg.decay_fraction)
        m = _step(model, opt, last_x, st, cfg, lr, r["dead_tokens"], r["aux_k"], r["threshold_start_step"])
        st.position += 1
        bar.update()
        if st.step % cfg.log_every == 0:
            now = time.perf_counter()
            tok_s = (st.rows - rows_last) / max(now - t_last, 1e-9)
            t_last, rows_last = now, st.rows
            log.info(_log_line(st, m, tok_s))
            sink.write({"step": st.step, "rows": st.rows, **m, "tok_s": tok_s})
        if out is not None and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
            save_checkpoint(out / CHECKPOINT_FILE, _checkpoint_state(model, opt, st, cfg, gen, r))
    bar.close()
    sink.close()
    if st.step == 0:
        raise ValueError(f"{source} yielded no training batches (after {len(held_out)} held-out ones)")
    if out is not None:
        save_checkpoint(out / CHECKPOINT_FILE, _checkpoint_state(model, opt, st, cfg, gen, r))
    if model.spec.uses_threshold and st.threshold_updates == 0 and last_x is not None:
        log.warning("run ended before threshold_start_step=%d; estimating the inference threshold from the "
                    "last batch only", r["threshold_start_step"])
        with torch.no_grad():
            _update_threshold(model, float(model.spec.train_forward(model, last_x, l1_coeff=cfg.l1_coeff).smallest),
                              0.0, st)
    return _finish(model, cfg, st, r, held_out, out, meta, m)


def _finish(model: SparseCoder, cfg: TrainConfig, st: _State, r: dict[str, Any], held_out: list[Tensor],
            out: Path | None, meta: dict[str, Any] | None, last: dict[str, float] | None) -> SparseCoder:
    """Fold the normalisation into the weights, evaluate on the held-out rows, save the artifact."""
    from .artifact import save_dictionary

    model.fold_input_scale(st.scale)
    model.eval()
    summary: dict[str, Any] = {
        "config": asdict(cfg), "resolved": r, "steps": st.step, "rows": st.rows,
        "threshold_updates": st.threshold_updates, "last_step": last,
        "normalisation": {"scale_per_source": [float(c) for c in st.scale], "folded_into_weights": True},
    }
    model.training_summary = summary  # before evaluating: kinds may read the folded scale from it (crosscoders)
    if held_out:
        result = evaluate(model, held_out)
        summary["heldout_eval"] = result.to_dict()
        log.info("held-out (%d rows): fvu %.4f | l0 %.2f (k=%d) | dead %.2f%%", result.n_tokens, result.fvu,
                 result.l0, model.k, 100 * result.dead_fraction)
    if out is not None:
        save_dictionary(model, out, extra=dict(meta or {}))
    return model
