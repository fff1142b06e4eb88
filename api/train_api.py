"""Train dictionaries: on stores, or straight from a model's forward; one dictionary or a sweep on one pass."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TypedDict, overload

from typing_extensions import Unpack

from conceptdict import ranks
from conceptdict.activations import ActivationStore, heldout_recipe, stream_batches
from conceptdict.activations.live import LiveConfig
from conceptdict.activations.summary import check_signal
from conceptdict.saes import FlatField, SparseCoder, TrainConfig, flat_train_fields, to_flat, train_config
from conceptdict.saes.flat import TrainingSettings
from conceptdict.saes.artifact import CONFIG_FILE
from conceptdict.saes.config import (MIN_BATCH, default_batch_size, eval_batch_count, resolve_device,
                                     with_heldout_defaults)
from conceptdict.saes.distributed import process_group_comm
from conceptdict.saes.formats.saelens import KIND_TO_ARCH, exports_exactly
from conceptdict.saes.metrics import check_tracker
from conceptdict.activations.listing import mlp_layers
from conceptdict.saes.plan import (check_sources, layer_runs, per_hookpoint_runs, plan_store_run, stream_groups,
                                   sweep_points)
from conceptdict.saes.training import train_sweep
from conceptdict.settings import (
    ConfigError,
    Setting,
    check_keys,
    coerce_settings,
    config_from_dict,
    home_of,
    takes_settings,
    parse_field_values,
    split_settings,
    to_jsonable,
    write_resolved_config,
)
from conceptdict.objects import StoreLike
from conceptdict.outdir import guarded

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


@functools.cache
def train_settings() -> tuple[Setting, ...]:
    """The training settings (``saes.flat_train_fields``: the shared ones, then each kind's own) as settings whose
    default is None (the default, which may depend on the kind and the data; ``--help`` shows the fixed ones): the
    flags of ``conceptdict train`` and ``diff`` and the keywords of :func:`train` (:class:`TrainingSettings`)."""
    def entry(f: FlatField) -> Setting:
        owners = f"{', '.join(f.kinds)}: " if f.kinds else ""  # the kinds that read it
        return Setting(f.name, f.type | None if f.default is dataclasses.MISSING else f.type, None, owners + f.help,
                       minimum=f.minimum, kinds=f.kinds, shown_default=f.default)

    return tuple(entry(f) for f in flat_train_fields())


class LiveSettings(TypedDict, total=False):
    """:class:`LiveConfig`'s settings as keywords of :func:`train` (training from a model's forward)."""

    model: str | None
    dataset: str | None
    text_column: str
    tokens_column: str | None
    split: str
    encoding: str
    context_length: int
    packing: bool | None
    prepend_bos: bool
    tokenizer: str | None
    model_dtype: str
    forward_batch_size: int


class TrainKeywords(TrainingSettings, LiveSettings, total=False):
    """Every keyword of :func:`train` but the store, hookpoint, layers and sweep: where it writes, the dictionary's
    settings and, with ``model=``, the model's."""

    out: str | Path | None
    resume: bool
    overwrite: bool
    buffer_rows: int


@overload
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | None = None,
          layers: None = None, sweep: None = None, **settings: Unpack[TrainKeywords]) -> SparseCoder: ...


@overload
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | Sequence[str] | None = None,
          layers: str | Sequence[str] | None = None, sweep: str | Sequence[str] | Mapping[str, Sequence[Any]] | None
          = None, **settings: Unpack[TrainKeywords]) -> SparseCoder | dict[str, SparseCoder]: ...


@guarded("train", own_overwrite=True)
@takes_settings(TrainCommand, train_settings(), LiveConfig)
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | Sequence[str] | None = None,
          layers: str | Sequence[str] | None = None,
          sweep: str | Sequence[str] | Mapping[str, Sequence[Any]] | None = None,
          **settings: Unpack[TrainKeywords]) -> SparseCoder | dict[str, SparseCoder]:
    """Train a dictionary (``conceptdict train``) on ``store`` (one or several activation stores: folders or
    opened stores; several over the same tokens train a crosscoder) or straight from ``model=`` over ``dataset=``
    (then ``tokens=`` is required); ``latents=`` and ``k=`` are required.

    ``sweep`` takes ``"k=16,32"``, ``["k=16,32", "kind=topk,batchtopk"]`` or ``{"k": [16, 32]}``: one dictionary per
    combination on one pass over the data. Returns the dictionary (it remembers its folder, ``out``); a run that
    makes several (a sweep, ``layers=``, or several hookpoints with ``model=``) returns a :class:`Sweep`: its
    dictionaries by sub-folder name and a summary table (``.to_pandas()``). Under torchrun every rank trains its
    part of each batch."""
    cmd, cfg, live, grid = train_configs(store=store, hookpoint=hookpoint, layers=layers, sweep=sweep, **settings)
    return _one_or_many(run_training(cmd, cfg, live, grid))


def train_configs(**settings: Any) -> tuple[TrainCommand, TrainConfig, LiveConfig, dict[str, list[Any]]]:
    """(where, what, from which model, sweep grid) of a training run from keyword settings, checked strictly."""
    sweep = settings.pop("sweep", None) or []
    if isinstance(sweep, str):
        sweep = [sweep]
    if settings.get("store") is not None:
        settings["store"] = [home_of(s, "store") for s in
                             (settings["store"] if isinstance(settings["store"], (list, tuple)) else [settings["store"]])]
    command, train_part, live_part = split_settings({k: v for k, v in settings.items() if v is not None}, TrainCommand, train_settings(), LiveConfig, where="train")
    train_part = coerce_settings(train_settings(), train_part, "train")
    grid = sweep_grid(sweep)
    both = [n for n in grid if train_part.get(n) is not None]
    if both:
        n = both[0]
        raise ConfigError(f"{n} is given twice, as {n}={train_part[n]!r} (--{n.replace('_', '-')}) and by the sweep "
                          f"{n}={','.join(map(str, grid[n]))}; give it once (the sweep's values, or the one value)")
    for n in ("latents", "k"):  # a swept field needs no flag: the base takes the sweep's first value
        if train_part.get(n) is None and grid.get(n):
            train_part[n] = grid[n][0]
    missing = [f"--{n}" for n in ("latents", "k") if train_part.get(n) is None]
    if missing:
        raise ConfigError(f"conceptdict train needs {' and '.join(missing)} (e.g. --latents 4096 --k 32; in Python "
                          f"latents= and k=)")
    cmd = config_from_dict(TrainCommand, {**command, "sweep": [str(s) for s in sweep]
                                          if not isinstance(sweep, dict) else []}, "train")
    cfg = train_config(**{k: v for k, v in train_part.items() if v is not None})
    live = config_from_dict(LiveConfig, live_part, "train")
    if live.dataset and not live.model:
        raise ConfigError("--dataset is read through a model: add --model M (or drop --dataset and train on --store)")
    return cmd, cfg, live, grid


def sweep_grid(sweep: list[str] | dict[str, list[Any]]) -> dict[str, list[Any]]:
    """field -> values of a sweep given as ``["FIELD=V1,V2", ...]`` or as a dict."""
    if isinstance(sweep, dict):
        grid = {k.replace("-", "_"): list(v) for k, v in sweep.items()}
        check_keys(grid, train_settings(), "sweep")
        return grid
    grid = dict(parse_field_values(train_settings(), spec, "--sweep") for spec in sweep)
    if len(sweep) != len(grid):
        raise ConfigError(f"--sweep names a field twice ({', '.join(sweep)}); give each field once")
    return grid


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
    if live.model:
        return train_from_model(cmd, live, points)
    return train_on_stores(cmd, points)


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


def train_on_stores(cmd: TrainCommand, points: list[tuple[str, TrainConfig]]):
    """Open the stores, size the runs, stream this rank's part of every batch ONCE into ``saes.train_sweep``."""
    hookpoints, runs = with_layers(cmd, points, ActivationStore(cmd.stores[0]).hookpoints if cmd.stores and
                                   cmd.layers else [], f"store {cmd.stores[0] if cmd.stores else ''}")
    stores, hookpoints, rows, desc = open_training_data(cmd.stores, hookpoints)
    check_sources(points, len(stores) * len(hookpoints))
    names = [name for name, _, _ in runs]
    outs = _outputs(cmd.out, names, cmd)
    cfgs, passes = plan_store_run([(name, cfg) for name, cfg, _ in runs], rows)
    warn_short_runs(names, cfgs, "cache more rows (or pass more --tokens)")
    comm = run_comm(cfgs)
    device = resolve_device(cfgs[0].device)
    reads = [[hookpoints[i] for i in pick] if pick is not None else hookpoints for _, _, pick in runs]
    metas = [{"stores": [str(s.path.resolve()) for s in stores], "hookpoints": hps,
              "model": stores[0].manifest.get("model", {}), "level": stores[0].level,
              "heldout": heldout_recipe(stores, hps, c.batch_size, c.seed, eval_batch_count(c), cmd.buffer_rows)}
             for c, hps in zip(cfgs, reads)]
    if ranks.current().main:
        for out, c in zip(outs, cfgs):
            write_resolved_config({"command": to_jsonable(cmd), "train": to_jsonable(to_flat(c))}, out,
                                  "train_config.json")
    models: list[SparseCoder | None] = [None] * len(cfgs)
    for p in passes:  # the points that read the store alike share a pass (saes.plan.plan_store_run)

        def batches(start: int, p=p):
            # this rank's rows of every global batch (one process: every row), read ahead by a background thread,
            # moved to the training device in the store's dtype and converted there
            return stream_batches(stores, hookpoints, p.batch_size, seed=p.seed, epochs=p.epochs,
                                  buffer_rows=cmd.buffer_rows, start_batch=start, part=(comm.rank, comm.size),
                                  holdout_batches=p.heldout_batches, device=device)

        trained = train_sweep([cfgs[i] for i in p.members], batches, outs=[outs[i] for i in p.members],
                              resume=cmd.resume, metas=[metas[i] for i in p.members],
                              names=[names[i] for i in p.members], source=desc, comm=comm,
                              picks=[runs[i][2] for i in p.members])
        for i, model in zip(p.members, trained):
            models[i] = model
    return list(zip(names, outs, models))


def train_from_model(cmd: TrainCommand, live: LiveConfig, points: list[tuple[str, TrainConfig]]):
    """Run ``live.model`` over ``live.dataset`` (each rank its forward batches) and stream this rank's part of
    every shuffled batch ONCE into ``saes.train_sweep`` (activations.live)."""
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

    w, comm = ranks.current(), run_comm([cfg for _, cfg in points])
    model = open_model(live, choose, resolve_device(points[0][1].device))
    hookpoints = chosen["hookpoints"]
    check_sources(points, len(hookpoints))
    runs = chosen["runs"] if cmd.layers else per_hookpoint_runs(hookpoints, points)
    names = [name for name, _, _ in runs]
    outs = _outputs(cmd.out, names, cmd)
    cfgs = [with_heldout_defaults(cfg if cfg.batch_size else dataclasses.replace(
        cfg, batch_size=default_batch_size(cfg.tokens))) for _, cfg, _ in runs]
    warn_short_runs(names, cfgs, "pass more --tokens")
    reads = [hookpoints if s is None else [hookpoints[i] for i in ([s] if isinstance(s, int) else s)]
             for _, _, s in runs]
    metas = [{"model": model.load_info, "hookpoints": hps, "level": level_of(hookpoints),
              "dataset": describe_dataset(live.dataset), "live": to_jsonable(live)} for hps in reads]
    if w.main:
        for out, cfg in zip(outs, cfgs):
            write_resolved_config({"command": to_jsonable(cmd), "live": to_jsonable(live),
                                   "train": to_jsonable(to_flat(cfg))}, out, "train_config.json")
    desc = f"model {live.model} over {live.dataset}, hookpoint {', '.join(hookpoints)}"
    models: list[SparseCoder | None] = [None] * len(cfgs)
    for (batch, seed), members in stream_groups(cfgs).items():  # one forward pass per way of batching

        def batches(start: int, batch=batch, seed=seed):
            return live_batches(live, model, hookpoints, batch, seed=seed, buffer_rows=cmd.buffer_rows,
                                start_batch=start, part=(comm.rank, comm.size),
                                gather=comm.gather_rows if comm.size > 1 else None)

        trained = train_sweep([cfgs[i] for i in members], batches, outs=[outs[i] for i in members],
                              resume=cmd.resume, metas=[metas[i] for i in members],
                              names=[names[i] for i in members], source=desc, comm=comm,
                              picks=[runs[i][2] for i in members])
        for i, m in zip(members, trained):
            models[i] = m
    return list(zip(names, outs, models))


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


def _one_or_many(trained: list[tuple[str, Path, SparseCoder]]) -> SparseCoder | dict[str, SparseCoder]:
    """The trained dictionaries as :func:`load` returns them: for inference, with their ``.config``."""
    from conceptdict.saes import load_dictionary_config

    for _, out, model in trained:
        if ranks.current().main:  # the process that wrote it
            model.config = load_dictionary_config(out)
        model.path = out
        model.requires_grad_(False).eval()
    if len(trained) == 1 and trained[0][0] == "":
        return trained[0][2]
    return {name: model for name, _, model in trained}


def load(source: str | Path | None = None, device: str = "cpu", *, release: str | None = None,
         sae_id: str | None = None) -> SparseCoder:
    """A dictionary from a directory in any format conceptdict reads (its own, SAELens, sparsify,
    dictionary_learning, Gemma Scope), a hub id ``hf:REPO[/SUBDIR][@REV]``, or a SAELens release: ``"RELEASE/SAE_ID"``
    or ``release=..., sae_id=...``. ``.config`` holds its config.json, ``.path`` where it was read from.

    ``sae.encode(x)`` -> codes [..., L], ``sae.decode(codes)`` -> [..., D], ``sae(x)`` -> reconstruction; plain
    tensors without autograd history unless gradients are enabled and the input requires them."""
    from conceptdict.saes import open_dictionary

    if (release is None) != (sae_id is None) or (release is not None) == (source is not None):
        raise ConfigError("cd.load takes a folder or name, or release= with sae_id= (SAELens's names), not both")
    source = f"{release}/{sae_id}" if release is not None else source
    model, config = open_dictionary(source, device=device)
    model.config = config
    model.path = source if str(source).startswith("hf:") or not Path(str(source)).exists() else Path(source)
    return model.requires_grad_(False).eval()
