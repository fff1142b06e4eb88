"""The training driver: one run of ``conceptdict train`` / ``cd.train``, whatever feeds it. A batch source (cached
activation stores, or a model's forward over a dataset) is planned into a :class:`TrainPlan`: the dictionaries with
their folders and resolved configs, what each reads, and the passes over the data (dictionaries that read it alike
share one); :func:`drive` then streams each pass once into ``saes.train_sweep``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from conceptdict import ranks
from conceptdict.activations import ActivationStore, heldout_recipe, stream_batches
from conceptdict.activations.listing import mlp_layers
from conceptdict.activations.live import LiveConfig
from conceptdict.activations.summary import check_signal
from conceptdict.saes import SparseCoder, TrainConfig, to_flat
from conceptdict.saes.artifact import CONFIG_FILE
from conceptdict.saes.config import (MIN_BATCH, default_batch_size, eval_batch_count, resolve_device,
                                     with_heldout_defaults)
from conceptdict.saes.distributed import process_group_comm
from conceptdict.saes.formats.saelens import KIND_TO_ARCH, exports_exactly
from conceptdict.saes.metrics import check_tracker
from conceptdict.saes.plan import (check_sources, layer_runs, per_hookpoint_runs, plan_store_run, stream_groups,
                                   sweep_points)
from conceptdict.saes.training import train_sweep
from conceptdict.settings import ConfigError, to_jsonable, write_resolved_config
from conceptdict.train_eval import evaluator

log = logging.getLogger(__name__)


@dataclass
class TrainCommand:
    """Where a training run reads and writes (the dictionary's own settings are :class:`TrainConfig`)."""

    stores: list[Path] = field(default_factory=list, metadata={
        "flag": "store", "help": "Activation store(s); several stores over the same tokens train a crosscoder."})
    hookpoints: list[str] = field(default_factory=list, metadata={
        "flag": "hookpoint", "help": "Hookpoint(s) to train on (default: the store's only one); a transcoder takes "
                                     "two, the component's input then its output."})
    layers: list[str] = field(default_factory=list, metadata={
        "flag": "layers", "help": "'all' or layer numbers (repeatable): train on these layers' MLPs "
                                  "(blocks.N.mlp.hook_in -> hook_out) instead of --hookpoint: a transcoder kind makes "
                                  "one dictionary per layer in OUT/LAYER from one read of each batch, a clt one "
                                  "over all of them."})
    out: Path | None = field(default=None, metadata={
        "help": "Output directory for the dictionary (config.json, weights.safetensors, checkpoint, metrics)."})
    resume: bool = field(default=False, metadata={
        "help": "Continue an interrupted run from OUT/checkpoint.pt; ends with the same weights."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a dictionary already in OUT."})
    buffer_rows: int = field(default=65536, metadata={"help": "Rows in the shuffle buffer of the training stream."})
    sweep: list[str] = field(default_factory=list, metadata={
        "flag": "sweep", "help": "FIELD=V1,V2 (repeatable): one dictionary per combination, all on ONE pass over "
                                 "the data, each in OUT/FIELD-VALUE_..."})


class TrainPlan(NamedTuple):
    """The dictionaries of one run and how the data reaches them."""

    names: list[str]
    """Sub-folder names ("" for a single dictionary)."""
    outs: list[Path]
    cfgs: list[TrainConfig]
    """Each dictionary's resolved config (batch size, held-out batches, ... decided)."""
    picks: list[Any]
    """Which of the read hookpoints each dictionary takes (None: all of them)."""
    metas: list[dict[str, Any]]
    """What each dictionary's config.json records of its data."""
    passes: list[tuple[list[int], Callable[[int], Iterator[Any]]]]
    """(dictionaries, their batch stream from a batch index): one read of the data per pass."""
    source: str
    """The data, as the log names it."""
    record: dict[str, Any]
    """What train_config.json records beside the command and the training settings."""
    more_rows: str
    """How a run of this source gets more rows (the short-run warning's fix)."""
    live: tuple[LiveConfig, Any] | None = None
    """A model's forward: its settings and the model (evaluations during training splice into it); None: stores."""


def run_training(cmd: TrainCommand, cfg: TrainConfig, live: LiveConfig,
                 grid: dict[str, list[Any]] | None = None) -> list[tuple[str, Path, SparseCoder]]:
    """Train every dictionary of the run; [(name, output directory, dictionary)] (name "" for a single one)."""
    ranks.join()  # under torchrun: join the job; ranks > 0 stay quiet
    points = sweep_points(cfg, grid or {})
    for tracker in {c.log for _, c in points}:  # a missing package or wandb login: refused before any data is read
        check_tracker(tracker)
    for kind in sorted({c.kind for _, c in points if not exports_exactly(c.kind)}):
        if ranks.current().main:
            log.info("%s dictionaries stay in conceptdict's format: SAELens (and Neuronpedia, SAEBench) holds %s "
                     "exactly (docs/results/kinds.md#the-default-kind-and-saelens)", kind, ", ".join(sorted(KIND_TO_ARCH)))
    comm = run_comm([c for _, c in points])
    plan = plan_live(cmd, live, points, comm) if live.model else plan_stores(cmd, points, comm)
    return drive(cmd, plan, comm)


def drive(cmd: TrainCommand, plan: TrainPlan, comm) -> list[tuple[str, Path, SparseCoder]]:
    """Warn about short runs, record each run's settings, and stream every pass once into ``saes.train_sweep``."""
    evaluators = [evaluator(c, m, *(plan.live or ())) for c, m in zip(plan.cfgs, plan.metas)]  # refusals first
    warn_short_runs(plan.names, plan.cfgs, plan.more_rows)
    if ranks.current().main:
        for out, c in zip(plan.outs, plan.cfgs):
            write_resolved_config({"command": to_jsonable(cmd), **plan.record, "train": to_jsonable(to_flat(c))}, out,
                                  "train_config.json")
    models: list[SparseCoder | None] = [None] * len(plan.cfgs)
    for members, batches in plan.passes:
        trained = train_sweep([plan.cfgs[i] for i in members], batches, outs=[plan.outs[i] for i in members],
                              resume=cmd.resume, metas=[plan.metas[i] for i in members],
                              names=[plan.names[i] for i in members], source=plan.source, comm=comm,
                              picks=[plan.picks[i] for i in members],
                              evaluators=[evaluators[i] for i in members])
        for i, model in zip(members, trained):
            models[i] = model
    return list(zip(plan.names, plan.outs, models))


def open_training_data(stores: list[Path], hookpoints: list[str]):
    """(ActivationStore list, hookpoint list, rows, description) after checking they fit together."""
    if not stores:
        raise ConfigError("conceptdict train needs --store STORE_DIR (made by `conceptdict cache` or `store import`)")
    opened = [ActivationStore(p) for p in stores]
    if not hookpoints:
        if len(opened[0].hookpoints) != 1:
            raise ConfigError(f"store {stores[0]} holds hookpoints {opened[0].hookpoints}; pick with --hookpoint")
        hookpoints = list(opened[0].hookpoints)
    widths = {(str(s.path), h): s.d_in(h) for s in opened for h in hookpoints}
    if len(set(widths.values())) > 1:
        raise ValueError(f"sources have different widths {widths}; a crosscoder needs one D for every source")
    rows = min(s.num_rows for s in opened)
    if rows == 0:
        raise ValueError(f"store {stores[0]} is empty (0 rows): nothing to train on; re-run `conceptdict cache`")
    for store in opened:  # all-zero or constant rows: refused before a run that would learn nothing
        for hp in hookpoints:
            check_signal(store, hp)
    desc = f"store {', '.join(str(p) for p in stores)}, hookpoint {', '.join(hookpoints)}"
    return opened, hookpoints, rows, desc



def _check_out(out: Path, resume: bool, overwrite: bool) -> None:
    if (out / CONFIG_FILE).exists() and not (resume or overwrite):
        raise FileExistsError(f"{out} already holds a dictionary; pass --overwrite to replace it or --resume")



def _outputs(out: Path | None, names: list[str], cmd: TrainCommand) -> list[Path]:
    if out is None:
        raise ConfigError("conceptdict train needs --out SAE_DIR")
    outs = [out / name if name else out for name in names]
    for path in outs:
        _check_out(path, cmd.resume, cmd.overwrite)
    return outs



def with_layers(cmd: TrainCommand, points: list[tuple[str, TrainConfig]], available: list[str], where: str):
    """(hookpoints, [(name, config, sources)]) of the run: ``cmd.layers``' MLP inputs then outputs
    (``saes.plan.layer_runs``) among the ``available`` hookpoints, else ``cmd.hookpoints`` with each point on them."""
    if not cmd.layers:
        return cmd.hookpoints, [(name, cfg, None) for name, cfg in points]
    if cmd.hookpoints:
        raise ConfigError(f"--layers {' '.join(cmd.layers)} picks the MLP hookpoints itself; drop --hookpoint")
    return layer_runs(mlp_layers(cmd.layers, available, where), points)




def plan_stores(cmd: TrainCommand, points: list[tuple[str, TrainConfig]], comm) -> TrainPlan:
    """Cached stores: open and check them, size the runs to the rows (``saes.plan.plan_store_run``); this rank's
    part of every batch, read ahead by a background thread and moved to the training device."""
    hookpoints, runs = with_layers(cmd, points, ActivationStore(cmd.stores[0]).hookpoints if cmd.stores and
                                   cmd.layers else [], f"store {cmd.stores[0] if cmd.stores else ''}")
    stores, hookpoints, rows, desc = open_training_data(cmd.stores, hookpoints)
    check_sources(points, len(stores) * len(hookpoints))
    names = [name for name, _, _ in runs]
    outs = _outputs(cmd.out, names, cmd)
    cfgs, passes = plan_store_run([(name, cfg) for name, cfg, _ in runs], rows)
    device = resolve_device(cfgs[0].device)
    reads = [[hookpoints[i] for i in pick] if pick is not None else hookpoints for _, _, pick in runs]
    metas = [{"stores": [str(s.path.resolve()) for s in stores], "hookpoints": hps,
              "model": stores[0].manifest.get("model", {}), "level": stores[0].level,
              "heldout": heldout_recipe(stores, hps, c.batch_size, c.seed, eval_batch_count(c), cmd.buffer_rows)}
             for c, hps in zip(cfgs, reads)]

    def reader(p) -> Callable[[int], Iterator[Any]]:
        return lambda start: stream_batches(stores, hookpoints, p.batch_size, seed=p.seed, epochs=p.epochs,
                                            buffer_rows=cmd.buffer_rows, start_batch=start,
                                            part=(comm.rank, comm.size), holdout_batches=p.heldout_batches,
                                            device=device)

    return TrainPlan(names, outs, cfgs, [pick for _, _, pick in runs], metas,
                     [(p.members, reader(p)) for p in passes], desc, {},
                     "cache more rows (or pass more --tokens)")


def plan_live(cmd: TrainCommand, live: LiveConfig, points: list[tuple[str, TrainConfig]], comm) -> TrainPlan:
    """A model's forward over a dataset (``activations.live``): each rank runs its forward batches; one forward
    pass per way of batching (``saes.plan.stream_groups``), its shuffled batches split over the ranks."""
    from conceptdict.activations.data import describe_dataset
    from conceptdict.activations.live import level_of, live_batches, open_model

    if cmd.stores:
        raise ConfigError("give --store (train on a cached store) or --model (train from the model's forward), "
                          "not both")
    if cmd.out is None or not (cmd.hookpoints or cmd.layers):
        raise ConfigError("conceptdict train --model needs --hookpoint H (repeatable) or --layers, and --out SAE_DIR")
    if any(cfg.tokens is None for _, cfg in points):
        raise ConfigError("conceptdict train --model needs --tokens N: the activation rows to train on (the dataset "
                          "is read once, so it must hold at least N + held-out rows)")
    chosen: dict[str, Any] = {}

    def choose(available: list[str]) -> list[str]:  # with the model's hookpoint names at hand: --layers' MLPs
        chosen["hookpoints"], chosen["runs"] = with_layers(cmd, points, available, f"model {live.model}")
        return chosen["hookpoints"]

    model = open_model(live, choose, resolve_device(points[0][1].device))
    hookpoints = chosen["hookpoints"]
    check_sources(points, len(hookpoints))
    runs = chosen["runs"] if cmd.layers else per_hookpoint_runs(hookpoints, points)
    names = [name for name, _, _ in runs]
    outs = _outputs(cmd.out, names, cmd)
    cfgs = [with_heldout_defaults(cfg if cfg.batch_size else dataclasses.replace(
        cfg, batch_size=default_batch_size(cfg.tokens))) for _, cfg, _ in runs]
    reads = [hookpoints if s is None else [hookpoints[i] for i in ([s] if isinstance(s, int) else s)]
             for _, _, s in runs]
    metas = [{"model": model.load_info, "hookpoints": hps, "level": level_of(hookpoints),
              "dataset": describe_dataset(live.dataset), "live": to_jsonable(live)} for hps in reads]

    def reader(batch: int, seed: int) -> Callable[[int], Iterator[Any]]:
        return lambda start: live_batches(live, model, hookpoints, batch, seed=seed, buffer_rows=cmd.buffer_rows,
                                          start_batch=start, part=(comm.rank, comm.size),
                                          gather=comm.gather_rows if comm.size > 1 else None)

    passes = [(members, reader(batch, seed)) for (batch, seed), members in stream_groups(cfgs).items()]
    return TrainPlan(names, outs, cfgs, [pick for _, _, pick in runs], metas, passes,
                     f"model {live.model} over {live.dataset}, hookpoint {', '.join(hookpoints)}",
                     {"live": to_jsonable(live)}, "pass more --tokens", (live, model))


MIN_STEPS = 50
"""A run planned for fewer steps than this is warned about before it starts: 4 steps of batchtopk (4,000 live tokens
in batches of 1,024) ended at FVU 0.785, short of what the same dictionary reaches in a few hundred."""


def warn_short_runs(names: list[str], cfgs: list[TrainConfig], more: str) -> None:
    """Warn (once per dictionary, main rank) when a run will train fewer than :data:`MIN_STEPS` steps, naming the
    steps, rows and batch size and the fix: ``more`` (how this kind of run gets more rows) or a smaller batch."""
    for name, cfg in zip(names, cfgs):
        steps, batch = -(-cfg.tokens // cfg.batch_size), cfg.tokens // MIN_STEPS
        if steps < MIN_STEPS and ranks.current().main:
            smaller = f", or --batch-size {batch} or smaller" if batch >= MIN_BATCH else ""
            log.warning("%s will train only %d steps (%d tokens in batches of %d): too few to fit a dictionary; %s%s, "
                        "for %d steps or more", f"dictionary {name}" if name else "this run", steps, cfg.tokens,
                        cfg.batch_size, more, smaller, MIN_STEPS)


def run_comm(cfgs: list[TrainConfig]):
    """The seam of this rank for a run's dictionaries (``saes.distributed.process_group_comm``): data parallel, and
    with ``latent_shards`` its latent shards (every dictionary of one run takes the same count)."""
    counts = sorted({c.latent_shards for c in cfgs})
    if len(counts) > 1:
        raise ConfigError(f"latent_shards takes one value per run, not {counts}: sweep it in separate runs")
    return process_group_comm(counts[0])


