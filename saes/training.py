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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor

from .adam import Adam
from .batches import (Batches, SharedReads, TrainingData, checked, geometric_median, normalisation_scale,
                      open_training_data, picked, seekable, shape_of)
from .calibration import calibrate_threshold, threshold_summary
from .checkpoint import TrainState, checkpoint_state, load_sharded, restore, resumed_config, save_sharded
from .comm import LOCAL, Comm, StepInputs, batch_stats, is_main
from .config import (Resolved, TrainConfig, calibration_batch_count, default_dead_tokens, default_lr,
                     eval_batch_count, heldout_batch_count, resolve, resolve_device, with_heldout_defaults)
from .precision import MATMUL_DTYPES, resolve_precision, run_precision, weight_dtype
from .evaluation import evaluate
from .flat import to_flat
from .metrics import JsonlSink, MetricsSink, NullSink, TeeSink, check_tracker, progress, tracker_sink
from .kinds import check_shards
from .loss import squared_error
from .model import SparseCoder, kind_spec
from . import during, stopping
from .update import aux_loss, apply_update, as_threshold, lr_at, make_optimizer, record_step, update_threshold

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"

__all__ = ["Batches", "Run", "TrainConfig", "aux_loss", "apply_update", "calibrate_threshold", "default_dead_tokens",
           "default_lr", "heldout_batch_count", "lr_at", "make_optimizer", "make_run", "record_step", "step", "train",
           "train_sweep", "update_threshold"]


class Run(NamedTuple):
    """What :func:`setup` builds for a run, fresh or resumed."""

    model: SparseCoder
    gen: torch.Generator
    """The initialisation generator (its state goes into checkpoints)."""
    opt: Adam
    state: TrainState
    resolved: Resolved
    settings: Any  # the kind's settings (TrainConfig.kind_settings), handed to its forward every step
    sparsity_warmup: int
    """Steps over which the kind's sparsity coefficient warms up (``KindSpec.sparsity_warmup``, else the lr's)."""
    momentum: float  # the running threshold estimate's (the kind's threshold_momentum; 0 for kinds without one)
    matmul_dtype: torch.dtype | None = None  # the encoder matmul's (TrainConfig.precision, auto resolved)


def make_run(cfg: TrainConfig, model: SparseCoder, gen: torch.Generator, opt: Adam, state: TrainState,
             resolved: Resolved) -> Run:
    """The :class:`Run` of ``cfg``: the kind's settings and what the steps read of them, resolved once."""
    spec, settings = model.spec, cfg.kind_settings
    warm = spec.sparsity_warmup(settings) if spec.sparsity_warmup is not None else None
    momentum = settings.threshold_momentum if spec.estimates_threshold else 0.0
    precision = resolve_precision(cfg.precision, model.device, spec.mixed_precision, cfg.kernel_impl)
    return Run(model, gen, opt, state, resolved, settings, warm if warm is not None else resolved.warmup_steps,
               momentum, MATMUL_DTYPES[precision])


# -- one step ---------------------------------------------------------------------------------------

def step(run: Run, x: Tensor, cfg: TrainConfig, lr: float, comm: Comm = LOCAL) -> dict[str, float]:
    """One optimisation step on this process's rows x [B_r, F] (normalised, flattened) of a batch; every
    process takes the same update, equal (up to float summation order) to one process stepping on the
    whole batch. Returns the whole batch's metrics."""
    model, st, r = run.model, run.state, run.resolved
    x, target = model.split(x)  # a transcoder reads the input half and reconstructs the output half
    stats = batch_stats(target, comm)
    dead = st.since_fired >= r.dead_tokens
    # latent shards: AuxK runs when any shard has a dead latent (every shard then takes part in its selection)
    use_aux = model.spec.uses_aux and bool(comm.shards.any(dead.any().reshape(1)))
    warm = run.sparsity_warmup
    inputs = StepInputs(stats=stats, comm=comm, dead=dead.to(x.device) if use_aux else None, k_aux=r.aux_k,
                        settings=run.settings, warmup=min(1.0, (st.step + 1) / warm) if warm > 0 else 1.0,
                        schedule=lr / r.lr if r.lr else 1.0, code_l1=r.code_l1, per_row=st.step < r.topk_steps,
                        matmul_dtype=run.matmul_dtype)
    out = model.spec.train_forward(model, x, inputs)
    sq, err = squared_error(target, out.x_hat)  # err: detached; the gradient into x_hat in one pass
    fvu = sq / stats.total_var
    loss = fvu
    aux = x.new_zeros(())
    if out.aux is not None:
        aux = aux_loss(out.aux, model, err, comm)
        loss = loss + r.aux_alpha * aux
    if out.sparsity_loss is not None:
        loss = loss + out.sparsity_loss
    apply_update(model, run.opt, loss, lr, cfg.grad_clip, comm)
    record_step(model, st, comm.any(out.fired), stats.rows, out.smallest, r.threshold_start_step, run.momentum)
    own = out.sparsity_loss.detach() if out.sparsity_loss is not None else x.new_zeros(())
    parts = comm.all_sum(torch.stack([loss.detach(), fvu.detach(), aux.detach().reshape(()),
                                      out.l0.float() * x.shape[0] / stats.rows, own, dead.sum()]).cpu().double())
    if comm.shards.size > 1:  # each shard's L0, penalty and dead latents are its latents' part
        more = comm.shards.all_sum(parts[3:])
        parts = torch.cat([(parts[0] - parts[4] + more[1]).reshape(1), parts[1:3], more])
    return {"loss": float(parts[0]), "fvu": float(parts[1]), "l0": float(parts[3]), "aux": float(parts[2]),
            "dead": float(parts[5] / comm.size / (dead.numel() * comm.shards.size)), "lr": lr}


# -- a run ------------------------------------------------------------------------------------------

def build_model(cfg: TrainConfig, first: Tensor, device: torch.device, source: str,
                shards: Comm = LOCAL) -> tuple[SparseCoder, torch.Generator]:
    """A freshly initialised dictionary shaped by the batch ``first`` and the generator that initialised it; with
    latent shards, this shard's latents of it (the rows of the whole dictionary's initialisation)."""
    S, D = shape_of(first)
    if cfg.d_in is not None and cfg.d_in != D:
        raise ValueError(f"config d_in={cfg.d_in} but {source} has D={D}; pick the matching store/hookpoint "
                         f"or drop --d-in")
    spec = kind_spec(cfg.kind)
    if spec.layered:
        if S < 2 or S % 2:
            raise ValueError(f"a {cfg.kind} needs each layer's MLP input and output, the inputs first; {source} "
                             f"gives {S} source(s): pass --hookpoint IN_0 .. IN_N --hookpoint OUT_0 .. OUT_N")
        S //= 2  # the layers (latent shards split each layer's latents: saes.latents)
        check_shards(cfg.kind, cfg.latents, cfg.k, shards.size, layers=S)
    elif spec.transcodes:
        if S != 2:
            raise ValueError(f"a {cfg.kind} needs two hookpoints, the component's input then its output; {source} "
                             f"gives {S} source(s): pass --hookpoint IN --hookpoint OUT")
        S = 1  # the weights are single-source: input D -> output D
    gen = torch.Generator().manual_seed(cfg.seed)
    model = SparseCoder(D, cfg.latents // shards.size, cfg.k, cfg.kind, n_sources=S, kernel_impl=cfg.kernel_impl,
                        dtype=weight_dtype(cfg.precision), init=False)  # drawn once, here:
    model.reset_parameters(generator=gen, shard=(shards.rank, shards.size))
    model.add_train_params()
    return model.to(device), gen


def _init_from_sample(model: SparseCoder, sample: Tensor, cfg: TrainConfig, comm: Comm) -> Tensor:
    """Normalisation scale [S] and b_dec from the first rows (flattened [N, S*D]); returns the scale."""
    S, D = model.data_sources, model.d_in
    scale = normalisation_scale(sample, S, D) if cfg.normalize else torch.ones(S)
    xs = model.split(sample * scale.repeat_interleave(D))[1]  # b_dec is the reconstruction target's
    with torch.no_grad():
        if cfg.b_dec_init == "geometric_median":
            model.b_dec.copy_(geometric_median(xs))
        elif cfg.b_dec_init == "mean":
            model.b_dec.copy_(xs.mean(dim=0))
        if model.spec.init is not None:
            model.spec.init(model, xs, comm)
    log.info("init: scale per source %s, b_dec=%s of %d rows", [round(float(c), 4) for c in scale],
             cfg.b_dec_init, sample.shape[0])
    return scale


def setup(cfg: TrainConfig, data: TrainingData, batches: Batches, ck: dict[str, Any] | None, device: torch.device,
          source: str, comm: Comm = LOCAL) -> Run:
    """The model, optimizer and state of a run, fresh or resumed from the checkpoint ``ck``: the first whole
    batch shapes the model; a fresh run initialises b_dec and the scale from the head's rows and starts
    after the held-out batches."""
    first = (data.whole_head or data.held_out or data.calibration)[0]
    model, gen = build_model(cfg, first, device, source, comm.shards)
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
        st = TrainState(position=n_held, scale=_init_from_sample(model, flat.to(device), cfg, comm).cpu(),
                        since_fired=torch.zeros(model.n_latents, dtype=torch.int64))
    return make_run(cfg, model, gen, opt, st, r)


@dataclass
class Job:
    """One dictionary of a run (a sweep trains several on the same batches): its settings, model and state,
    its data split, where it writes, and what the loop last saw."""

    cfg: TrainConfig
    run: Run
    data: TrainingData
    out: Path | None
    """Where this process writes (None on ranks > 0 and without an output directory)."""
    shard_out: Path | None
    """Where this process writes its latent shard of the checkpoint (the output directory on data rank 0)."""
    sink: MetricsSink
    name: str
    """How the logs name it (empty for a single dictionary)."""
    pick: int | list[int] | None = None
    """The source(s) of each [B, S, D] batch it trains on (None: the whole batch)."""
    last_x: Tensor | None = None
    metrics: dict[str, float] | None = None
    evaluator: during.Evaluator | None = None
    """What an evaluation every ``cfg.eval_every`` steps measures (saes.during)."""

    @property
    def done(self) -> bool:
        """Whether it has trained on its ``tokens`` rows."""
        st = self.run.state
        return (self.cfg.tokens is not None and st.rows >= self.cfg.tokens) or \
            (st.stop.end_step is not None and st.step >= st.stop.end_step)


def _open_job(cfg: TrainConfig, batches: Batches, out: Path | None, resume: bool, sink: MetricsSink | None,
              source: str, comm: Comm, name: str) -> Job:
    """Split the data for ``cfg`` (held-out, calibration, head), build or restore its model, open its sink."""
    cfg = with_heldout_defaults(cfg)  # a store's run has them sized already (saes.config.fit_to_store)
    check_tracker(cfg.log)
    device = resolve_device(cfg.device)
    if resume and out is None:
        raise ValueError("resume=True needs the output directory holding checkpoint.pt")
    if cfg.latent_shards != comm.shards.size:
        raise ValueError(f"latent_shards={cfg.latent_shards} but the seam holds {comm.shards.size} latent shard(s); "
                         f"train through saes.distributed.process_group_comm(latent_shards={cfg.latent_shards}) "
                         f"under torchrun, as `conceptdict train --latent-shards` does")
    ck = load_sharded(out, CHECKPOINT_FILE, comm.shards.rank, comm.shards.size) if resume else None
    cfg = cfg if ck is None else resumed_config(ck, cfg)
    cfg = replace(cfg, precision=run_precision(cfg.precision, device, kind_spec(cfg.kind).mixed_precision,
                                               cfg.kernel_impl, ck))
    data = open_training_data(batches, eval_batch_count(cfg), cfg.init_rows, None if ck is None else ck["position"],
                              source, comm, calibration_batch_count(cfg))
    run = setup(cfg, data, batches, ck, device, source, comm)
    writes = out if is_main(comm) else None
    if is_main(comm):
        where = (f" x {comm.size} processes" if comm.size > 1 else "") + (
            f", its latents in {comm.shards.size} shards" if comm.shards.size > 1 else "")
        log.info("training %s%s on %s%s: resolved %s", name and f"[{name}] ", run.model.extra_repr(), device, where,
                 run.resolved.to_dict())
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
    sink = sink or (JsonlSink(out / METRICS_FILE, keep_until_step=run.state.step if ck else None)
                    if writes is not None else NullSink())
    if cfg.log is not None and is_main(comm):
        sink = TeeSink(sink, tracker_sink(cfg.log, name or (out.name if out else ""), to_flat(cfg), out))
    return Job(cfg, run, data, writes, out if comm.rank == 0 else None, sink, name)


def train(cfg: TrainConfig, batches: Batches, *, out: str | Path | None = None, resume: bool = False,
          meta: dict[str, Any] | None = None, sink: MetricsSink | None = None,
          source: str = "the training batches", comm: Comm = LOCAL) -> SparseCoder:
    """Train a dictionary on ``batches`` ([B, D] or [B, S, D] tensors); returns it in raw activation units.

    With ``out``: checkpoints (``checkpoint.pt``) and metrics (``metrics.jsonl``) go there and the final
    artifact is saved there (``meta`` is recorded in its config.json, e.g. store paths and hookpoints).
    ``resume=True`` continues from ``out/checkpoint.pt`` and ends with the same weights as an uninterrupted run.
    ``source`` names the data in error messages (e.g. "store runs/x, hookpoint blocks.0.hook_resid_post").

    ``comm``: the seam to the other processes of a data-parallel job (``saes.distributed.TorchComm``); then
    ``batches`` yields THIS process's part of every batch (``activations.stream_batches(..., part=(rank, world))``),
    every process returns the same dictionary (one process's), only rank 0 writes ``out`` (on a filesystem every
    process reads to resume; a checkpoint resumes under any number of processes). With latent shards each process
    returns its shard's latents (saes.latents; ``out`` has the whole; ``saes.shards.gather_shards`` joins them)."""
    return train_sweep([cfg], batches, outs=[out], resume=resume, metas=[meta], sinks=[sink], source=source,
                       comm=comm)[0]


def train_sweep(cfgs: list[TrainConfig], batches: Batches, *, outs: list[str | Path | None],
                resume: bool = False, metas: list[dict[str, Any] | None] | None = None,
                sinks: list[MetricsSink | None] | None = None, names: list[str] | None = None,
                source: str = "the training batches", comm: Comm = LOCAL,
                picks: list[int | tuple[int, ...] | None] | None = None,
                evaluators: list[during.Evaluator | None] | None = None) -> list[SparseCoder]:
    """Train several dictionaries on ONE pass over ``batches``: every batch read is stepped by each dictionary
    whose next training batch it is, each with its own model, optimizer, schedule, checkpoint, metrics and
    artifact (``outs[i]``), so each ends bit for bit as :func:`train` alone on the same batches would end.

    Dictionaries may differ in anything that does not change the batches (kind, latents, k, lr, seed of the
    initialisation, ...). Those whose held-out count differs (a thresholded kind also holds out its
    ``calibration_batches``) start training at different batches of the same stream. All read through one
    ``SharedReads`` (each its held-out and first batches, then the loop), so every batch is made once (e.g. one
    forward); with several dictionaries ``batches`` must be a list or a function start_batch -> iterable.
    ``picks[i]``: dictionary i trains on source ``picks[i]`` of every [B, S, D] batch (several hookpoints of one
    forward feed one dictionary each; a tuple: those sources, e.g. one layer's MLP input and output for its
    transcoder); None: on the whole batch. ``evaluators[i]``: what dictionary i's evaluations every ``eval_every`` steps
    measure (``saes.during``; None: the held-out headline numbers)."""
    n = len(cfgs)
    if not n or len(outs) != n:
        raise ValueError(f"train_sweep needs one output per config; got {n} configs and {len(outs)} outputs")
    if n > 1 and not (seekable(batches) or isinstance(batches, (list, tuple))):
        raise ValueError("training several dictionaries on one pass needs data it can re-read: pass a list or "
                         "a function start_batch -> iterable (e.g. activations.stream_batches(start_batch=...))")
    outs_ = [Path(o) if o is not None else None for o in outs]
    picks = picks or [None] * n
    shared = SharedReads(batches) if n > 1 else batches  # each batch produced once, however many read it
    jobs = [_open_job(c, picked(shared, picks[i]), o, resume, (sinks or [None] * n)[i], source, comm,
                      (names or [""] * n)[i]) for i, (c, o) in enumerate(zip(cfgs, outs_))]
    first = min(j.run.state.position for j in jobs)
    data = (itertools.chain(jobs[0].data.head, jobs[0].data.rest) if n == 1  # the (picked) stream it opened
            else checked(shared.read_on(first), first, source))
    for job, p, e in zip(jobs, picks if n > 1 else [None] * n, evaluators or [None] * n):
        job.pick, job.evaluator = list(p) if isinstance(p, tuple) else p, during.checked(job.cfg, e)
    _loop(jobs, enumerate(data, first), comm)
    models = []
    for job, meta in zip(jobs, metas or [None] * n):
        run, cfg = job.run, job.cfg
        if run.state.step == 0:
            raise ValueError(f"{source} yielded no training batches (after {len(job.data.held_out)} held-out ones)")
        if cfg.checkpoint_every and run.state.step % cfg.checkpoint_every:  # 0: none; a multiple: written already
            _save(job, comm)
        _settle_threshold(cfg, run, job.last_x, comm)
        run.model.zero_grad(set_to_none=True)  # the weights from here on: the gradients and Adam state freed
        run = job.run = run._replace(opt=None)
        models.append(_finish(run, cfg, job.data, job.shard_out, meta, job.metrics, comm))
    comm.shards.barrier()  # every shard's files written before any process returns
    comm.barrier()
    return models


def _loop(jobs: list[Job], data: Iterator[tuple[int, Tensor]], comm: Comm) -> None:
    """The steps: each batch (with its data position) goes to every dictionary whose next batch it is; ends
    when every dictionary has its tokens or the data ends. Records each one's last normalised batch and metrics."""
    main = is_main(comm)
    total = max((j.run.resolved.total_steps or 0) for j in jobs) or None
    bar = progress(total, min(j.run.state.step for j in jobs), f"train {'+'.join(sorted({j.cfg.kind for j in jobs}))}",
                   log, enabled=main)
    clock = {id(j): (time.perf_counter(), j.run.state.rows) for j in jobs}
    for position, x in data:
        if all(j.done for j in jobs):
            break
        for job in jobs:
            if job.run.state.position == position and not job.done:
                _step_job(job, x if job.pick is None else x[:, job.pick], clock, comm)
        bar.update()
    bar.close()
    for job in jobs:
        if main and job.metrics is not None and job.run.state.step % job.cfg.log_every:
            _log_metrics(job, clock)  # the last step, so that metrics.jsonl is never empty
        job.sink.close()


def _step_job(job: Job, x: Tensor, clock: dict[int, tuple[float, int]], comm: Comm) -> None:
    """One step of one dictionary on batch x, then its logging and checkpoint."""
    cfg, run = job.cfg, job.run
    model, st, r, device = run.model, run.state, run.resolved, run.model.device
    dtype = model.dtype  # float32, or float64 under precision float64 (the store's rows are cast up exactly)
    job.last_x = model.flatten_batch(x.to(device, dtype)) * st.scale.repeat_interleave(model.d_in).to(device, dtype)
    at, length = stopping.schedule(st, r.total_steps)  # the rule's end, and the weights it went back to
    lr = lr_at(at, r.lr, r.warmup_steps, length, cfg.decay_fraction)
    job.metrics = m = step(run, job.last_x, cfg, lr, comm)
    if not math.isfinite(m["loss"]):
        kept = f"; the last checkpoint in {job.out} is kept" if job.out is not None and cfg.checkpoint_every else ""
        raise FloatingPointError(f"training diverged at step {st.step}: the loss is {m['loss']} (lr {lr:.3g}); lower "
                                 f"--lr, or check the data for NaN/Inf rows (`conceptdict store verify`){kept}")
    st.position += 1
    if stopping.due(cfg, st, r.total_steps):
        fvu = stopping.heldout_fvu(run, job.data.held_out, comm)
        if stopping.observe(cfg, st, fvu, r.total_steps, model, m["fvu"]) and is_main(comm):
            stopping.say_fired(cfg, st, fvu, r.total_steps, job.name)
    if st.step % cfg.log_every == 0 and is_main(comm):
        _log_metrics(job, clock)
    if during.due(cfg, st.step):  # its seconds left out of the next line's tok/s
        clock[id(job)] = (clock[id(job)][0] + during.evaluate_now(job, job.evaluator, comm), clock[id(job)][1])
    if cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
        _save(job, comm)


def _save(job: Job, comm: Comm) -> None:
    """Write the job's checkpoint: data rank 0 of every latent shard its shard (``checkpoint.save_sharded``)."""
    run = job.run
    if job.shard_out is not None:
        save_sharded(job.shard_out, CHECKPOINT_FILE, checkpoint_state(run.model, run.opt, run.state, job.cfg, run.gen,
                                                                      run.resolved), comm.shards)


def _log_metrics(job: Job, clock: dict[int, tuple[float, int]]) -> None:
    """Log the job's last step's metrics and write them to its sink."""
    st, now = job.run.state, time.perf_counter()
    then, rows = clock[id(job)]
    tok_s = (st.rows - rows) / max(now - then, 1e-9)
    clock[id(job)] = (now, st.rows)
    m = job.metrics
    log.info("%sstep %d | fvu %.4f | l0 %.1f | dead %.2f%% | tok/s %s", job.name and f"[{job.name}] ", st.step,
             m["fvu"], m["l0"], 100 * m["dead"], f"{tok_s:,.0f}")
    job.sink.write({"step": st.step, "rows": st.rows, **job.metrics, "tok_s": tok_s})


def _settle_threshold(cfg: TrainConfig, run: Run, last_x: Tensor | None, comm: Comm) -> None:
    """A threshold kind whose run ended before ``threshold_start_step`` estimates it from the last batch."""
    model, st = run.model, run.state
    if not model.spec.estimates_threshold or st.threshold_updates or last_x is None:
        return
    if is_main(comm):
        log.warning("run ended before threshold_start_step=%d; estimating the inference threshold from the "
                    "last batch only", run.resolved.threshold_start_step)
    with torch.no_grad():
        out = model.spec.train_forward(model, last_x, StepInputs(stats=batch_stats(last_x, comm), comm=comm,
                                                                  settings=run.settings))
        update_threshold(model, as_threshold(model, out.smallest), 0.0, st)


def _finish(run: Run, cfg: TrainConfig, data: TrainingData, out: Path | None, meta: dict[str, Any] | None,
            last: dict[str, float] | None, comm: Comm) -> SparseCoder:
    """Fold the normalisation into the weights, calibrate the threshold on the calibration rows, evaluate on
    the held-out rows, save the artifact (``out``: on data rank 0 of every latent shard). With latent shards each
    shard does all of it on its latents through the seam (saes.shards), never holding the whole dictionary."""
    from .shards import save_trained

    model, st, held_out = run.model, run.state, data.held_out
    during.to_inference(model, st.scale)
    summary: dict[str, Any] = {
        "config": to_flat(cfg, every_kind=True), "resolved": run.resolved.to_dict(), "steps": st.step, "rows": st.rows,
        "threshold_updates": st.threshold_updates, "last_step": last,
        "stopping": None if not cfg.stop_patience else {
            "patience": cfg.stop_patience, "threshold": cfg.stop_threshold, "upper_bound": run.resolved.total_steps,
            **st.stop.to_dict()},
        "normalisation": during.normalisation(st.scale),
    }
    model.training_summary = summary  # before calibrating and evaluating: crosscoders read the folded scale from it
    if model.spec.uses_threshold:
        summary["threshold"] = threshold_summary(model, data.calibration, comm)
    if held_out:
        result = evaluate(model, held_out, comm=comm)
        summary["heldout_eval"] = result.to_dict()
        summary["fit_gap"] = stopping.fit_gap((last or {}).get("fvu"), result.fvu, model.n_latents * comm.shards.size,
                                              warn=is_main(comm))  # fmt: skip
        log.info("held-out (%d rows): fvu %.4f | l0 %.2f (k=%d) | dead %.2f%%", result.n_tokens, result.fvu,
                 result.l0, model.k, 100 * result.dead_fraction)
    how = save_trained(model, out, dict(meta or {}), comm, cfg.single_file_gib)
    if how is not None and is_main(comm) and comm.shards.size > 1:
        log.info("saved the dictionary of %d latents in %s as %s", model.n_latents * comm.shards.size, out, how)
    return model
