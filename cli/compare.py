"""``conceptdict compare DICT... --out DIR``: several dictionaries side by side, each on its recorded store."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.eval_api import CompareConfig

USAGE = "conceptdict compare DICT [DICT ...] --out DIR [--store STORE] [options]"
HELP = "compare dictionaries on the same rows: L0, FVU, CE/KL, dead/dense, weight metrics, shared and unique latents"


def add_arguments(parser) -> None:
    parser.add_argument("dicts", nargs="+", type=Path, metavar="DICT",
                        help="dictionary directories (any format), `train --layers` folders of per-layer transcoders "
                             "(one replacement model each) or concept dictionaries from `conceptdict name`")
    add_config_flag(parser)
    add_dataclass_args(parser, CompareConfig)


def run(args) -> int:
    result = cd.compare(args.dicts, **settings_from(args, CompareConfig))
    print(result.format())
    print(f"compare: {result.paths['json']}, {result.paths['html']}")
    return 0
