"""``conceptdict cache``: capture a model's activations over a dataset into an activation store."""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

HELP = "cache a model's activations at one or more hookpoints over a dataset into a store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.activations import CacheConfig

    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, CacheConfig)


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import ActivationStore, CacheConfig, store_summary
    from conceptdict.activations.distributed import cache_distributed
    from conceptdict.cli import ranks
    from conceptdict.cli.store import format_summary

    w = ranks.join()  # a no-op unless torchrun started several ranks
    try:
        cfg = build_config(CacheConfig, args, args.config)
    except TypeError as e:  # a required field given neither as a flag nor in --config
        raise ConfigError(f"{e}; `conceptdict cache` needs --model, --hookpoint, --dataset and --out") from None
    # cache_activations(cfg) with one rank
    out = cache_distributed(cfg, rank=w.rank, world_size=w.size, barrier=ranks.barrier)
    if w.main:
        write_resolved_config(cfg, out, "cache_config.json")
        print(format_summary(store_summary(ActivationStore(out))))
    return 0
