"""``conceptdict show DICT_DIR LATENT_ID``: one concept's card in the terminal."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config

HELP = "print one concept (by latent id or name): name, score, frequency, histogram, top contexts"

BARS = " ▁▂▃▄▅▆▇█"


@dataclass
class ShowConfig:
    """Flags of ``conceptdict show``."""

    examples: int = 8
    """Top contexts to print."""
    width: int = 100
    """Characters per printed context."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    parser.add_argument("latent", help="latent id, or a concept name (every latent with that name is shown)")
    add_dataclass_args(parser, ShowConfig)


def sparkline(counts: list[float]) -> str:
    top = max(counts, default=0)
    if top <= 0:
        return "(never fires)"
    return "".join(BARS[min(len(BARS) - 1, round((len(BARS) - 1) * c / top + 0.49 * (c > 0)))] for c in counts)


def format_concept(c, cfg: ShowConfig) -> str:
    lines = [f"#{c.id}  {c.name or '(unnamed)'}   [{c.namer} score {c.score:.3f}]"]
    if c.runner_ups:
        lines.append("also:       " + ", ".join(f"{n} ({s:.3f})" for n, s in zip(c.runner_ups, c.runner_up_scores)))
    lines.append(f"frequency:  {100 * c.frequency:.3f}% of rows" + ("  (dead)" if c.extra.get("dead") else ""))
    stats = "  ".join(f"{k} {v:.4g}" for k, v in c.stats.items())
    lines.append(f"stats:      {stats}")
    edges = c.histogram.get("edges") or [0.0]
    lines.append(f"histogram:  0 {sparkline(c.histogram.get('counts', []))} {edges[-1]:.3g}")
    if c.logit_top:
        lines.append("promotes:   " + " ".join(repr(t) for t in c.logit_top))
        lines.append("suppresses: " + " ".join(repr(t) for t in c.logit_bottom))
    extra = {k: v for k, v in c.extra.items() if k != "dead"}
    if extra:
        lines.append("extra:      " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    lines.append("top contexts (activating token in «»):")
    for e in c.top_examples[: cfg.examples]:
        text = " ".join(e.marked_text("«", "»").split())
        lines.append(f"  {e.activation:8.4g}  {text[: cfg.width]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import load_concepts

    cfg = build_config(ShowConfig, args)
    cd = load_concepts(args.dict_dir)
    if args.latent.isdigit():
        j = int(args.latent)
        if not 0 <= j < len(cd.concepts):
            raise ConfigError(f"latent {j} is out of range: {args.dict_dir} has latents 0..{len(cd.concepts) - 1}")
        ids = [j]
    else:
        try:
            ids = cd.ids_named(args.latent)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
    print("\n\n".join(format_concept(cd.concepts[j], cfg) for j in ids))
    return 0
