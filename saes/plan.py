"""Planning a training run over a store: the sweep's points, the batch and length every dictionary of a run takes,
and which dictionaries a run over several hookpoints makes. Pure settings logic, beside :func:`fit_to_store`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

from .config import TrainConfig, fit_to_store, heldout_batch_count, one_pass_rows, sweep_configs
from .kinds import reads_several_sources

log = logging.getLogger(__name__)

SWEEP_FIXED = ("batch_size", "tokens", "seed", "eval_batches", "device")
"""TrainConfig fields a sweep cannot vary: they change the batches (the stream's seed is the run's seed)."""


def sweep_points(cfg: TrainConfig, grid: dict[str, list[Any]]) -> list[tuple[str, TrainConfig]]:
    """[(name, TrainConfig)]: ``[("", cfg)]`` without a grid, else every combination of its values (field -> values),
    each named ``field-value_field-value`` (its output folder)."""
    if not grid:
        return [("", cfg)]
    fixed = sorted(set(grid) & set(SWEEP_FIXED))
    if fixed:
        raise ValueError(f"--sweep {fixed[0]}: {', '.join(SWEEP_FIXED)} change the batches every dictionary of a "
                         f"sweep shares; run separate trainings for them")
    return sweep_configs(cfg, grid)


class StorePlan(NamedTuple):
    """How a run reads a store: each dictionary's config (batch and length filled in), the passes over the store
    (None: as many as the longest run needs) and the batches held out at its start."""

    cfgs: list[TrainConfig]
    epochs: int | None
    heldout_batches: int


def plan_store_run(points: list[tuple[str, TrainConfig]], rows: int) -> StorePlan:
    """Fit every point of a run to a store of ``rows`` rows so they can share ONE stream: the smallest default batch
    for all (a small store clamps it by its held-out count), and one pass when they hold out different numbers of
    batches and left ``tokens`` to the default (a repeated stream leaves the held-out rows out of later passes, which
    would make a dictionary differ from its separate run)."""
    cfgs = [fit_to_store(cfg, rows) for _, cfg in points]
    smallest = min(c.batch_size for c in cfgs)
    cfgs = [c if c.batch_size == smallest else fit_to_store(dataclasses.replace(cfg, batch_size=smallest), rows)
            for c, (_, cfg) in zip(cfgs, points)]
    if len({heldout_batch_count(c) for c in cfgs}) > 1:
        cfgs = [_one_pass(c, rows) if cfg.tokens is None else c for c, (_, cfg) in zip(cfgs, points)]
    helds = {heldout_batch_count(c) for c in cfgs}
    repeat = any(c.tokens > one_pass_rows(c, rows) for c in cfgs)
    if repeat and len(helds) > 1:
        raise ValueError(f"these dictionaries hold out different numbers of batches ({sorted(helds)}: thresholded "
                         f"kinds add --calibration-batches) and --tokens asks for more than one pass over the store, "
                         f"whose later epochs leave the held-out rows out; sweep them with the same held-out count "
                         f"(--calibration-batches 0) or one pass")
    return StorePlan(cfgs, None if repeat else 1, max(helds))


def _one_pass(cfg: TrainConfig, rows: int) -> TrainConfig:
    tokens = one_pass_rows(cfg, rows)
    if tokens < cfg.tokens:
        log.warning("%s: one pass over the store (%d rows, not the default %d): this sweep's dictionaries hold out "
                    "different numbers of batches; for more passes give --tokens and --calibration-batches 0",
                    cfg.kind, tokens, cfg.tokens)
    return dataclasses.replace(cfg, tokens=tokens)


def per_hookpoint_runs(hookpoints: list[str], points: list[tuple[str, TrainConfig]]
                       ) -> list[tuple[str, TrainConfig, int | None]]:
    """[(name, TrainConfig, source index)] of a run over a model's ``hookpoints``: every point on every hookpoint (a
    dictionary each, named HOOKPOINT[/POINT]), or on all of them at once for kinds that read several."""
    multi = {reads_several_sources(c.kind) for _, c in points}
    if len(hookpoints) == 1 or multi == {True}:
        return [(name, cfg, None) for name, cfg in points]
    if multi != {False}:
        raise ValueError("a sweep over --model's hookpoints cannot mix kinds that read every hookpoint (crosscoder, "
                         "transcoder) with kinds trained on each; run them separately")
    return [(f"{hp}/{name}" if name else hp, cfg, s) for s, hp in enumerate(hookpoints) for name, cfg in points]
