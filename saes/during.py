"""Evaluation during training (``TrainConfig.eval_every``): every N steps, the dictionary as the run would save it if
it ended there is measured on the held-out rows and the numbers go to metrics.jsonl and the tracker.

The run itself is left alone: the evaluation reads a copy of the weights (on the main process; with latent shards
the shards' latents are gathered onto it through the seam, ``saes.shards.gather_shards``), made ready for inference
as the end of a run makes the saved dictionary (:func:`to_inference`: the kind's finish, the normalisation folded
into the weights, a thresholded kind's threshold calibrated on the calibration rows), and the random number
generators are restored afterwards, so a run with ``eval_every`` ends with the same weights, bit for bit, as one
without. The seconds an evaluation takes are left out of the logged tokens per second.

What is measured: an :data:`Evaluator` (``conceptdict.train`` builds one that computes the chosen yardsticks,
``naming.yardsticks``, and CE/KL where a causal LM is at hand); without one, the held-out evaluation's headline numbers
(:class:`~.evaluation.EvalResult`). Records: ``{"step": s, "eval/<metric>.<name>": value, ..., "eval/seconds": t}``,
no ``rows`` (the loop's seconds, ``sweep_results.loop_seconds``, read the step records' rows).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .calibration import threshold_summary
from .comm import Comm, is_main
from .evaluation import EvalResult, evaluate
from .model import SparseCoder

if TYPE_CHECKING:
    from .training import Job

log = logging.getLogger(__name__)

Evaluator = Callable[[SparseCoder, EvalResult, int], dict[str, float]]
"""(the dictionary as it stands, in raw units; its evaluation on the held-out rows; the step) -> the numbers to log
(flat names, e.g. ``core.explained_variance``)."""

HEADLINE = ("fvu", "explained_variance", "explained_variance_saebench", "l0", "l1", "mse", "cos_sim", "l2_ratio",
            "dead_fraction", "dense_fraction")
"""What an evaluation without an :data:`Evaluator` logs of the held-out :class:`EvalResult`."""


SHOWN = ("explained_variance", "fvu", "l0", "kl_div_score", "ce_loss_score", "dead_fraction")
"""The numbers the log line of an evaluation shows first (all of them go to metrics.jsonl)."""


def to_inference(model: SparseCoder, scale: torch.Tensor) -> None:
    """Turn a model in training form into the dictionary a run saves, in place: float32, the kind's finish (its
    inference form), the training parameters dropped, the normalisation ``scale`` [S] folded into the weights."""
    model.to(torch.float32)  # precision float64 ends in the float32 dictionary every reader expects
    if model.spec.finish is not None:
        with torch.no_grad():
            model.spec.finish(model)
    model.drop_train_params()
    model.fold_input_scale(scale)
    model.eval()


def normalisation(scale: torch.Tensor) -> dict[str, Any]:
    """The training summary's ``normalisation`` entry (crosscoders read the folded scale from it)."""
    return {"scale_per_source": [float(c) for c in scale], "folded_into_weights": True}


def due(cfg, step: int) -> bool:
    """Whether the run evaluates after ``step`` steps."""
    return bool(cfg.eval_every) and step % cfg.eval_every == 0


def checked(cfg, evaluator: Evaluator | None) -> Evaluator | None:
    """``evaluator``, after refusing ``cfg.metrics`` without one (the yardsticks need the store the run reads, which
    ``conceptdict.train`` knows and ``saes.train`` does not)."""
    if cfg.eval_every and cfg.metrics and evaluator is None:
        raise ValueError(f"metrics={','.join(cfg.metrics)}: saes.train evaluates the held-out rows' headline numbers "
                         f"only; the yardsticks are computed by conceptdict.train (cd.train / `conceptdict train`), "
                         f"or pass evaluators= to saes.train_sweep")
    return evaluator


def snapshot(job: Job, comm: Comm) -> SparseCoder | None:
    """The job's dictionary as a run ending now would save it, on the main process (None on the others); every latent
    shard of data rank 0 takes part in gathering a sharded one. The job's own model is not touched."""
    from .shards import gather_shards

    model, st = job.run.model, job.run.state
    if comm.shards.size > 1:
        whole = gather_shards(model, comm.shards, to_first=True) if comm.rank == 0 else None
    else:
        whole = copy.deepcopy(model) if is_main(comm) else None
    if whole is None:
        return None
    whole.zero_grad(set_to_none=True)
    to_inference(whole, st.scale)
    whole.training_summary = {"normalisation": normalisation(st.scale), "steps": st.step, "rows": st.rows}
    if whole.spec.uses_threshold:
        threshold_summary(whole, job.data.calibration)
    return whole


def evaluate_now(job: Job, evaluator: Evaluator | None, comm: Comm) -> float:
    """Evaluate the job's dictionary on its held-out rows and write the record (main process); the random number
    generators as they were before. Returns the seconds it took (on every process)."""
    start, st = time.perf_counter(), job.run.state
    device = job.run.model.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        whole = snapshot(job, comm)
        if whole is not None:
            result = evaluate(whole, job.data.held_out)
            numbers = evaluator(whole, result, st.step) if evaluator is not None else {
                k: getattr(result, k) for k in HEADLINE if getattr(result, k) is not None}
            seconds = time.perf_counter() - start
            job.sink.write({"step": st.step, **{f"eval/{k}": v for k, v in numbers.items()}, "eval/seconds": seconds})
            first = sorted(numbers, key=lambda k: next((i for i, n in enumerate(SHOWN) if k.endswith(n)), len(SHOWN)))
            shown = ", ".join(f"{k} {numbers[k]:.4g}" for k in first[:6] if isinstance(numbers[k], (int, float)))
            log.info("%seval at step %d on %d held-out rows (%.1f s): %s", job.name and f"[{job.name}] ", st.step,
                     result.n_tokens, seconds, shown)
    return time.perf_counter() - start
