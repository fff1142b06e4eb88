"""``conceptdict score DICT_DIR [--scorer NAME ...] [--namer NAME ...]``: score every name, in place."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.concept_api import ScoreConfig
from conceptdict.printing import format_scores

USAGE = "conceptdict score DICT_DIR [--scorer NAME ...] [--namer NAME ...] [options]"
HELP = "score each concept's name (embedding AUROC, LLM detection/fuzzing) against random and hard negatives"


def add_arguments(parser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    add_config_flag(parser)
    add_dataclass_args(parser, ScoreConfig)


def run(args) -> int:
    scored = cd.score(args.dict_dir, in_memory=False, **settings_from(args, ScoreConfig))  # a block at a time
    print(format_scores(scored))
    print(f"concept dictionary: {args.dict_dir}/concepts.json")
    print(f"report:             {Path(args.dict_dir) / 'report' / 'index.html'}")
    return 0
