"""``conceptdict store info|verify|import``: inspect, check and create activation stores."""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptdict.cli.args import add_dataclass_args, build_config, write_resolved_config

HELP = "inspect (info), check (verify) or create from arrays (import) an activation store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.activations.importer import ImportConfig

    sub = parser.add_subparsers(dest="store_command", metavar="{info,verify,import}", required=True)
    info = sub.add_parser("info", help="summary: model, hookpoints, rows, size, dtype, norm statistics")
    info.add_argument("store", type=Path, help="store directory")
    info.add_argument("--stats-rows", type=int, default=65536, help="rows sampled for the norm statistics")
    verify = sub.add_parser("verify", help="check every shard's hash and schema")
    verify.add_argument("store", type=Path, help="store directory")
    imp = sub.add_parser("import", help="turn a .npy/.npz/.safetensors array into a store (streamed)")
    imp.add_argument("array_file", type=Path, help="the array file")
    imp.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(imp, ImportConfig, skip=("array",))


def format_summary(summary) -> str:
    """The lines `store info` prints for a :class:`StoreSummary`."""
    lines = [
        f"store       {summary.path}",
        f"model       {summary.model}",
        f"level       {summary.level} ({summary.rows:,} rows, {summary.shards} shards, "
        f"{summary.size_bytes / 1e6:.1f} MB, {summary.dtype})",
        f"dataset     {summary.dataset}",
    ]
    if summary.label_keys:
        lines.append(f"labels      {', '.join(summary.label_keys)}")
    for hp in summary.hookpoints:
        lines.append(f"hookpoint   {hp.name}  D={hp.d}  norm mean={hp.norm_mean:.4g} std={hp.norm_std:.4g} "
                     f"min={hp.norm_min:.4g} max={hp.norm_max:.4g} (over {hp.rows_sampled:,} rows)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import ActivationStore, store_summary
    from conceptdict.activations.importer import ImportConfig, import_array

    if args.store_command == "info":
        print(format_summary(store_summary(ActivationStore(args.store), max_rows=args.stats_rows)))
        return 0
    if args.store_command == "verify":
        store = ActivationStore(args.store)
        store.verify()
        print(f"ok: {store.path} ({store.num_rows:,} rows in {len(store.manifest['shards'])} shards) matches its manifest")
        return 0
    args.array = args.array_file
    cfg = build_config(ImportConfig, args, args.config)
    out = import_array(cfg)
    write_resolved_config(cfg, out, "import_config.json")
    print(format_summary(store_summary(ActivationStore(out))))
    return 0
