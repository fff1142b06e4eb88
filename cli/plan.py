"""``conceptdict plan``: a training run's memory per rank before it starts, and the shard count that fits."""

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.plan_api import PlanConfig

HELP = ("memory per rank of a training run before it starts (weights, gradients, Adam, buffers, peak) and, with "
        "--device-gib, the smallest --latent-shards that fits")


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, PlanConfig)


def run(args) -> int:
    print(cd.plan(**settings_from(args, PlanConfig)).format())
    return 0
