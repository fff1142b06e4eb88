"""``conceptdict cache``: capture a model's activations over a dataset into an activation store."""

import conceptdict as cd
from conceptdict import ranks
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from
from conceptdict.store_api import CacheConfig

USAGE = "conceptdict cache --model M --hookpoint H [--hookpoint H2 ...] --dataset D --out STORE [options]"
HELP = "cache a model's activations at one or more hookpoints over a dataset into a store"


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, CacheConfig)


def run(args) -> int:
    store = cd.cache(**settings_from(args, CacheConfig))
    if ranks.current().main:
        print(cd.store_info(store.path).format())
    return 0
