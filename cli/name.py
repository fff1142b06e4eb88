"""``conceptdict name SAE_DIR --store STORE --out DICT_DIR``: discover, then name."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import ConfigError, add_config_flag, add_dataclass_args, settings_from
from conceptdict.concept_api import NameConfig
from conceptdict.printing import format_concepts

USAGE = ("conceptdict name SAE_DIR [--store STORE] [--namer vocab|context|logit-lens|llm] --out "
         "DICT_DIR [options]")
HELP = "name every latent of a dictionary and write the concept dictionary (concepts.json, report/)"


def add_arguments(parser) -> None:
    parser.add_argument("sae_dir", type=Path, help="dictionary directory in any format conceptdict reads, or "
                        "hf:REPO[/SUBDIR][@REV]")
    add_config_flag(parser)
    add_dataclass_args(parser, NameConfig)


def run(args) -> int:
    settings = settings_from(args, NameConfig)
    if settings.get("out") is None:
        raise ConfigError("conceptdict name needs --out DICT_DIR")
    named = cd.name(args.sae_dir, in_memory=False, **settings)  # written a block at a time
    print(f"named {len(named)} latents with the {named.meta['namer']} namer ({named.dead} never fire)")
    print(format_concepts(named.most_frequent))
    print(f"concept dictionary: {settings['out']}/concepts.json")
    print(f"report:             {Path(settings['out']) / 'report' / 'index.html'}")
    return 0
