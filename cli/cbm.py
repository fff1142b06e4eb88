"""``conceptdict cbm DICT_DIR --label-column Y --out CBM_DIR``: a concept bottleneck model beside a linear probe."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import ConfigError, add_config_flag, add_dataclass_args, settings_from
from conceptdict.concept_api import CbmConfig
from conceptdict.printing import format_cbm

USAGE = "conceptdict cbm DICT_DIR [--also DICT_DIR] [--label-column Y] [--dataset store|STORE] --out CBM_DIR [options]"
HELP = "train a sparse concept bottleneck model on a concept dictionary and compare it with a linear probe"


def add_arguments(parser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    add_config_flag(parser)
    add_dataclass_args(parser, CbmConfig)


def run(args) -> int:
    settings = settings_from(args, CbmConfig)
    if settings.get("out") is None:
        raise ConfigError("conceptdict cbm needs --out CBM_DIR")
    print(format_cbm(cd.cbm(args.dict_dir, **settings)))
    print(f"CBM:    {settings['out']}/cbm.json")
    print(f"report: {Path(settings['out']) / 'report' / 'cbm.html'}")
    return 0
