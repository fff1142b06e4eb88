"""``conceptdict train --store STORE --latents L --k K --out SAE_DIR``: fit a dictionary (or a sweep of them)."""

from pathlib import Path

import conceptdict as cd
from conceptdict import ranks
from conceptdict.cli.args import BRIEF, add_config_flag, add_dataclass_args, add_train_settings, settings_from
from conceptdict.train_api import LiveConfig, TrainCommand, train_settings

USAGE = ("conceptdict train (--store STORE | --model M --dataset D --tokens N) [--hookpoint H] "
         "--latents L --k K [--kind KIND] --out DIR [options]")
HELP = ("train a sparse dictionary (SAE, crosscoder, transcoder) on activation stores, or straight from a model's "
        "forward (--model M --dataset D); --kind picks the kind (docs/guide/train.md)")


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, TrainCommand)
    add_train_settings(parser)
    live = parser.add_argument_group("training from a model (no --store)")
    more = add_dataclass_args(live, LiveConfig, brief=BRIEF)
    if more:
        live.description = f"also `cache`'s data flags: {' '.join(more)}"


def run(args) -> int:
    settings = settings_from(args, TrainCommand, LiveConfig, train_settings())
    trained = cd.train(**settings)
    if ranks.current().main:
        many = trained if isinstance(trained, cd.Sweep) else {"": trained}
        for name, model in many.items():
            print("\n".join(cd.describe(model)))
            print(f"dictionary: {Path(settings['out']) / name}")
        if isinstance(trained, cd.Sweep):  # one table of every point at the end
            print(f"\n{len(trained)} dictionaries:\n{trained.format()}")
    return 0
