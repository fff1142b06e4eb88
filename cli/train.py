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
    write_resolved_config,
)

HELP = "train a TopK / BatchTopK / ReLU sparse autoencoder (or crosscoder, or transcoder) on activation store(s)"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.saes import TrainConfig

    parser.add_argument("--config", type=Path, default=None,
                        help="JSON file of dictionary settings (the TrainConfig fields; flags override it)")
    add_dataclass_args(parser, TrainCommand)
    add_dataclass_args(parser, TrainConfig)


def _train_config(args: argparse.Namespace):
    from conceptdict.saes import TrainConfig

    given = read_config_file(args.config) if args.config else {}
    missing = [f"--{n}" for n in ("latents", "k") if getattr(args, n, None) is None and n not in given]
    if missing:
        raise ConfigError(f"conceptdict train needs {' and '.join(missing)} (e.g. --latents 4096 --k 32)")
    return build_config(TrainConfig, args, args.config)


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


MIN_BATCH = 8  # smaller batches make BatchTopK's per-batch selection and the held-out metrics meaningless


def _sized(cfg, rows: int):
    """Clamp the batch size to what the store holds and default tokens to one pass over the training rows."""
    from conceptdict.saes.config import heldout_batch_count

    held = heldout_batch_count(cfg)
    need = (held + 1) * cfg.batch_size
    if rows < need:
        batch = rows // (held + 4)
        if batch < MIN_BATCH:
            raise ConfigError(f"the store has {rows} rows, too few to train on: {held} batches are held out (for "
                              f"evaluation and threshold calibration) and batches need at least {MIN_BATCH} rows, "
                              f"so it needs at least {(held + 4) * MIN_BATCH} rows; cache more (--tokens), or lower "
                              f"--eval-batches / --calibration-batches")
        log.warning("store has %d rows, fewer than (held-out batches %d + 1) * batch_size = %d; using batch_size %d",
                    rows, held, need, batch)
        cfg = dataclasses.replace(cfg, batch_size=batch)
    if cfg.tokens is None:
        cfg = dataclasses.replace(cfg, tokens=(rows // cfg.batch_size - held) * cfg.batch_size)
    return cfg


def train_on_stores(cmd: TrainCommand, cfg):
    """Open the stores, size the run, stream this rank's part of every batch into ``saes.train`` (over the
    process group's seam under torchrun); returns the trained dictionary."""
    from conceptdict.activations import stream_batches
    from conceptdict.cli import ranks
    from conceptdict.saes import train
    from conceptdict.saes.config import heldout_batch_count
    from conceptdict.saes.distributed import process_group_comm

    if cmd.out is None:
        raise ConfigError("conceptdict train needs --out SAE_DIR")
    stores, hookpoints, rows, desc = open_training_data(cmd.stores, cmd.hookpoints)
    _check_out(cmd.out, cmd.resume, cmd.overwrite)
    cfg = _sized(cfg, rows)
    held = heldout_batch_count(cfg)
    per_epoch = rows // cfg.batch_size
    epochs = None if cfg.tokens > (per_epoch - held) * cfg.batch_size else 1

    w = ranks.current()

    def batches(start: int):
        # this rank's rows of every global batch (one process: every row)
        return stream_batches(stores, hookpoints, cfg.batch_size, seed=cfg.seed, epochs=epochs,
                              buffer_rows=cmd.buffer_rows, start_batch=start, part=w.part,
                              holdout_batches=held)

    meta = {"stores": [str(s.path.resolve()) for s in stores], "hookpoints": hookpoints,
            "model": stores[0].manifest.get("model", {}), "level": stores[0].level}
    if w.main:
        write_resolved_config({"command": to_jsonable(cmd), "train": to_jsonable(cfg)}, cmd.out, "train_config.json")
    return train(cfg, batches, out=cmd.out, resume=cmd.resume, meta=meta, source=desc, comm=process_group_comm())


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
    if info.get("calibrated_on_rows"):
        return (f"inference threshold {info['value']:.6g}: calibrated for mean L0 = k = {k} on "
                f"{info['calibrated_on_rows']} rows never trained on (running estimate {info['running_estimate']:.6g})")
    return f"inference threshold {info['value']:.6g}: running estimate from training batches (not calibrated)"


def run(args: argparse.Namespace) -> int:
    cmd = build_config(TrainCommand, args)
    cfg = _train_config(args)
    from conceptdict.cli import ranks

    world = ranks.join()  # under torchrun: join the job; ranks > 0 stay quiet
    model = train_on_stores(cmd, cfg)
    if world.main:
        print("\n".join(describe(model)))
        print(f"dictionary: {cmd.out}")
    return 0
