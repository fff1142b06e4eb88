"""Data-parallel training over ``torch.distributed``: the same dictionary as one process, from N.

Under ``torchrun --nproc_per_node=N`` every rank holds a full copy of the dictionary and reads its own
contiguous slice of every GLOBAL batch (``conceptdict.activations.distributed.rank_batches``), so
``--batch-size`` is the global batch and ``--tokens`` / ``--seed`` mean what they mean in one process.
Each step makes the loss of one process out of per-rank parts:

- batch statistics are global: the FVU denominator sum |x - mean(x)|^2, the AuxK denominator, the row count
  behind the dead-latent counter, the ReLU/L1 penalty's normalisers (one small all-reduce each);
- BatchTopK (and the BatchTopK crosscoder) selects over the GLOBAL batch: each rank keeps its local top
  ``k * B`` candidates (a superset of its share of the global selection), the candidates' scores are
  all-gathered, and the ``k * B``-th largest is the cut every rank applies. The inference threshold is
  updated from the global smallest kept activation, so it is the one single-process training learns;
- each rank back-propagates its part of that global loss and the gradients are summed by an explicit
  all-reduce (one per parameter; ``all_reduce_grads``), after which every rank takes the same Adam step;
- the dead-latent "fired" masks are OR-reduced, the logged metrics are global.

The training state is therefore independent of the number of ranks: checkpoints (written by rank 0 only)
resume under any number of ranks, or in one process. Only rank 0 logs, shows progress and writes files.

How a kind's training pass splits across ranks is a row of :data:`DP_RULES`: ``rows`` (every row is
independent: TopK), ``batch`` (global BatchTopK, with the kind's ranking weight), ``penalty`` (a row-local
pass plus a penalty normalised by a batch statistic, re-weighted to the global one).

Shapes: B global batch rows, B_r this rank's rows, D width per source, S sources, L latents.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from . import kernels
from .crosscoder import source_norm_sum, training_decoder
from .metrics import JsonlSink, MetricsSink, NullSink
from .model import SparseCoder, TrainOutput

# the training module (the package re-exports its ``train`` function under the same name)
tr = importlib.import_module(".train", __package__)

log = logging.getLogger(__name__)


# -- ranks -------------------------------------------------------------------------------------

class World(NamedTuple):
    """This process's place in the job."""

    rank: int
    size: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def world() -> World:
    """(rank, world size) of the initialised default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World(0, 1)


def init_from_env(backend: str | None = None) -> World:
    """Join the job torchrun describes (``WORLD_SIZE`` > 1 in the environment); a no-op otherwise. Ranks
    other than 0 are then :func:`quiet` (logging and progress bars come from rank 0 only).

    ``backend``: nccl or gloo; None picks nccl when CUDA is available, else gloo (and logs why)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return world()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        log.info("torch.distributed backend %s (CUDA %s)", backend,
                 "available" if backend == "nccl" else "not available")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    w = world()
    if not w.main:
        quiet()
    return w


def quiet() -> None:
    """Silence this rank: conceptdict logs at WARNING and up only, tqdm bars off (TQDM_DISABLE)."""
    logging.getLogger("conceptdict").setLevel(logging.WARNING)
    os.environ["TQDM_DISABLE"] = "1"


def device_for(name: str) -> str:
    """The training device of this rank: ``cuda`` / ``auto`` become ``cuda:LOCAL_RANK`` in a GPU job."""
    if world().size > 1 and torch.cuda.is_available() and name in ("auto", "cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return name


def _comm_device(t: Tensor) -> Tensor:
    """gloo reduces CPU tensors, nccl CUDA ones: move ``t`` where the backend wants it."""
    if dist.get_backend() == "nccl":
        return t.cuda()
    return t.cpu()


def _all_reduce(t: Tensor, op: "dist.ReduceOp.RedOpType") -> Tensor:
    """``op`` of ``t`` over ranks (a new tensor on t's device; ``t`` itself without a process group)."""
    if world().size == 1:
        return t
    buf = _comm_device(t.detach().clone())
    dist.all_reduce(buf, op=op)
    return buf.to(t.device)


def all_sum(t: Tensor) -> Tensor:
    """Sum of ``t`` over ranks."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_min(t: Tensor) -> Tensor:
    """Elementwise minimum of ``t`` over ranks."""
    return _all_reduce(t, dist.ReduceOp.MIN)


def any_rank(mask: Tensor) -> Tensor:
    """Elementwise OR of a bool tensor over ranks (e.g. the latents that fired anywhere in the batch)."""
    return _all_reduce(mask.to(torch.uint8), dist.ReduceOp.MAX).bool() if world().size > 1 else mask


def gather_rows(x: Tensor) -> Tensor:
    """Concatenate every rank's rows of x [B_r, ...] in rank order -> [sum B_r, ...] on every rank."""
    w = world()
    if w.size == 1:
        return x
    counts = all_gather_sizes(x.shape[0])
    width = max(counts)
    buf = _comm_device(x.new_zeros((width, *x.shape[1:])))
    buf[: x.shape[0]] = _comm_device(x)
    parts = [torch.empty_like(buf) for _ in range(w.size)]
    dist.all_gather(parts, buf)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]).to(x.device)


def all_gather_sizes(n: int) -> list[int]:
    """Every rank's value of the integer ``n``, in rank order."""
    t = all_sum_vector_of(n)
    return [int(v) for v in t]


def all_sum_vector_of(n: int) -> Tensor:
    w = world()
    t = torch.zeros(w.size, dtype=torch.int64)
    t[w.rank] = n
    return all_sum(t)


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over ranks, in place (a missing gradient counts as zeros).

    Call it between ``loss.backward()`` and the optimizer step when each rank's loss is its part of the
    global loss (as in :func:`dp_step`); every rank then holds the single-process gradient."""
    if world().size == 1:
        return
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if dist.get_backend() == "nccl" or p.grad.device.type == "cpu":
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        else:
            p.grad.copy_(all_sum(p.grad))


def barrier() -> None:
    if world().size > 1:
        dist.barrier()


# -- the kinds' data-parallel rules --------------------------------------------------------------

@dataclass(frozen=True)
class DPRule:
    """How one kind's training pass splits across ranks."""

    mode: str
    """rows: per-row selection, nothing to share; batch: BatchTopK over the global batch; penalty: a row-local
    pass whose ``sparsity_loss`` is normalised by the batch's mean centred row norm to the power ``power``."""
    weight: Callable[[SparseCoder], Tensor] | None = None
    """batch: the ranking weight [L] of the selection (acts * weight), None for plain acts."""
    power: float = 1.0
    """penalty: the exponent of the batch's mean squared centred row norm that divides the penalty."""


def _crosscoder_weight(model: SparseCoder) -> Tensor:
    return source_norm_sum(training_decoder(model).detach(), model.n_sources)


DP_RULES: dict[str, DPRule] = {
    "topk": DPRule("rows"),
    "batchtopk": DPRule("batch"),
    "batchtopk-absolute": DPRule("batch"),
    "relu": DPRule("penalty", power=0.5),  # penalty / RMS row norm (saes.model._relu_train)
    "crosscoder": DPRule("batch", weight=_crosscoder_weight),
    "crosscoder-l1": DPRule("penalty", power=1.0),  # penalty / mean squared row norm (saes.crosscoder._l1_train)
}
"""kind -> DPRule. A kind registered in saes.model.KINDS trains data-parallel once it has a row here."""


def dp_rule(kind: str) -> DPRule:
    if kind not in DP_RULES:
        raise ValueError(f"kind {kind!r} has no data-parallel rule; add one to "
                         f"conceptdict.saes.distributed.DP_RULES (known: {sorted(DP_RULES)}) or train in one process")
    return DP_RULES[kind]


class BatchStats(NamedTuple):
    """Global statistics of one step's batch (identical on every rank)."""

    rows: int  # B
    total_var: Tensor  # 0-dim: sum over the global batch of |x - mean(x)|^2 (clamped like saes.train)


def centred_sum_sq(x: Tensor) -> tuple[int, Tensor]:
    """(global rows B, sum over all ranks' rows of |x - global mean|^2) for x [B_r, F]; two small all-reduces."""
    head = all_sum(torch.cat([x.sum(dim=0), x.new_tensor([x.shape[0]])]))
    rows = int(head[-1])
    mean = head[:-1] / rows
    return rows, all_sum((x - mean).pow(2).sum())


def _global_batch_forward(model: SparseCoder, x: Tensor, rows: int, weight: Tensor | None,
                          dead: Tensor | None, k_aux: int) -> TrainOutput:
    """BatchTopK over the global batch: local top ``k * B`` candidates, gathered scores, the global cut."""
    B_r = x.shape[0]
    k_local = -(-model.k * rows // B_r)  # k_local * B_r >= k * B: a superset of this rank's share
    s = row_scale(model, x) if model.spec.relative else x.new_ones(B_r, 1)  # saes.model.sparse_train_forward
    enc = kernels.encode((x - model.b_dec) / s, model.W_enc, model.b_enc, min(k_local, model.n_latents), batch=True,
                         scale=weight, dead=dead, k_aux=k_aux if dead is not None else 0, impl=model.kernel_impl)
    values = enc.values.detach()
    scores = values if weight is None else values * weight[enc.indices]
    alive = values > 0
    cut = _global_cut(scores[alive], model.k * rows)
    keep = alive & (scores >= cut)
    width = max(1, int(keep.sum(dim=1).max()) if keep.numel() else 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    vals = (enc.values * s * keep).gather(1, order)
    idx = enc.indices.gather(1, order)
    x_hat = kernels.sparse_decode(vals, idx, model.W_dec, model.b_dec, impl=model.kernel_impl, skip_zero_grads=True)
    kept = vals.detach() > 0
    fired = torch.zeros(model.n_latents, dtype=torch.bool, device=x.device)
    fired[idx[kept]] = True
    kept_scores = scores.masked_fill(~keep, math.inf)
    smallest = all_min(kept_scores.min() if kept_scores.numel() else x.new_tensor(math.inf))
    smallest = torch.where(torch.isfinite(smallest), smallest, torch.zeros_like(smallest))
    aux = kernels.SparseCode(enc.aux_values * s, enc.aux_indices) if dead is not None else None
    return TrainOutput(x_hat, fired, kept.sum(dim=1).float().mean(), None, smallest, aux)


def _global_cut(candidates: Tensor, n_keep: int) -> Tensor:
    """The ``n_keep``-th largest of every rank's candidate scores (0-dim; -inf when fewer exist)."""
    everything = gather_rows(candidates.float().reshape(-1))
    if everything.numel() <= n_keep:
        return candidates.new_tensor(-math.inf)
    return everything.topk(n_keep, sorted=False).values.min().to(candidates.dtype)


def dp_forward(model: SparseCoder, x: Tensor, stats: BatchStats, l1_coeff: float, dead: Tensor | None,
               k_aux: int) -> TrainOutput:
    """This rank's part of the kind's training pass on x [B_r, S*D] (normalised) of a global batch ``stats``.

    ``l0`` stays this rank's mean; ``fired`` this rank's latents; ``smallest`` and the penalty are global."""
    rule = dp_rule(model.kind)
    if rule.mode == "batch":
        weight = rule.weight(model) if rule.weight is not None else None
        return _global_batch_forward(model, x, stats.rows, weight, dead, k_aux)
    out = model.spec.train_forward(model, x, l1_coeff=l1_coeff, dead=dead, k_aux=k_aux)
    if rule.mode == "penalty" and out.sparsity_loss is not None:
        # the kind divides mean_r(penalty) by (mean_r |x - mean_r(x)|^2)^p; make it sum_r / (B * global^p)
        local = (x - x.mean(dim=0)).pow(2).sum(dim=1).mean().clamp_min(1e-12) ** rule.power
        glob = (stats.total_var / stats.rows).clamp_min(1e-12) ** rule.power
        out = out._replace(sparsity_loss=out.sparsity_loss * (x.shape[0] * local / (stats.rows * glob)).detach())
    return out


# -- one step ------------------------------------------------------------------------------------

def batch_stats(x: Tensor) -> BatchStats:
    """Global row count and FVU denominator of the batch whose rows x [B_r, F] this rank holds."""
    rows, total = centred_sum_sq(x)
    return BatchStats(rows, total.clamp_min(1e-12))


def _aux_part(out: TrainOutput, model: SparseCoder, err: Tensor) -> Tensor:
    """This rank's part of the AuxK loss: saes.train.aux_loss re-normalised by the GLOBAL residual variance."""
    residual = err.detach()
    part = tr.aux_loss(out.aux, model.W_dec, residual, model.kernel_impl)
    local = (residual - residual.mean(dim=0)).pow(2).sum().clamp_min(1e-12)
    _, total = centred_sum_sq(residual)
    return part * (local / total.clamp_min(1e-12))


def dp_step(model: SparseCoder, opt: torch.optim.Optimizer, x: Tensor, st: "tr._State", cfg: tr.TrainConfig,
            lr: float, dead_tokens: int, k_aux: int, threshold_start: int) -> dict[str, float]:
    """``saes.train._step`` on this rank's rows x [B_r, S*D] (normalised) of a global batch: the same update
    on every rank, equal (up to float summation order) to one process stepping on the whole batch."""
    stats = batch_stats(x)
    dead = st.since_fired >= dead_tokens
    use_aux = model.spec.uses_aux and bool(dead.any())
    out = dp_forward(model, x, stats, cfg.l1_coeff, dead.to(x.device) if use_aux else None, k_aux)
    err = x - out.x_hat
    fvu = err.pow(2).sum() / stats.total_var
    loss = fvu
    aux = torch.zeros((), device=x.device)
    if out.aux is not None:
        aux = _aux_part(out, model, err)
        loss = loss + cfg.aux_alpha * aux
    if out.sparsity_loss is not None:
        loss = loss + out.sparsity_loss
    tr.apply_update(model, opt, loss, lr, cfg.grad_clip, reduce_grads=all_reduce_grads)
    tr.record_step(model, st, any_rank(out.fired), stats.rows, out.smallest, threshold_start,
                   cfg.threshold_momentum)
    parts = all_sum(torch.stack([loss.detach(), fvu.detach(), aux.detach().reshape(()),
                                 out.l0.float() * x.shape[0] / stats.rows]).cpu().double())
    return {"loss": float(parts[0]), "fvu": float(parts[1]), "l0": float(parts[3]), "aux": float(parts[2]),
            "dead": float(dead.float().mean()), "lr": lr}


# -- the loop --------------------------------------------------------------------------------------

def _global_batches(stream: Iterator[Tensor], n: int) -> tuple[list[Tensor], list[Tensor]]:
    """Read up to ``n`` batches of this rank; returns (this rank's slices, the whole global batches)."""
    local = list(itertools.islice(stream, n))
    return local, [gather_rows(x) for x in local]


def _head(stream: Iterator[Tensor], init_rows: int) -> tuple[list[Tensor], list[Tensor]]:
    """Like saes.train._take_rows, counting GLOBAL rows: (local slices, global batches) holding >= init_rows."""
    local, whole, n = [], [], 0
    while n < init_rows:
        x = next(stream, None)
        if int(all_sum(torch.tensor([x is None], dtype=torch.int64))[0]):
            if x is not None:
                raise RuntimeError("ranks disagree on the end of the data; stream slices of the same global "
                                   "batches on every rank (activations.distributed.rank_batches)")
            break
        local.append(x)
        whole.append(gather_rows(x))
        n += whole[-1].shape[0]
    return local, whole


def _start(cfg: tr.TrainConfig, batches: tr.Batches, ck: dict | None, source: str):
    """Held-out batches (global), the training head (local slices), the model and its resolved settings."""
    stream = tr._checked(tr._open(batches, 0), 0, source)
    _, held_out = _global_batches(stream, cfg.eval_batches)
    _, calibration = _global_batches(stream, tr.calibration_batch_count(cfg))
    n_held = len(held_out) + len(calibration)
    if ck is not None:
        start = ck["position"]
        if callable(batches) and not hasattr(batches, "__iter__"):
            stream = tr._checked(tr._open(batches, start), start, source)
        else:
            stream = tr._checked(itertools.islice(stream, start - n_held, None), start, source)
    head, whole = _head(stream, cfg.init_rows if ck is None else 1)
    if not head and not n_held:
        raise ValueError(f"{source} holds no rows: nothing to train on (is the store empty?)")
    if not head and ck is None:
        raise ValueError(f"{source} holds only {n_held} batches, all held out for evaluation and calibration; "
                         f"lower eval_batches / calibration_batches or add data")
    return stream, held_out, calibration, head, whole


def train(cfg: tr.TrainConfig, batches: tr.Batches, *, out: str | Path | None = None, resume: bool = False,
          meta: dict[str, Any] | None = None, sink: MetricsSink | None = None,
          source: str = "the training batches") -> SparseCoder:
    """``saes.train.train`` under torch.distributed: ``batches`` yields THIS rank's slice of every global batch
    (``activations.distributed.rank_batches``); every rank returns the same model, equal to one process's.

    Without a process group (or with one rank) this is exactly ``saes.train.train``. Only rank 0 writes
    ``out`` (checkpoints, metrics, the artifact) and logs; ``out`` must be on a filesystem every rank reads
    when resuming. A checkpoint resumes under any number of ranks."""
    w = world()
    if w.size == 1:
        return tr.train(cfg, batches, out=out, resume=resume, meta=meta, sink=sink, source=source)
    device = tr.resolve_device(device_for(cfg.device))
    out = Path(out) if out is not None else None
    if resume and out is None:
        raise ValueError("resume=True needs the output directory holding checkpoint.pt")
    ck = tr.load_checkpoint(out / tr.CHECKPOINT_FILE) if resume else None
    stream, held_out, calibration, head, whole = _start(cfg, batches, ck, source)
    model, gen, total, r, opt, st = tr._setup(cfg, (whole or held_out or calibration)[0], whole,
                                              len(held_out) + len(calibration), batches, ck, device, source)
    if w.main:
        log.info("training %s on %s x %d ranks: resolved %s", model.extra_repr(), device, w.size, r)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
    sink = sink or (JsonlSink(out / tr.METRICS_FILE, keep_until_step=st.step if ck else None)
                    if out is not None and w.main else NullSink())
    last_x, m = _loop(cfg, model, opt, st, r, itertools.chain(head, stream), total, out, sink, gen, device)
    if st.step == 0:
        raise ValueError(f"{source} yielded no training batches (after {len(held_out)} held-out ones)")
    if out is not None and w.main:
        tr.save_checkpoint(out / tr.CHECKPOINT_FILE, tr._checkpoint_state(model, opt, st, cfg, gen, r))
    if model.spec.uses_threshold and st.threshold_updates == 0 and last_x is not None:
        if w.main:
            log.warning("run ended before threshold_start_step=%d; estimating the inference threshold from the "
                        "last batch only", r["threshold_start_step"])
        with torch.no_grad():
            smallest = dp_forward(model, last_x, batch_stats(last_x), cfg.l1_coeff, None, 0).smallest
            tr._update_threshold(model, float(smallest), 0.0, st)
    model = tr._finish(model, cfg, st, r, held_out, out if w.main else None, meta, m, calibration)
    barrier()
    return model


def _loop(cfg: tr.TrainConfig, model: SparseCoder, opt: torch.optim.Optimizer, st: "tr._State", r: dict,
          data: Iterator[Tensor], total: int | None, out: Path | None, sink: MetricsSink, gen: torch.Generator,
          device: torch.device) -> tuple[Tensor | None, dict | None]:
    """The steps; returns (the last normalised local batch, the last step's metrics)."""
    main = world().main
    scale_vec = st.scale.repeat_interleave(model.d_in).to(device)
    bar = tqdm(total=total, initial=st.step, unit="step", desc=f"train {cfg.kind}", disable=None if main else True)
    t_last, rows_last, last_x, m = time.perf_counter(), st.rows, None, None
    for x in data:
        if cfg.tokens is not None and st.rows >= cfg.tokens:
            break
        last_x = model.flatten_input(x.to(device)) * scale_vec
        lr = tr.lr_at(st.step, r["lr"], r["warmup_steps"], total, cfg.decay_fraction)
        m = dp_step(model, opt, last_x, st, cfg, lr, r["dead_tokens"], r["aux_k"], r["threshold_start_step"])
        st.position += 1
        bar.update()
        if st.step % cfg.log_every == 0 and main:
            now = time.perf_counter()
            tok_s = (st.rows - rows_last) / max(now - t_last, 1e-9)
            t_last, rows_last = now, st.rows
            log.info(tr._log_line(st, m, tok_s))
            sink.write({"step": st.step, "rows": st.rows, **m, "tok_s": tok_s})
        if out is not None and main and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0:
            tr.save_checkpoint(out / tr.CHECKPOINT_FILE, tr._checkpoint_state(model, opt, st, cfg, gen, r))
    bar.close()
    sink.close()
    return last_x, m
