"""``conceptdict name SAE_DIR --store STORE --out DICT_DIR``: discover, then name."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

HELP = "name every latent of a dictionary and write the concept dictionary (concepts.json, report/)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming import NameConfig

    parser.add_argument("sae_dir", type=Path, help="dictionary: a directory in any format saes.formats reads "
                        "(conceptdict, SAELens, sparsify, dictionary_learning, Gemma Scope) or hf:REPO[/SUBDIR][@REV]")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, NameConfig)


def format_concepts(cd, n: int = 12) -> str:
    """A few named concepts, most frequent first, one per line."""
    firing = sorted((c for c in cd.concepts if c.frequency > 0), key=lambda c: -c.frequency)
    lines = [f"  #{c.id:<6} {c.name[:40]:<40} score {c.score:6.3f}  freq {100 * c.frequency:6.2f}%" for c in firing[:n]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import NameConfig, name_dictionary, open_sources, save_concepts, write_report

    cfg = build_config(NameConfig, args, args.config)
    if cfg.out is None:
        raise ConfigError("conceptdict name needs --out DICT_DIR")
    src = open_sources(args.sae_dir, cfg.store, cfg.hookpoint, cfg.device)
    cfg = dataclasses.replace(cfg, hookpoint=src.hookpoint, store=src.store.path)
    cd = name_dictionary(src.model, src.store, cfg)
    cd = dataclasses.replace(cd, meta={**cd.meta, "sae_dir": str(args.sae_dir)})
    save_concepts(cd, cfg.out)
    write_resolved_config(cfg, cfg.out, "name_config.json")
    index = write_report(cd, cfg.out / "report")
    dead = sum(1 for c in cd.concepts if c.frequency <= 0)
    print(f"named {len(cd.concepts)} latents with the {cd.meta['namer']} namer ({dead} never fire)")
    print(format_concepts(cd))
    print(f"concept dictionary: {cfg.out}/concepts.json")
    print(f"report:             {index}")
    return 0
