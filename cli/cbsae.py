"""``conceptdict cbsae DICT_DIR --concepts FILE --out DIR``: prune a scored dictionary, add a concept bottleneck."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config

HELP = "CB-SAE: prune low-interpretability/steerability latents and add bottleneck latents for lacking concepts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming.cbsae import CbSaeConfig

    parser.add_argument("dict_dir", type=Path, help="concept dictionary scored by `conceptdict score`")
    parser.add_argument("--label-column", default=None, help="store label column for CBM accuracy before/after")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, CbSaeConfig)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import load_concepts, open_sources, save_concepts, write_report
    from conceptdict.naming.cbsae import CbSaeConfig, config_dict, save_cbsae
    from conceptdict.naming.cbsae_run import build_cbsae, read_concept_list, summary_lines

    cfg = build_config(CbSaeConfig, args, args.config)
    if cfg.out is None or cfg.concepts is None:
        raise ConfigError("conceptdict cbsae needs --concepts FILE and --out DIR")
    cd = load_concepts(args.dict_dir)
    if not cd.meta.get("sae_dir"):
        raise ConfigError(f"{args.dict_dir} records no sae_dir; name the dictionary with `conceptdict name` first")
    src = open_sources(cd.meta["sae_dir"], cd.meta.get("store"), cd.meta.get("hookpoint"), cfg.device)
    model, scored, summary = build_cbsae(cd, src, read_concept_list(cfg.concepts), cfg,
                                         label_column=args.label_column)  # fmt: skip
    save_cbsae(model, cfg.out / "dictionary", cd.meta["sae_dir"],
               extra={"stores": [str(src.store.path)], "hookpoints": [src.hookpoint]})  # fmt: skip
    scored.meta["sae_dir"] = str(cfg.out / "dictionary")
    save_concepts(scored, cfg.out / "concepts")
    write_report(scored, cfg.out / "concepts" / "report")
    doc = {"config": config_dict(cfg), "source": str(args.dict_dir), **summary}
    (cfg.out / "cbsae.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    print("\n".join(summary_lines(summary)))
    print(f"CB-SAE:             {cfg.out}/dictionary")
    print(f"concept dictionary: {cfg.out}/concepts/concepts.json")
    print(f"summary:            {cfg.out}/cbsae.json")
    return 0
