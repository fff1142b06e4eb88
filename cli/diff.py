"""``conceptdict diff --model A --model B --hookpoint H --out DIR`` (or ``--store A --store B``): a crosscoder over
both models' activations, per-latent Delta tags and Latent Scaling flags."""

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.diff_api import DiffConfig, TrainConfig

USAGE = ("conceptdict diff (--model A --model B --hookpoint H | --store A --store B) --out DIR "
         "[training options]")
HELP = "diff two models: crosscoder over both models' activations, per-latent Delta tags and Latent Scaling flags"


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, DiffConfig)
    group = parser.add_argument_group("training (as `conceptdict train`; default --kind crosscoder)")
    add_dataclass_args(group, TrainConfig, skip=("d_in",))


def run(args) -> int:
    print(cd.diff(**settings_from(args, DiffConfig, TrainConfig)).format())
    return 0
