"""Stopping a run when its held-out FVU has stopped improving (``TrainConfig.stop_patience``; on by default for a
store run that leaves ``tokens`` out, whose default length is then the upper bound).

Every ``stop_every`` steps, before the upper bound's final learning-rate decay begins, the run measures the
training objective's FVU on its held-out batches (the rows it never trains on; under several processes each
holds its part of every held-out batch, the squared errors are summed over processes, so every process gets the
same number and takes the same decision). An evaluation improves when it is below the best so far by more than
``stop_threshold`` of it; after ``stop_patience`` evaluations in a row without one, the rule fires at step s and
the run ends at the smallest step e whose schedule (``saes.update.lr_at`` with total e) begins its final decay at
s: the learning rate decays linearly to 0 over the steps s..e as it would have at the end of the full run.

A run that has begun to memorise its rows (a small store read many times) sees its held-out FVU rise, not just
stall. So the rule keeps a copy of the weights at the lowest held-out FVU so far (on the CPU), and when it fires
while the run memorises (:func:`memorising`) it goes back to those weights (the optimizer's state and the data
stream go on) and decays over the stretch a run that fired at the low's step b would have had: the schedule reads
step t as t - (s - b). On the two ~1,200-row held-out bench corpora (bench/cbm_accuracy.py, 1024 latents; the
larger three never reach the ratio) the held-out FVU falls from 0.378 / 0.439 to 0.360 / 0.433 and the CBM's mean
gap to the raw probe (3 splits) from 3.6 / 8.2 to 1.7 / 2.9 points (docs/results/defaults.md#stopping-rule).
The state (best, evaluations since it, the low and its weights, the end step, every evaluation) is part of the
checkpoint, so a resumed run stops where an uninterrupted one does.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .comm import Comm, StepInputs, batch_stats

log = logging.getLogger(__name__)

STOP_EVALS = 20
"""``stop_every`` None: the upper bound's steps over this many evaluations..."""
MIN_STOP_EVERY = 10
"""...and at least this many steps between two."""


@dataclass
class StopState:
    """Where the rule stands (in checkpoints as a dict)."""

    best: float | None = None
    """The best held-out FVU so far (None before the first evaluation)."""
    since_best: int = 0
    """Evaluations since the best one."""
    end_step: int | None = None
    """The step the run ends at once the rule has fired; None before."""
    fired_at: int | None = None
    history: list[list[float]] = field(default_factory=list)
    """[step, held-out FVU] of every evaluation."""
    low: float | None = None
    """The lowest held-out FVU so far (unlike ``best``, any decrease counts)..."""
    low_step: int | None = None
    """...the step it was measured after..."""
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """...and a CPU copy of the model's state there (until the rule fires; in checkpoints as ``stop_weights``)."""
    back_to: int | None = None
    """The step whose weights the run went back to when the rule fired (None: it went on from its own)."""

    def to_dict(self) -> dict[str, Any]:
        """The state without the weights (the summary's ``stopping`` entry, the checkpoint's ``stop``)."""
        out = asdict(replace(self, weights=None))
        del out["weights"]
        return out


def stop_every(cfg, total: int | None) -> int:
    """Steps between two held-out evaluations: ``cfg.stop_every``, else :data:`STOP_EVALS` over the run's upper
    bound ``total`` (at least :data:`MIN_STOP_EVERY`, which is also the interval when the length is unknown)."""
    if cfg.stop_every:
        return cfg.stop_every
    return max(MIN_STOP_EVERY, (total or 0) // STOP_EVALS)


def end_step(fired: int, decay_fraction: float, total: int | None) -> int:
    """The smallest e whose schedule starts its final decay at or after ``fired``: e - int(e * decay_fraction) >=
    fired (``lr_at``'s decay start), at most ``total``."""
    e = fired
    while e - int(e * decay_fraction) < fired:
        e += 1
    return min(e, total) if total else e


def due(cfg, st, total: int | None) -> bool:
    """Whether the rule evaluates after the step just taken (``st.step`` steps done)."""
    if not cfg.stop_patience or st.stop.end_step is not None:
        return False
    if total and st.step >= total - int(total * cfg.decay_fraction):  # the upper bound's own decay has begun
        return False
    return st.step % stop_every(cfg, total) == 0


@torch.no_grad()
def heldout_fvu(run, held_out: list, comm: Comm) -> float:
    """The training objective's FVU (normalised units, the step's selection rule) over the held-out batches: summed
    squared error over summed centred variance, both over every process's rows."""
    model, st = run.model, run.state
    device = model.device
    scale = st.scale.repeat_interleave(model.d_in).to(device)
    err = torch.zeros((), dtype=torch.float64)
    var = torch.zeros((), dtype=torch.float64)
    for x in held_out:
        xf = model.flatten_batch(x.to(device=device, dtype=model.dtype)) * scale
        xin, target = model.split(xf)
        stats = batch_stats(target, comm)
        out = model.spec.train_forward(model, xin, StepInputs(stats=stats, comm=comm, settings=run.settings,
                                                               per_row=st.step < run.resolved.topk_steps))
        err += comm.all_sum((target - out.x_hat).double().pow(2).sum().reshape(1).cpu())[0]
        var += float(stats.total_var)
    return float(err / var)


def observe(cfg, st, fvu: float, total: int | None, model=None, train_fvu: float | None = None) -> bool:
    """Record the evaluation after step ``st.step`` of ``model`` (None: keep no weights, never go back), whose last
    training batch had FVU ``train_fvu``; True when it makes the rule fire (``st.stop.end_step`` set;
    ``st.stop.back_to`` and the model's weights put back when the run memorises: see :func:`memorising`)."""
    s = st.stop
    s.history.append([st.step, fvu])
    if model is not None and (s.low is None or fvu < s.low):
        s.low, s.low_step = fvu, st.step
        s.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if s.best is None or fvu < s.best * (1 - cfg.stop_threshold):
        s.best, s.since_best = fvu, 0
        return False
    s.since_best += 1  # the best moves only by more than the threshold: slow steady gains still count
    if s.since_best < cfg.stop_patience:
        return False
    s.fired_at = st.step
    if s.weights is not None and memorising(fvu, s.low, train_fvu, cfg.stop_threshold):
        model.load_state_dict(s.weights)
        s.back_to = s.low_step
    s.weights = None  # no evaluation follows: the copy is not needed any more
    start = st.step if s.back_to is None else s.back_to
    s.end_step = end_step(start, cfg.decay_fraction, total) + st.step - start
    return True


def memorising(fvu: float, low: float, train_fvu: float | None, threshold: float) -> bool:
    """Whether a run memorises its rows: its held-out FVU has risen above its low by more than ``threshold`` of it
    and is over :data:`MEMORISE_RATIO` times its last training batch's. Both, because a small held-out set's FVU
    also rises by chance: on 2,000-row planted stores (bench/cli_planted.py) it rose 3.6-5.4% at 1.6-2.3x the
    training FVU, and going back there cost topk 3-4 of 128 atoms; the ~1,200-row real stores rose 5-9% at 5-6x."""
    return bool(train_fvu) and fvu > low * (1 + threshold) and fvu > MEMORISE_RATIO * train_fvu


def say_fired(cfg, st, fvu: float, total: int | None, name: str = "") -> None:
    """Log where the rule fired, where the run ends and, when it went back, to which step's weights."""
    s = st.stop
    back = "" if s.back_to is None else (
        f"; it rose from its low {s.low:.4f} at step {s.back_to} while the training FVU fell (the latents began to "
        f"memorise the rows): going back to that step's weights")
    log.info("%sheld-out FVU %.4f: no gain of %g over %.4f in %d evaluations%s; stopping at step %d after the "
             "learning rate decays (upper bound %s)", name and f"[{name}] ", fvu, cfg.stop_threshold, s.best,
             cfg.stop_patience, back, s.end_step, total)


def schedule(st, total: int | None) -> tuple[int, int | None]:
    """(step, length) of the learning-rate schedule (``update.lr_at``) after ``st.step`` steps: the run's own until
    the rule fires, then those of a run that fired at the step it went back to (the same when it went on)."""
    s = st.stop
    if s.end_step is None:
        return st.step, total
    rewind = 0 if s.back_to is None else s.fired_at - s.back_to
    return st.step - rewind, s.end_step - rewind


MEMORISE_RATIO = 4.0
"""A held-out FVU above this many times the last training batch's marks a dictionary that memorised its rows. On the
held-out bench corpora (bench/cbm_accuracy.py, 1024 latents, run length by the rule above) the ratio was 10.8 and 11.0
on the two ~1,200-row stores before the rule went back (5.2 / 5.3 since), where the CBM on the dictionary trailed the
raw probe by 3.6 and 8.2 points (1.7 / 2.9 since), and 3.7 / 2.4 / 1.5 on the 2,191- / 3,229- / 6,000-row ones (gaps
1.6 / 1.8 / below 0); the broad dictionary's is 1.4. With 256 latents (about a quarter of their rows) the two small
stores give 2.0 and gaps 1.3 / 1.5 (docs/results/cbm.md)."""


def fit_gap(train_fvu: float | None, heldout: float | None, n_latents: int, warn: bool = True) -> dict[str, Any] | None:
    """The last training batch's FVU against the held-out FVU (``summary["fit_gap"]``); a warning that names the fix
    when the dictionary reconstructs its training rows :data:`MEMORISE_RATIO` times better than held-out ones."""
    if train_fvu is None or heldout is None or not train_fvu > 0:
        return None
    ratio = heldout / train_fvu
    if ratio > MEMORISE_RATIO and warn:
        log.warning("held-out FVU %.3f is %.1fx the training rows' %.3f: the %d latents memorised the store's rows "
                    "instead of learning concepts that carry to new ones (a small store read many times); train fewer "
                    "latents (a quarter of the store's rows or fewer), or fit a CBM on the broad dictionary "
                    "(`conceptdict broad`)", heldout, ratio, train_fvu,
                    n_latents)  # fmt: skip
    return {"train_fvu": train_fvu, "heldout_fvu": heldout, "ratio": ratio, "memorised": ratio > MEMORISE_RATIO}
