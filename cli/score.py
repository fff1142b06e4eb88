"""``conceptdict score DICT_DIR [--scorer NAME ...] [--namer NAME ...]``: score every name, in place."""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptdict.cli.args import add_dataclass_args, build_config, write_resolved_config

HELP = "score each concept's name (embedding AUROC, LLM detection/fuzzing) against random and hard negatives"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming.scoring import ScoreConfig

    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, ScoreConfig)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import load_concepts, save_concepts, write_report
    from conceptdict.naming.score_run import prepare_context, score_concepts
    from conceptdict.naming.scoring import ScoreConfig, format_summary

    cfg = build_config(ScoreConfig, args, args.config)
    cd = load_concepts(args.dict_dir)
    ctx = prepare_context(cd, cfg, workdir=args.dict_dir)
    scored = score_concepts(cd, cfg, ctx)
    save_concepts(scored, args.dict_dir)
    write_resolved_config(cfg, args.dict_dir, "score_config.json")
    index = write_report(scored, Path(args.dict_dir) / "report")
    info = scored.meta["scoring"]
    print(f"scored {info['scored_latents']} latents with {', '.join(info['scorers'])} "
          f"(negatives: {cfg.negatives.kinds}; namers: {', '.join(info['namers'])})")
    print(format_summary(info["summary"]))
    if "llm_calls" in ctx.options:
        print(ctx.options["llm_calls"].usage.line(cfg.llm))
    print(f"concept dictionary: {args.dict_dir}/concepts.json")
    print(f"report:             {index}")
    return 0
