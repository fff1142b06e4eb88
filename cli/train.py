"""``conceptdict train --store STORE --latents L --k K --out SAE_DIR``: fit a dictionary (or a sweep of them)."""

from pathlib import Path

import conceptdict as cd
from conceptdict import ranks
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.train_api import LiveConfig, TrainCommand, TrainConfig

USAGE = ("conceptdict train (--store STORE | --model M --dataset D --tokens N) [--hookpoint H] "
         "--latents L --k K [--kind KIND] --out DIR [options]")
HELP = ("train a sparse dictionary (SAE, crosscoder, transcoder) on activation stores, or straight from a model's "
        "forward (--model M --dataset D); --kind picks the kind (docs/guide/train.md)")


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, TrainCommand)
    add_dataclass_args(parser.add_argument_group("the dictionary"), TrainConfig)
    add_dataclass_args(parser.add_argument_group("training from a model (no --store)"), LiveConfig)


def run(args) -> int:
    settings = settings_from(args, TrainCommand, LiveConfig, TrainConfig)
    trained = cd.train(**settings)
    if ranks.current().main:
        many = trained if isinstance(trained, dict) else {"": trained}
        for name, model in many.items():
            print("\n".join(cd.describe(model)))
            print(f"dictionary: {Path(settings['out']) / name}")
    return 0
