"""``conceptdict cbsae DICT_DIR --concepts FILE --out DIR``: prune a scored dictionary, add a concept bottleneck."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.concept_api import CbSaeConfig

USAGE = "conceptdict cbsae DICT_DIR --concepts FILE --out DIR [options]"
HELP = "CB-SAE: prune low-interpretability/steerability latents and add bottleneck latents for lacking concepts"


def add_arguments(parser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary scored by `conceptdict score`")
    parser.add_argument("--label-column", default=None, help="store label column for CBM accuracy before/after")
    add_config_flag(parser)
    add_dataclass_args(parser, CbSaeConfig)


def run(args) -> int:
    result = cd.cbsae(args.dict_dir, label_column=args.label_column, **settings_from(args, CbSaeConfig))
    print(result.format())
    print(f"CB-SAE:             {result.dictionary}")
    print(f"concept dictionary: {result.concepts}/concepts.json")
    print(f"summary:            {result.dictionary.parent}/cbsae.json")
    return 0
