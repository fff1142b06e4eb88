"""``conceptdict steer DICT_DIR --latent ID_OR_NAME --prompt TEXT --out DIR``: add, clamp or ablate latents at the
dictionary's hookpoint and report what changes."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import ConfigError, add_config_flag, add_dataclass_args, settings_from
from conceptdict.edit_api import SteerConfig

USAGE = "conceptdict steer DICT_DIR --latent ID_OR_NAME [--prompt TEXT ...] --out DIR [options]"
HELP = "steer a model through dictionary latents (add, clamp, ablate): continuations, log-probs, similarities"


def add_arguments(parser) -> None:
    parser.add_argument("dict_dir", type=Path, help="dictionary, or concept dictionary (to steer latents by name)")
    add_config_flag(parser)
    add_dataclass_args(parser, SteerConfig)


def run(args) -> int:
    settings = settings_from(args, SteerConfig)
    if settings.get("out") is None:
        raise ConfigError("conceptdict steer needs --out DIR")
    doc = cd.steer(args.dict_dir, **settings)
    if doc["kind"] == "causal-lm":
        for p in doc["prompts"]:
            print(f"{p['prompt']!r}\n  greedy:  {p['greedy_before']!r}\n  steered: {p['greedy_after']!r}")
        for tok, shift in doc["mean_token_shift"].items():
            print(f"log-prob shift of {tok!r}: {shift:+.4f}")
    else:
        print(f"mean cosine shift to the texts: {doc['mean_cos_shift']:+.4f}")
        if doc.get("ratio") is not None:
            print(f"random directions of the same norm: {doc['random_abs_cos_shift']:.4f} (mean |shift|); "
                  f"ratio {doc['ratio']:.2f}")
    print(f"steering: {Path(settings['out']) / 'steer.json'}")
    print(f"report:   {Path(settings['out']) / 'steer.html'}")
    return 0
