"""``conceptdict diff --model A --model B --hookpoint H --out DIR`` (or ``--store A --store B``): a crosscoder over
both models' activations, per-latent Delta tags and Latent Scaling flags."""

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, add_train_settings, settings_from
from conceptdict.diff_api import DiffConfig
from conceptdict.train_api import train_settings

USAGE = ("conceptdict diff (--model A --model B --hookpoint H | --store A --store B) --out DIR "
         "[training options]")
HELP = "diff two models: crosscoder over both models' activations, per-latent Delta tags and Latent Scaling flags"


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, DiffConfig)
    add_train_settings(parser, skip=("d_in",))  # as `conceptdict train`'s; --kind defaults to crosscoder here


def run(args) -> int:
    print(cd.diff(**settings_from(args, DiffConfig, train_settings())).format())
    return 0
