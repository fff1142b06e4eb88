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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import kernels
from .evaluate import evaluate
from .checkpoint import TrainState, checkpoint_state, load_checkpoint, restore, save_checkpoint
from .config import TrainConfig, default_dead_tokens, default_lr, resolve, resolve_device
from .metrics import JsonlSink, MetricsSink, NullSink
from .model import SparseCoder, geometric_median, normalisation_scale

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"

Batches = Iterable[Tensor] | Callable[[int], Iterable[Tensor]]
"""Training data: an iterable of [B, D] / [B, S, D] tensors, or a function start_batch -> such an iterable
that starts at that batch (lets ``resume`` skip without reading, e.g. ``stream_batches(start_batch=...)``)."""

__all__ = ["Batches", "TrainConfig", "default_dead_tokens", "default_lr", "make_optimizer", "train"]


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


def record_step(model: SparseCoder, st: TrainState, fired: Tensor, rows: int, smallest: Tensor | None,
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
    r = resolve(cfg, model, total)
    opt = make_optimizer(model, r["lr"])
    if ck is not None:
        st = restore(ck, model, opt, cfg, source)
        gen.set_state(ck["rng"])
        if ck.get("resolved", r) != r:
            raise ValueError(f"--resume resolves the run differently from the checkpoint ({ck['resolved']} vs {r}); "
                             f"the data's length changed: pass the same tokens= as the first run")
    else:
        flat = torch.cat([model.flatten_input(x) for x in sample])[: cfg.init_rows]
        st = TrainState(position=n_held, scale=_init_from_sample(model, flat.to(device), cfg).cpu(),
                    since_fired=torch.zeros(cfg.latents, dtype=torch.int64))
    return model, gen, total, r, opt, st


def _step(model: SparseCoder, opt: torch.optim.Optimizer, x: Tensor, st: TrainState, cfg: TrainConfig,
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
def _update_threshold(model: SparseCoder, smallest: float, momentum: float, st: TrainState) -> None:
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


def _log_line(st: TrainState, m: dict[str, float], tok_s: float) -> str:
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
            save_checkpoint(out / CHECKPOINT_FILE, checkpoint_state(model, opt, st, cfg, gen, r))
    bar.close()
    sink.close()
    if st.step == 0:
        raise ValueError(f"{source} yielded no training batches (after {len(held_out)} held-out ones)")
    if out is not None:
        save_checkpoint(out / CHECKPOINT_FILE, checkpoint_state(model, opt, st, cfg, gen, r))
    if model.spec.uses_threshold and st.threshold_updates == 0 and last_x is not None:
        log.warning("run ended before threshold_start_step=%d; estimating the inference threshold from the "
                    "last batch only", r["threshold_start_step"])
        with torch.no_grad():
            _update_threshold(model, float(model.spec.train_forward(model, last_x, l1_coeff=cfg.l1_coeff).smallest),
                              0.0, st)
    return _finish(model, cfg, st, r, held_out, out, meta, m)


def _finish(model: SparseCoder, cfg: TrainConfig, st: TrainState, r: dict[str, Any], held_out: list[Tensor],
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
