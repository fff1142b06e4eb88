"""Planning a training run over a store: the sweep's points, the batch and length every dictionary of a run takes,
and which dictionaries a run over several hookpoints makes. Pure settings logic, beside :func:`fit_to_store`."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from .config import TrainConfig, fit_to_store, heldout_batch_count, one_pass_rows
from .flat import sweep_configs
from .kinds import is_crosscoder, kind_spec, reads_several_sources

log = logging.getLogger(__name__)

SWEEP_FIXED = ("device",)
"""TrainConfig fields a sweep cannot vary (one run trains on one device)."""


def sweep_points(cfg: TrainConfig, grid: dict[str, list[Any]]) -> list[tuple[str, TrainConfig]]:
    """[(name, TrainConfig)]: ``[("", cfg)]`` without a grid, else every combination of its values (field -> values),
    each named ``field-value_field-value`` (its output folder)."""
    if not grid:
        return [("", cfg)]
    fixed = sorted(set(grid) & set(SWEEP_FIXED))
    if fixed:
        raise ValueError(f"--sweep {fixed[0]}: one run trains on one device; run separate trainings per device")
    return sweep_configs(cfg, grid)


class StorePass(NamedTuple):
    """One pass of a run over a store: the dictionaries (indices into the run's points) that share it, and how it
    reads the store: its batch size and seed, the passes over the store (None: as many as the longest run needs)
    and the batches held out at its start."""

    members: list[int]
    batch_size: int
    seed: int
    epochs: int | None
    heldout_batches: int


def stream_groups(cfgs: list[TrainConfig], held: bool = False) -> dict[tuple[int, ...], list[int]]:
    """The configs (indices, in order) grouped by how they read the data: (batch size, seed) and, with ``held``, the
    number of batches held out at the start; each group can share one pass."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(cfgs):
        key = (c.batch_size, c.seed, heldout_batch_count(c)) if held else (c.batch_size, c.seed)
        groups.setdefault(key, []).append(i)
    return groups


def plan_store_run(points: list[tuple[str, TrainConfig]], rows: int) -> tuple[list[TrainConfig], list[StorePass]]:
    """(each point's config fitted to a store of ``rows`` rows, the passes that train them). Every point is fitted
    as its separate run would be (:func:`fit_to_store`: batch, held-out batches, length), and the points that read
    the store the same way (batch size, seed, held-out count) share ONE pass, so each dictionary equals its
    separate run; a point that reads it otherwise gets a pass of its own rather than being shortened."""
    cfgs = [fit_to_store(cfg, rows) for _, cfg in points]
    passes = []
    for (batch, seed, held), members in stream_groups(cfgs, held=True).items():
        repeat = any(cfgs[i].tokens > one_pass_rows(cfgs[i], rows) for i in members)
        passes.append(StorePass(members, batch, seed, None if repeat else 1, held))
    if len(passes) > 1:
        log.info("%d passes over the store: the sweep's points read it differently (batch, seed or held-out "
                 "batches), so each group trains as its separate runs would", len(passes))
    return cfgs, passes


def check_sources(points: list[tuple[str, TrainConfig]], n_sources: int) -> None:
    """Refuse a crosscoder kind over one source (it would train as a plain SAE and be reported as a crosscoder)."""
    for kind in sorted({c.kind for _, c in points if is_crosscoder(c.kind)}):
        if n_sources < 2:
            raise ValueError(f"kind {kind!r} is a crosscoder: it reads several sources, but this run has one; give "
                             f"two --store (two models over the same tokens) or several --hookpoint, or train --kind "
                             f"topk on one source")


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


def layer_runs(pairs: list[tuple[int, str, str]], points: list[tuple[str, TrainConfig]]
               ) -> tuple[list[str], list[tuple[str, TrainConfig, tuple[int, int] | None]]]:
    """(hookpoints to stream, [(name, TrainConfig, sources)]) of a run over the MLPs ``pairs`` [(layer, input, output)]:
    the stream holds every input then every output; a cross-layer transcoder reads all of them (one dictionary), a
    transcoder kind makes one dictionary per layer (named LAYER[/POINT]) from its (input, output) sources."""
    n = len(pairs)
    hookpoints = [p[1] for p in pairs] + [p[2] for p in pairs]
    layered = {kind_spec(c.kind).layered for _, c in points}
    if layered == {True}:
        return hookpoints, [(name, cfg, None) for name, cfg in points]
    bad = sorted({c.kind for _, c in points if not kind_spec(c.kind).transcodes or kind_spec(c.kind).layered})
    if bad:
        raise ValueError(f"--layers trains a transcoder per MLP or one cross-layer transcoder; kind(s) {bad} do not "
                         f"read an MLP's input and output: use --kind transcoder, skip-transcoder, clt or "
                         f"clt-batchtopk (one kind family per run)")
    return hookpoints, [(f"{layer}/{name}" if name else str(layer), cfg, (i, n + i))
                        for i, (layer, _, _) in enumerate(pairs) for name, cfg in points]
