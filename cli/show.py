"""``conceptdict show DICT_DIR [LATENT]``: one concept's card in the terminal, or the concepts ranked by score."""

from dataclasses import dataclass, field
from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config
from conceptdict.printing import format_concept, format_ranking

HELP = ("print one concept (by latent id or name): name, scores, namers, frequency, histogram, top contexts; "
        "without a latent, concepts ranked and filtered by score")


@dataclass
class ShowConfig:
    """Flags of ``conceptdict show``."""

    examples: int = field(default=8, metadata={"help": "Top contexts to print."})
    width: int = field(default=100, metadata={"help": "Characters per printed context."})
    sort: str = field(default="confidence", metadata={
        "help": "Without a latent: rank concepts by this (confidence or a scorer name such as embedding)."})
    min_score: float | None = field(default=None, metadata={"help": "Without a latent: only sort values >= this."})
    max_score: float | None = field(default=None, metadata={"help": "Without a latent: only sort values <= this."})
    limit: int = field(default=30, metadata={"help": "Without a latent: rows printed (0: all)."})


def add_arguments(parser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    parser.add_argument("latent", nargs="?", default=None,
                        help="latent id, or a concept name (every latent with that name is shown); without it, a "
                             "table of concepts ranked by --sort and filtered by --min-score/--max-score")
    add_dataclass_args(parser, ShowConfig)


def run(args) -> int:
    cfg = build_config(ShowConfig, args)
    concepts = cd.load_concepts(args.dict_dir)
    if args.latent is None:
        print(format_ranking(concepts, cfg.sort, cfg.min_score, cfg.max_score, cfg.limit))
        return 0
    if args.latent.lstrip("-").isdigit():
        j = int(args.latent)
        if not 0 <= j < len(concepts):
            raise ConfigError(f"latent {j} is out of range: {args.dict_dir} has latents 0..{len(concepts) - 1}")
        shown = [concepts[j]]
    else:
        try:
            shown = concepts[args.latent]
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
    print("\n\n".join(format_concept(c, cfg.examples, cfg.width) for c in shown))
    return 0
