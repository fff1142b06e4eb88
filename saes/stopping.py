"""Stopping a run when its held-out FVU has stopped improving (``TrainConfig.stop_patience``; on by default for a
store run that leaves ``tokens`` out, whose default length is then the upper bound).

Every ``stop_every`` steps, before the upper bound's final learning-rate decay begins, the run measures the
training objective's FVU on its held-out batches (the rows it never trains on; under several processes each
holds its part of every held-out batch, the squared errors are summed over processes, so every process gets the
same number and takes the same decision). An evaluation improves when it is below the best so far by more than
``stop_threshold`` of it; after ``stop_patience`` evaluations in a row without one, the rule fires at step s and
the run ends at the smallest step e whose schedule (``saes.update.lr_at`` with total e) begins its final decay at
s: the learning rate decays linearly to 0 over the steps s..e as it would have at the end of the full run. The
state (best, evaluations since it, the end step, every evaluation) is part of the checkpoint, so a resumed run
stops where an uninterrupted one does.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    device = model.W_dec.device
    scale = st.scale.repeat_interleave(model.d_in).to(device)
    err = torch.zeros((), dtype=torch.float64)
    var = torch.zeros((), dtype=torch.float64)
    for x in held_out:
        xf = model.flatten_batch(x.to(device=device, dtype=model.W_dec.dtype)) * scale
        xin, target = model.split(xf)
        stats = batch_stats(target, comm)
        out = model.spec.train_forward(model, xin, StepInputs(stats=stats, comm=comm, settings=run.settings,
                                                               per_row=st.step < run.resolved.topk_steps))
        err += comm.all_sum((target - out.x_hat).double().pow(2).sum().reshape(1).cpu())[0]
        var += float(stats.total_var)
    return float(err / var)


def observe(cfg, st, fvu: float, total: int | None) -> bool:
    """Record the evaluation after step ``st.step``; True when it makes the rule fire (``st.stop.end_step`` set)."""
    s = st.stop
    s.history.append([st.step, fvu])
    if s.best is None or fvu < s.best * (1 - cfg.stop_threshold):
        s.best, s.since_best = fvu, 0
        return False
    s.since_best += 1  # the best moves only by more than the threshold: slow steady gains still count
    if s.since_best < cfg.stop_patience:
        return False
    s.fired_at, s.end_step = st.step, end_step(st.step, cfg.decay_fraction, total)
    return True


MEMORISE_RATIO = 4.0
"""A held-out FVU above this many times the last training batch's marks a dictionary that memorised its rows. On the
held-out bench corpora (bench/cbm_accuracy.py, 1024 latents, run length by the rule above) the ratio is 10.8 and 11.0
on the two ~1,200-row stores, where the CBM on the dictionary trails the raw probe by 3.6 and 8.2 points, and 3.7 / 2.4
/ 1.5 on the 2,191- / 3,229- / 6,000-row ones (gaps 1.6 / 1.8 / below 0); the broad dictionary's is 1.4. With 256
latents (about a quarter of their rows) the two small stores give 2.0 and gaps 1.3 / 1.5 (docs/results/cbm.md)."""


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
