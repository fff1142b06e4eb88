"""``conceptdict eval SAE_DIR [--store STORE | --model M --dataset D]``: metrics table + eval.json."""

from pathlib import Path

import conceptdict as cd
from conceptdict import ranks
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.eval_api import EvalConfig

USAGE = "conceptdict eval SAE_DIR [--store STORE] [--model M] [--dataset D] [options]"
HELP = ("evaluate a dictionary on a store or a model's forward: L0, FVU, explained variance, dead/dense latents, "
        "CE loss recovered")


def add_arguments(parser) -> None:
    parser.add_argument("sae_dir", type=Path, help="dictionary directory in any format conceptdict reads, or "
                        "hf:REPO[/SUBDIR][@REV]")
    add_config_flag(parser)
    add_dataclass_args(parser, EvalConfig)


def run(args) -> int:
    result = cd.evaluate(args.sae_dir, **settings_from(args, EvalConfig))
    if ranks.current().main:  # under torchrun: rank 0 prints (and wrote eval.json)
        print(result.format(args.sae_dir))
        print(f"eval: {result.path}")
    return 0
