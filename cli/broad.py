"""``conceptdict broad``: the broad dictionary of a model at a hookpoint, built once and cached."""

import conceptdict as cd
from conceptdict.broad_api import BroadConfig
from conceptdict.cli.args import add_config_flag, add_dataclass_args, settings_from

HELP = ("build (once; cached) the broad dictionary of a model: trained and named on the docstrings, man pages and "
        "package synopses this machine has, for `cbm --dataset STORE` on any task's store at its hookpoint")


def add_arguments(parser) -> None:
    add_config_flag(parser)
    add_dataclass_args(parser, BroadConfig)


def run(args) -> int:
    broad = cd.broad_dictionary(**settings_from(args, BroadConfig))
    info = broad.info
    how = "built" if broad.built else "cached"
    print(f"broad dictionary ({how}): {info['latents']} latents, k {info['k']}, trained {info['steps']} steps "
          f"(upper bound {info['upper_bound']}) on {broad.texts} texts {info['sources']}, held-out FVU "
          f"{info['heldout_fvu']:.3f}")
    print(f"dictionary: {broad.sae}")
    print(f"concepts:   {broad.concepts}")
    print(f"use:        conceptdict cbm {broad.concepts} --dataset STORE --label-column Y --out CBM_DIR")
    return 0
