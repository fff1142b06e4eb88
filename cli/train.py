"""``conceptdict train --store STORE [--hookpoint H] --latents L --k K --out SAE_DIR``: fit a dictionary."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

from conceptdict.cli.args import (
    ConfigError,
    add_dataclass_args,
    build_config,
    read_config_file,
    to_jsonable,
    train_config_from_flags,
    train_flags,
    write_resolved_config,
)

HELP = ("train a TopK / BatchTopK / ReLU sparse autoencoder (or crosscoder, or transcoder) on activation store(s), "
        "or straight from a model's forward (--model M --dataset D, no store)")
log = logging.getLogger(__name__)


@dataclass
class TrainCommand:
    """Where ``conceptdict train`` reads and writes (the dictionary's own settings are TrainConfig)."""

    stores: list[Path] = field(default_factory=list, metadata={"flag": "store"})
    """Activation store(s); several stores over the same tokens train a crosscoder over them."""
    hookpoints: list[str] = field(default_factory=list, metadata={"flag": "hookpoint"})
    """Hookpoint(s) to train on; default: the store's only hookpoint. Several: a crosscoder across them; a
    transcoder takes two, the component's input then its output (e.g. blocks.0.mlp.hook_in blocks.0.mlp.hook_out)."""
    out: Path | None = None
    """Output directory for the dictionary (config.json, weights.safetensors, checkpoint, metrics)."""
    resume: bool = False
    """Continue an interrupted run from OUT/checkpoint.pt (same settings); ends with the same weights."""
    overwrite: bool = False
    """Replace a dictionary already in OUT instead of refusing."""
    buffer_rows: int = 65536
    """Rows in the shuffle buffer of the training stream."""
    sweep: list[str] = field(default_factory=list, metadata={"flag": "sweep"})
    """FIELD=V1,V2,... (repeatable): train one dictionary per combination of the values (e.g. --sweep
    k=16,32 --sweep kind=topk,batchtopk: four), all on ONE pass over the data, each with its own optimizer,
    checkpoint, resume and folder OUT/FIELD-VALUE_FIELD-VALUE; each equals its separate run bit for bit.
    Fields that change the batches (batch_size, tokens, seed, eval_batches) cannot be swept."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.activations.live import LiveConfig

    parser.add_argument("--config", type=Path, default=None,
                        help="JSON file of dictionary settings (the TrainConfig fields; flags override it)")
    add_dataclass_args(parser, TrainCommand)
    add_dataclass_args(parser, train_flags())
    add_dataclass_args(parser.add_argument_group("training from a model (no --store)"), LiveConfig)


def _train_config(args: argparse.Namespace):
    given = read_config_file(args.config) if args.config else {}
    missing = [f"--{n}" for n in ("latents", "k") if getattr(args, n, None) is None and n not in given]
    if missing:
        raise ConfigError(f"conceptdict train needs {' and '.join(missing)} (e.g. --latents 4096 --k 32)")
    return train_config_from_flags(args, args.config)


def open_training_data(stores: list[Path], hookpoints: list[str]):
    """(ActivationStore list, hookpoint list, rows, description) after checking they fit together."""
    from conceptdict.activations import ActivationStore
    from conceptdict.activations.summary import check_signal

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
    from conceptdict.saes.artifact import CONFIG_FILE

    if (out / CONFIG_FILE).exists() and not (resume or overwrite):
        raise FileExistsError(f"{out} already holds a dictionary; pass --overwrite to replace it or --resume")


SWEEP_FIXED = ("batch_size", "tokens", "seed", "eval_batches", "device")
"""TrainConfig fields a sweep cannot vary: they change the batches (the stream's seed is the run's seed)."""


def sweep_points(cmd: TrainCommand, cfg) -> list[tuple[str, object]]:
    """[(name, TrainConfig)]: the one config without ``--sweep``, else every combination of its values."""
    from conceptdict.cli.args import parse_field_values
    from conceptdict.saes.config import sweep_configs

    if not cmd.sweep:
        return [("", cfg)]
    grid = dict(parse_field_values(train_flags(), spec, "--sweep") for spec in cmd.sweep)
    fixed = sorted(set(grid) & set(SWEEP_FIXED))
    if fixed:
        raise ConfigError(f"--sweep {fixed[0]}: {', '.join(SWEEP_FIXED)} change the batches every dictionary of a "
                          f"sweep shares; run separate trainings for them")
    if len(cmd.sweep) != len(grid):
        raise ConfigError(f"--sweep names a field twice ({', '.join(cmd.sweep)}); give each field once")
    return sweep_configs(cfg, grid)


def _stream_plan(cfgs: list, rows: int) -> tuple[int | None, int]:
    """(epochs, held-out batches) of the one stream every dictionary of the run reads."""
    from conceptdict.saes.config import heldout_batch_count, one_pass_rows

    helds = {heldout_batch_count(c) for c in cfgs}
    repeat = any(c.tokens > one_pass_rows(c, rows) for c in cfgs)
    if repeat and len(helds) > 1:
        raise ConfigError(f"these dictionaries hold out different numbers of batches ({sorted(helds)}: thresholded "
                          f"kinds add --calibration-batches) and --tokens asks for more than one pass over the store, "
                          f"whose later epochs leave the held-out rows out; sweep them with the same held-out count "
                          f"(--calibration-batches 0) or one pass")
    return (None if repeat else 1), max(helds)


def _one_pass(cfg, rows: int):
    """``cfg`` reading one pass over the store's training rows: a sweep whose dictionaries hold out different numbers
    of batches cannot repeat the stream (its later passes leave out every held-out row, so a dictionary would differ
    from its separate run), so their default length (``saes.config.default_tokens``) falls back to one pass."""
    from conceptdict.saes.config import one_pass_rows

    tokens = one_pass_rows(cfg, rows)
    if tokens < cfg.tokens:
        log.warning("%s: one pass over the store (%d rows, not the default %d): this sweep's dictionaries hold out "
                    "different numbers of batches; for more passes give --tokens and --calibration-batches 0",
                    cfg.kind, tokens, cfg.tokens)
    return dataclasses.replace(cfg, tokens=tokens)


def train_on_stores(cmd: TrainCommand, points: list[tuple[str, object]]):
    """Open the stores, size the runs, stream this rank's part of every batch ONCE into ``saes.train_sweep``
    (one dictionary, or one per sweep point, each in OUT/NAME; over the process group's seam under torchrun);
    returns (their output directories, the trained dictionaries)."""
    from conceptdict.activations import stream_batches
    from conceptdict.cli import ranks
    from conceptdict.saes import to_flat
    from conceptdict.saes.config import fit_to_store, heldout_batch_count, resolve_device
    from conceptdict.saes.distributed import process_group_comm
    from conceptdict.saes.training import train_sweep

    if cmd.out is None:
        raise ConfigError("conceptdict train needs --out SAE_DIR")
    stores, hookpoints, rows, desc = open_training_data(cmd.stores, cmd.hookpoints)
    outs = [cmd.out / name if name else cmd.out for name, _ in points]
    for out in outs:
        _check_out(out, cmd.resume, cmd.overwrite)
    cfgs = [fit_to_store(cfg, rows) for _, cfg in points]
    smallest = min(c.batch_size for c in cfgs)  # a small store clamps the batch by the held-out count
    cfgs = [c if c.batch_size == smallest else fit_to_store(dataclasses.replace(cfg, batch_size=smallest), rows)
            for c, (_, cfg) in zip(cfgs, points)]
    if len({heldout_batch_count(c) for c in cfgs}) > 1:
        cfgs = [_one_pass(c, rows) if cfg.tokens is None else c for c, (_, cfg) in zip(cfgs, points)]
    epochs, held = _stream_plan(cfgs, rows)
    first, w = cfgs[0], ranks.current()
    device = resolve_device(first.device)

    def batches(start: int):
        # this rank's rows of every global batch (one process: every row), read ahead by a background thread,
        # moved to the training device in the store's dtype and converted there
        return stream_batches(stores, hookpoints, first.batch_size, seed=first.seed, epochs=epochs,
                              buffer_rows=cmd.buffer_rows, start_batch=start, part=w.part,
                              holdout_batches=held, device=device)

    meta = {"stores": [str(s.path.resolve()) for s in stores], "hookpoints": hookpoints,
            "model": stores[0].manifest.get("model", {}), "level": stores[0].level}
    if w.main:
        for out, cfg in zip(outs, cfgs):
            write_resolved_config({"command": to_jsonable(cmd), "train": to_flat(cfg)}, out, "train_config.json")
    return outs, train_sweep(cfgs, batches, outs=outs, resume=cmd.resume, metas=[meta] * len(cfgs),
                             names=[name for name, _ in points], source=desc, comm=process_group_comm())


def _live_runs(cmd: TrainCommand, points: list[tuple[str, object]]) -> list[tuple[str, object, int | None]]:
    """[(name, TrainConfig, source)]: every sweep point on every hookpoint (a dictionary each, in OUT/HOOKPOINT),
    or on all of them at once for a kind that reads several (crosscoder, transcoder)."""
    from conceptdict.saes import reads_several_sources

    multi = {reads_several_sources(c.kind) for _, c in points}
    if len(cmd.hookpoints) == 1 or multi == {True}:
        return [(name, cfg, None) for name, cfg in points]
    if multi != {False}:
        raise ConfigError("a sweep over --model's hookpoints cannot mix kinds that read every hookpoint (crosscoder, "
                          "transcoder) with kinds trained on each; run them separately")
    return [(f"{hp}/{name}" if name else hp, cfg, s) for s, hp in enumerate(cmd.hookpoints) for name, cfg in points]


def train_from_model(cmd: TrainCommand, live, points: list[tuple[str, object]]):
    """Run ``live.model`` over ``live.dataset`` (each rank its forward batches) and stream this rank's part of
    every shuffled batch ONCE into ``saes.train_sweep`` (activations.live); returns (outputs, dictionaries)."""
    from conceptdict.activations.data import describe_dataset
    from conceptdict.activations.live import level_of, live_batches, open_model
    from conceptdict.cli import ranks
    from conceptdict.saes import to_flat
    from conceptdict.saes.config import default_batch_size, resolve_device
    from conceptdict.saes.distributed import process_group_comm
    from conceptdict.saes.training import train_sweep

    if cmd.stores:
        raise ConfigError("give --store (train on a cached store) or --model (train from the model's forward), "
                          "not both")
    if cmd.out is None or not cmd.hookpoints:
        raise ConfigError("conceptdict train --model needs --hookpoint H (repeatable) and --out SAE_DIR")
    if any(cfg.tokens is None for _, cfg in points):
        raise ConfigError("conceptdict train --model needs --tokens N: the activation rows to train on (the dataset "
                          "is read once, so it must hold at least N + held-out rows)")
    runs = _live_runs(cmd, points)
    outs = [cmd.out / name if name else cmd.out for name, _, _ in runs]
    for out in outs:
        _check_out(out, cmd.resume, cmd.overwrite)
    cfgs = [cfg if cfg.batch_size else dataclasses.replace(cfg, batch_size=default_batch_size(cfg.tokens))
            for _, cfg, _ in runs]
    first, w, comm = cfgs[0], ranks.current(), process_group_comm()
    model = open_model(live, cmd.hookpoints, resolve_device(first.device))

    def batches(start: int):
        return live_batches(live, model, cmd.hookpoints, first.batch_size, seed=first.seed,
                            buffer_rows=cmd.buffer_rows, start_batch=start, part=w.part,
                            gather=comm.gather_rows if w.size > 1 else None)

    metas = [{"model": model.load_info, "hookpoints": [cmd.hookpoints[s]] if s is not None else cmd.hookpoints,
              "level": level_of(cmd.hookpoints), "dataset": describe_dataset(live.dataset),
              "live": to_jsonable(live)} for _, _, s in runs]
    if w.main:
        for out, cfg in zip(outs, cfgs):
            write_resolved_config({"command": to_jsonable(cmd), "live": to_jsonable(live), "train": to_flat(cfg)},
                                  out, "train_config.json")
    desc = f"model {live.model} over {live.dataset}, hookpoint {', '.join(cmd.hookpoints)}"
    return outs, train_sweep(cfgs, batches, outs=outs, resume=cmd.resume, metas=metas,
                             names=[name for name, _, _ in runs], source=desc, comm=comm,
                             picks=[s for _, _, s in runs])


def describe(model) -> list[str]:
    """Lines for the terminal: what was trained and its held-out evaluation table."""
    from conceptdict.saes import EvalResult, format_table

    summary = model.training_summary or {}
    lines = [f"trained {model.kind} dictionary: D={model.d_in}, L={model.n_latents}, k={model.k}, "
             f"sources={model.n_sources}, {summary.get('steps')} steps, {summary.get('rows')} rows"]
    held = summary.get("heldout_eval")
    if held:
        lines += ["held-out evaluation:", format_table(EvalResult(**held))]
    line = threshold_line(summary, model.k)
    return lines + ([line] if line else [])


def threshold_line(summary: dict, k: int) -> str | None:
    """How a thresholded dictionary's inference threshold was set (``training.threshold`` in config.json)."""
    info = (summary or {}).get("threshold")
    if not info:
        return None
    if info["rule"].startswith("learned per latent"):
        how = (f"scaled by one factor {info['factor']:.4g} for mean L0 = k = {k} on {info['calibrated_on_rows']} rows "
               "never trained on" if info.get("calibrated_on_rows") else "as trained (not calibrated)")
        return f"inference thresholds learned per latent (mean {info['mean']:.6g}), {how}"
    if info.get("calibrated_on_rows"):
        return (f"inference threshold {info['value']:.6g}: calibrated for mean L0 = k = {k} on "
                f"{info['calibrated_on_rows']} rows never trained on (running estimate {info['running_estimate']:.6g})")
    return f"inference threshold {info['value']:.6g}: running estimate from training batches (not calibrated)"


def run(args: argparse.Namespace) -> int:
    cmd = build_config(TrainCommand, args)
    cfg = _train_config(args)
    from conceptdict.activations.live import LiveConfig
    from conceptdict.cli import ranks

    live = build_config(LiveConfig, args)
    if live.dataset and not live.model:
        raise ConfigError("--dataset is read through a model: add --model M (or drop --dataset and train on --store)")
    world = ranks.join()  # under torchrun: join the job; ranks > 0 stay quiet
    points = sweep_points(cmd, cfg)
    outs, models = train_from_model(cmd, live, points) if live.model else train_on_stores(cmd, points)
    if world.main:
        for out, model in zip(outs, models):
            print("\n".join(describe(model)))
            print(f"dictionary: {out}")
    return 0
