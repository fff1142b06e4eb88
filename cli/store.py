"""``conceptdict store info|verify|import``: inspect, check and create activation stores."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.store_api import ImportConfig

HELP = "inspect (info), check (verify) or create from arrays (import) an activation store"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="store_command", metavar="{info,verify,import}", required=True)
    info = sub.add_parser("info", help="summary: model, hookpoints, rows, size, dtype, norm statistics")
    info.add_argument("store", type=Path, help="store directory")
    info.add_argument("--stats-rows", type=int, default=65536, help="rows sampled for the norm statistics")
    verify = sub.add_parser("verify", help="check every shard's hash and schema")
    verify.add_argument("store", type=Path, help="store directory")
    imp = sub.add_parser("import", help="turn a .npy/.npz/.safetensors array into a store (streamed)")
    imp.add_argument("array_file", type=Path, help="the array file")
    add_config_flag(imp)
    add_dataclass_args(imp, ImportConfig, skip=("array",))


def run(args) -> int:
    if args.store_command == "info":
        print(cd.store_info(args.store, stats_rows=args.stats_rows).format())
    elif args.store_command == "verify":
        store = cd.verify_store(args.store)
        print(f"ok: {store.path} ({store.num_rows:,} rows in {len(store.manifest['shards'])} shards) matches its "
              "manifest")
    else:
        store = cd.import_array(args.array_file, **settings_from(args, ImportConfig))
        print(cd.store_info(store.path).format())
    return 0
