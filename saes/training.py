"""Training a `SparseCoder` on any iterable of activation batches: ONE loop and ONE step for every kind, in
one process or many.

Data flow of :func:`train`: hold out the first ``eval_batches`` batches and the ``calibration_batches`` after
them (thresholded kinds) -> (resume: load the checkpoint and
skip to its data position | fresh: estimate the normalisation scale and b_dec from the first rows) -> steps
(batch statistics, kind forward, FVU loss + the kind's sparsity term + AuxK, decoder-gradient projection,
clipping, Adam with warm-up and linear decay, decoder renormalisation, dead-latent and threshold
bookkeeping, logging, checkpoints) -> fold the normalisation into the weights -> calibrate the inference
threshold on the calibration batches -> evaluate on the held-out batches -> save the artifact.

Other processes enter only through ``comm`` (saes.comm): the identity by default, ``saes.distributed.
TorchComm`` under torchrun, where every process reads its part of every batch and the step makes the
loss of one process out of the parts. Only the main process (rank 0) logs, checkpoints and saves.

The held-out batches are only held out if the data never repeats their rows: a stream over several
epochs must leave them out of later epochs (``activations.stream_batches(..., holdout_batches=
heldout_batch_count(cfg))``, as ``conceptdict train`` and ``conceptdict diff`` do).

Shapes: B batch rows (B_r this process's), F = S*D flattened width, L latents.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import kernels
from .batches import Batches, TrainingData, open_training_data, shape_of
from .checkpoint import TrainState, checkpoint_state, load_checkpoint, restore, save_checkpoint
from .comm import LOCAL, Comm, StepInputs, batch_stats, centred_sum_sq, is_main
from .config import (Resolved, TrainConfig, calibration_batch_count, default_dead_tokens, default_lr,
                     heldout_batch_count, resolve, resolve_device)
from .evaluation import evaluate
from .metrics import JsonlSink, MetricsSink, NullSink
from .model import SparseCoder, geometric_median, kind_spec, normalisation_scale

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"

__all__ = ["Batches", "TrainConfig", "calibrate_threshold", "default_dead_tokens", "default_lr", "heldout_batch_count",
           "make_optimizer", "train"]


class Run(NamedTuple):
    """What :func:`setup` builds for a run, fresh or resumed."""

    model: SparseCoder
    gen: torch.Generator
    """The initialisation generator (its state goes into checkpoints)."""
    opt: torch.optim.Optimizer
    state: TrainState
    resolved: Resolved


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


# -- one step ---------------------------------------------------------------------------------------

def aux_loss(aux: "kernels.SparseCode", W_dec: Tensor, residual: Tensor, impl: str = "auto",
             comm: Comm = LOCAL) -> Tensor:
    """AuxK (OpenAI): the dead latents' code ``aux`` [B_r, K'] reconstructs the detached residual e [B_r, F]
    through the decoder WITHOUT b_dec; returns this process's part of ||e - e_hat||^2 / ||e - mean(e)||^2
    (the denominator over the whole batch; 0 when K' = 0)."""
    if aux.values.shape[1] == 0:
        return residual.new_zeros(())
    zero_bias = torch.zeros(W_dec.shape[1], dtype=W_dec.dtype, device=W_dec.device)
    e_hat = kernels.sparse_decode(aux.values, aux.indices, W_dec, zero_bias, impl=impl, skip_zero_grads=True)
    _, denom = centred_sum_sq(residual, comm)
    return (residual - e_hat).pow(2).sum() / denom.clamp_min(1e-12)


def apply_update(model: SparseCoder, opt: torch.optim.Optimizer, loss: Tensor, lr: float, grad_clip: float,
                 comm: Comm = LOCAL) -> None:
    """Backpropagate ``loss``, sum the gradients over processes, remove the decoder-gradient component
    parallel to each row, clip, take the Adam step at ``lr`` and renormalise the decoder rows."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    loss.backward()
    comm.reduce_grads(model)
    model.remove_parallel_decoder_grad()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    _link_grads(model, opt)
    opt.step()
    model.normalize_decoder()


@torch.no_grad()
def update_threshold(model: SparseCoder, smallest: float, momentum: float, st: TrainState) -> None:
    """theta <- m' * theta + (1 - m') * smallest with m' = min(m, n / (n + 1)) after n updates: the plain mean of
    the first 1 / (1 - m) estimates, then the exponential running estimate (short runs get a settled theta)."""
    n = st.threshold_updates
    m = min(momentum, n / (n + 1))
    model.threshold.mul_(m).add_((1 - m) * smallest)
    st.threshold_updates += 1


def record_step(model: SparseCoder, st: TrainState, fired: Tensor, rows: int, smallest: Tensor | None,
                threshold_start: int, momentum: float) -> None:
    """After a step over ``rows`` rows: dead-latent counters (``fired`` bool [L]), the BatchTopK threshold
    estimate, and the step / row counts."""
    st.since_fired += rows
    st.since_fired[fired.cpu()] = 0
    if smallest is not None and st.step >= threshold_start:
        update_threshold(model, float(smallest), momentum, st)
    st.step += 1
    st.rows += rows


def step(run: Run, x: Tensor, cfg: TrainConfig, lr: float, comm: Comm = LOCAL) -> dict[str, float]:
    """One optimisation step on this process's rows x [B_r, F] (normalised, flattened) of a batch; every
    process takes the same update, equal (up to float summation order) to one process stepping on the
    whole batch. Returns the whole batch's metrics."""
    model, st, r = run.model, run.state, run.resolved
    x, target = model.split(x)  # a transcoder reads the input half and reconstructs the output half
    stats = batch_stats(target, comm)
    dead = st.since_fired >= r.dead_tokens
    use_aux = model.spec.uses_aux and bool(dead.any())
    inputs = StepInputs(stats, comm, cfg.l1_coeff, dead.to(x.device) if use_aux else None, r.aux_k)
    out = model.spec.train_forward(model, x, inputs)
    err = target - out.x_hat
    fvu = err.pow(2).sum() / stats.total_var
    loss = fvu
    aux = x.new_zeros(())
    if out.aux is not None:
        aux = aux_loss(out.aux, model.W_dec, err.detach(), model.kernel_impl, comm)
        loss = loss + cfg.aux_alpha * aux
    if out.sparsity_loss is not None:
        loss = loss + out.sparsity_loss
    apply_update(model, run.opt, loss, lr, cfg.grad_clip, comm)
    record_step(model, st, comm.any(out.fired), stats.rows, out.smallest, r.threshold_start_step,
                cfg.threshold_momentum)
    parts = comm.all_sum(torch.stack([loss.detach(), fvu.detach(), aux.detach().reshape(()),
                                      out.l0.float() * x.shape[0] / stats.rows]).cpu().double())
    return {"loss": float(parts[0]), "fvu": float(parts[1]), "l0": float(parts[3]), "aux": float(parts[2]),
            "dead": float(dead.float().mean()), "lr": lr}


# -- a run ------------------------------------------------------------------------------------------

def build_model(cfg: TrainConfig, first: Tensor, device: torch.device,
                source: str) -> tuple[SparseCoder, torch.Generator]:
    """A freshly initialised dictionary shaped by the batch ``first`` and the generator that initialised it."""
    S, D = shape_of(first)
    if cfg.d_in is not None and cfg.d_in != D:
        raise ValueError(f"config d_in={cfg.d_in} but {source} has D={D}; pick the matching store/hookpoint "
                         f"or drop --d-in")
    if kind_spec(cfg.kind).transcodes:
        if S != 2:
            raise ValueError(f"a {cfg.kind} needs two hookpoints, the component's input then its output; {source} "
                             f"gives {S} source(s): pass --hookpoint IN --hookpoint OUT")
        S = 1  # the weights are single-source: input D -> output D
    gen = torch.Generator().manual_seed(cfg.seed)
    model = SparseCoder(D, cfg.latents, cfg.k, cfg.kind, n_sources=S, kernel_impl=cfg.kernel_impl)
    model.reset_parameters(generator=gen)
    return model.to(device), gen


def _init_from_sample(model: SparseCoder, sample: Tensor, cfg: TrainConfig) -> Tensor:
    """Normalisation scale [S] and b_dec from the first rows (flattened [N, S*D]); returns the scale."""
    S, D = model.data_sources, model.d_in
    scale = normalisation_scale(sample, S, D) if cfg.normalize else torch.ones(S)
    xs = model.split(sample * scale.repeat_interleave(D))[1]  # b_dec is the reconstruction target's
    with torch.no_grad():
        if cfg.b_dec_init == "geometric_median":
            model.b_dec.copy_(geometric_median(xs))
        elif cfg.b_dec_init == "mean":
            model.b_dec.copy_(xs.mean(dim=0))
    log.info("init: scale per source %s, b_dec=%s of %d rows", [round(float(c), 4) for c in scale],
             cfg.b_dec_init, sample.shape[0])
    return scale


def setup(cfg: TrainConfig, data: TrainingData, batches: Batches, ck: dict[str, Any] | None, device: torch.device,
          source: str) -> Run:
    """The model, optimizer and state of a run, fresh or resumed from the checkpoint ``ck``: the first whole
    batch shapes the model; a fresh run initialises b_dec and the scale from the head's rows and starts
    after the held-out batches."""
    first = (data.whole_head or data.held_out or data.calibration)[0]
    model, gen = build_model(cfg, first, device, source)
    n_held = len(data.held_out) + len(data.calibration)
    total = math.ceil(cfg.tokens / first.shape[0]) if cfg.tokens else (
        len(batches) - n_held if hasattr(batches, "__len__") else None)
    r = resolve(cfg, model, total, first.shape[0])
    opt = make_optimizer(model, r.lr)
    if ck is not None:
        st = restore(ck, model, opt, cfg, source)
        gen.set_state(ck["rng"])
        if ck.get("resolved", r.to_dict()) != r.to_dict():
            raise ValueError(f"--resume resolves the run differently from the checkpoint ({ck['resolved']} vs "
                             f"{r.to_dict()}); the data's length changed: pass the same tokens= as the first run")
    else:
        flat = torch.cat([model.flatten_batch(x) for x in data.whole_head])[: cfg.init_rows]
        st = TrainState(position=n_held, scale=_init_from_sample(model, flat.to(device), cfg).cpu(),
                        since_fired=torch.zeros(cfg.latents, dtype=torch.int64))
    return Run(model, gen, opt, st, r)


def _log_line(st: TrainState, m: dict[str, float], tok_s: float) -> str:
    return (f"step {st.step} | fvu {m['fvu']:.4f} | l0 {m['l0']:.1f} | dead {100 * m['dead']:.2f}% | "
            f"tok/s {tok_s:,.0f}")


def train(cfg: TrainConfig, batches: Batches, *, out: str | Path | None = None, resume: bool = False,
          meta: dict[str, Any] | None = None, sink: MetricsSink | None = None,
          source: str = "the training batches", comm: Comm = LOCAL) -> SparseCoder:
    """Train a dictionary on ``batches`` ([B, D] or [B, S, D] tensors); returns it in raw activation units.

    With ``out``: checkpoints (``checkpoint.pt``) and metrics (``metrics.jsonl``) go there and the final
    artifact is saved there (``meta`` is recorded in its config.json, e.g. store paths and hookpoints).
    ``resume=True`` continues from ``out/checkpoint.pt`` and ends with the same weights as an uninterrupted run.
    ``source`` names the data in error messages (e.g. "store runs/x, hookpoint blocks.0.hook_resid_post").

    ``comm``: the seam to the other processes of a data-parallel job (``saes.distributed.TorchComm``); then
    ``batches`` yields THIS process's part of every batch (``activations.stream_batches(..., part=(rank,
    world_size))``), every process returns the same dictionary (equal to one process's), only rank 0 writes
    ``out``, which must be on a filesystem every process reads when resuming. A checkpoint resumes under any
    number of processes."""
    device = resolve_device(cfg.device)
    out = Path(out) if out is not None else None
    if resume and out is None:
        raise ValueError("resume=True needs the output directory holding checkpoint.pt")
    ck = load_checkpoint(out / CHECKPOINT_FILE) if resume else None
    data = open_training_data(batches, cfg.eval_batches, cfg.init_rows, None if ck is None else ck["position"],
                              source, comm, calibration_batch_count(cfg))
    run = setup(cfg, data, batches, ck, device, source)
    main = is_main(comm)
    writes = out if main else None
    if main:
        log.info("training %s on %s%s: resolved %s", run.model.extra_repr(), device,
                 f" x {comm.size} processes" if comm.size > 1 else "", run.resolved.to_dict())
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
    sink = sink or (JsonlSink(out / METRICS_FILE, keep_until_step=run.state.step if ck else None)
                    if writes is not None else NullSink())
    last_x, m = _loop(cfg, run, itertools.chain(data.head, data.rest), writes, sink, device, comm)
    if run.state.step == 0:
        raise ValueError(f"{source} yielded no training batches (after {len(data.held_out)} held-out ones)")
    if writes is not None:
        save_checkpoint(out / CHECKPOINT_FILE, checkpoint_state(run.model, run.opt, run.state, cfg, run.gen,
                                                                run.resolved))
    _settle_threshold(cfg, run, last_x, comm)
    model = _finish(run, cfg, data, writes, meta, m)
    comm.barrier()
    return model


def _loop(cfg: TrainConfig, run: Run, data: Iterator[Tensor], out: Path | None, sink: MetricsSink,
          device: torch.device, comm: Comm) -> tuple[Tensor | None, dict[str, float] | None]:
    """The steps; returns (the last normalised batch part, the last step's metrics). ``out``: where the main
    process checkpoints (None elsewhere)."""
    model, st, r = run.model, run.state, run.resolved
    main = is_main(comm)
    scale_vec = st.scale.repeat_interleave(model.d_in).to(device)
    bar = tqdm(total=r.total_steps, initial=st.step, unit="step", desc=f"train {cfg.kind}",
               disable=None if main else True)
    t_last, rows_last, last_x, m = time.perf_counter(), st.rows, None, None
    for x in data:
        if cfg.tokens is not None and st.rows >= cfg.tokens:
            break
        last_x = model.flatten_batch(x.to(device)) * scale_vec
        lr = lr_at(st.step, r.lr, r.warmup_steps, r.total_steps, cfg.decay_fraction)
        m = step(run, last_x, cfg, lr, comm)
        st.position += 1
        bar.update()
        if st.step % cfg.log_every == 0 and main:
            now = time.perf_counter()
            tok_s = (st.rows - rows_last) / max(now - t_last, 1e-9)
            t_last, rows_last = now, st.rows
            log.info(_log_line(st, m, tok_s))
            sink.write({"step": st.step, "rows": st.rows, **m, "tok_s": tok_s})
        if out is not None and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
            save_checkpoint(out / CHECKPOINT_FILE, checkpoint_state(model, run.opt, st, cfg, run.gen, r))
    bar.close()
    sink.close()
    return last_x, m


def _settle_threshold(cfg: TrainConfig, run: Run, last_x: Tensor | None, comm: Comm) -> None:
    """A threshold kind whose run ended before ``threshold_start_step`` estimates it from the last batch."""
    model, st = run.model, run.state
    if not model.spec.uses_threshold or st.threshold_updates or last_x is None:
        return
    if is_main(comm):
        log.warning("run ended before threshold_start_step=%d; estimating the inference threshold from the "
                    "last batch only", run.resolved.threshold_start_step)
    with torch.no_grad():
        out = model.spec.train_forward(model, last_x, StepInputs(batch_stats(last_x, comm), comm, cfg.l1_coeff))
        update_threshold(model, float(out.smallest), 0.0, st)


@torch.no_grad()
def calibrate_threshold(model: SparseCoder, batches: list[Tensor], chunk: int = 1024) -> tuple[float, int]:
    """Set the inference threshold of a thresholded kind so that the mean L0 over the rows of ``batches``
    ([B, D] / [B, S, D], in the model's input units) is its k: theta = the (N k)-th largest of the kind's
    scores (``KindSpec.scores``) over the N rows, i.e. BatchTopK over the whole set. Returns (theta, N)."""
    spec = model.spec
    if spec.scores is None:
        raise ValueError(f"kind {model.kind!r} has no threshold to calibrate")
    rows = [model.flatten_input(x.to(model.W_dec.device).float()) for x in batches]
    n = sum(x.shape[0] for x in rows)
    keep = max(1, int(round(n * model.k)))
    top = model.W_dec.new_empty(0)
    for x in rows:
        for part in x.split(chunk):
            scores = spec.scores(model, part).flatten()
            top = torch.cat([top, scores[scores > 0]])
            if top.numel() > keep:
                top = top.topk(keep, sorted=False).values
    theta = float(top.min()) if top.numel() >= keep else 0.0
    # inference keeps scores strictly above theta: step just below the (N k)-th score so that it is kept too
    theta = float(torch.nextafter(torch.tensor(theta), torch.tensor(-math.inf))) if theta > 0 else 0.0
    model.threshold.fill_(theta)
    return theta, n


def _threshold_summary(model: SparseCoder, calibration: list[Tensor]) -> dict[str, Any]:
    """Calibrate the threshold on the calibration rows when there are any; say which estimate the model keeps."""
    running = float(model.threshold[0])
    if not calibration:
        return {"value": running, "running_estimate": running, "calibrated_on_rows": 0,
                "rule": "running estimate from training batches"}
    theta, n = calibrate_threshold(model, calibration)
    log.info("inference threshold %.6g calibrated on %d unseen rows (running estimate %.6g)", theta, n, running)
    return {"value": theta, "running_estimate": running, "calibrated_on_rows": n,
            "rule": "mean L0 = k on rows never trained on"}


def _finish(run: Run, cfg: TrainConfig, data: TrainingData, out: Path | None, meta: dict[str, Any] | None,
            last: dict[str, float] | None) -> SparseCoder:
    """Fold the normalisation into the weights, calibrate the threshold on the calibration rows, evaluate on
    the held-out rows, save the artifact."""
    from .artifact import save_dictionary

    model, st, held_out = run.model, run.state, data.held_out
    model.fold_input_scale(st.scale)
    model.eval()
    summary: dict[str, Any] = {
        "config": asdict(cfg), "resolved": run.resolved.to_dict(), "steps": st.step, "rows": st.rows,
        "threshold_updates": st.threshold_updates, "last_step": last,
        "normalisation": {"scale_per_source": [float(c) for c in st.scale], "folded_into_weights": True},
    }
    model.training_summary = summary  # before calibrating and evaluating: crosscoders read the folded scale from it
    if model.spec.uses_threshold:
        summary["threshold"] = _threshold_summary(model, data.calibration)
    if held_out:
        result = evaluate(model, held_out)
        summary["heldout_eval"] = result.to_dict()
        log.info("held-out (%d rows): fvu %.4f | l0 %.2f (k=%d) | dead %.2f%%", result.n_tokens, result.fvu,
                 result.l0, model.k, 100 * result.dead_fraction)
    if out is not None:
        save_dictionary(model, out, extra=dict(meta or {}))
    return model
