"""``conceptdict erase --store STORE --concept-column C [--target-column Y] --out DIR``: every erasure and switching
method (SAE ablation, LEACE, SPLINCE, LEACE-Switch, MidSteer) on one split, one table."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.edit_api import EraseConfig

USAGE = "conceptdict erase --store STORE --concept-column C [--target-column Y] --out DIR [options]"
HELP = "erase or switch a labelled concept with SAE ablation, LEACE, SPLINCE, LEACE-Switch and MidSteer; one table"


def add_arguments(parser) -> None:
    parser.add_argument("--store", type=Path, required=True, help="activation store with the label columns")
    add_config_flag(parser)
    parser.add_argument("--apply", type=Path, default=None, metavar="ERASER_DIR",
                        help="instead of the table: write --out as a new store, STORE with an eraser written by an "
                             "earlier run (OUT/erasers/METHOD) applied to its hookpoint")
    add_dataclass_args(parser, EraseConfig)


def run(args) -> int:
    result = cd.erase(args.store, apply=args.apply, **settings_from(args, EraseConfig))
    if args.apply is not None:
        print(f"eraser {args.apply} applied to {result.num_rows} rows of {args.store}")
        print(f"store: {result.path}")
        return 0
    print(result.format())
    print(f"table:   {result.paths['table']}")
    print(f"report:  {result.paths['report']}")
    print(f"erasers: {result.paths['erasers']}")
    return 0
