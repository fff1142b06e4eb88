"""``conceptdict show DICT_DIR LATENT_ID``: one concept's card in the terminal."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config

HELP = ("print one concept (by latent id or name): name, scores, namers, frequency, histogram, top contexts; "
        "without a latent, concepts ranked and filtered by score")

BARS = " ▁▂▃▄▅▆▇█"


@dataclass
class ShowConfig:
    """Flags of ``conceptdict show``."""

    examples: int = 8
    """Top contexts to print."""
    width: int = 100
    """Characters per printed context."""
    sort: str = "confidence"
    """Without a latent: rank concepts by this (confidence or a scorer name such as embedding)."""
    min_score: float | None = None
    """Without a latent: show only concepts whose sort value is at least this."""
    max_score: float | None = None
    """Without a latent: show only concepts whose sort value is at most this."""
    limit: int = 30
    """Without a latent: rows printed (0: all)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    parser.add_argument("latent", nargs="?", default=None,
                        help="latent id, or a concept name (every latent with that name is shown); without it, a "
                             "table of concepts ranked by --sort and filtered by --min-score/--max-score")
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
    if c.scores or c.confidence is not None:
        conf = "–" if c.confidence is None else f"{c.confidence:.3f}"
        lines.append(f"confidence: {conf}")
        for scorer, m in c.scores.items():
            shown = ", ".join(f"{k}={_short(v)}" for k, v in m.items() if k != "score")
            lines.append(f"score:      {scorer} {_short(m.get('score'))}  ({shown})")
    for namer, entry in c.names.items():
        scored = ", ".join(f"{k} {_short(v.get('score'))}" for k, v in entry.get("scores", {}).items())
        lines.append(f"namer:      {namer}: {entry.get('name', '')!r} {scored}")
    extra = {k: v for k, v in c.extra.items() if k != "dead"}
    if extra:
        lines.append("extra:      " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    lines.append("top contexts (activating token in «»):")
    for e in c.top_examples[: cfg.examples]:
        text = " ".join(e.marked_text("«", "»").split())
        lines.append(f"  {e.activation:8.4g}  {text[: cfg.width]}")
    return "\n".join(lines)


def _short(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def format_ranking(cd, cfg: ShowConfig) -> str:
    """One line per concept: id, name, confidence and every scorer's score, ranked by ``cfg.sort``."""
    from conceptdict.naming.report_scores import key_of, scorer_names

    scorers = scorer_names(cd)
    if cfg.sort != "confidence" and cfg.sort not in scorers:
        raise ConfigError(f"--sort {cfg.sort!r} is not confidence or a scorer of this dictionary ({scorers or 'none'})"
                          "; run `conceptdict score` first or pick one of those")
    rows = [(key_of(c, cfg.sort), c) for c in cd.concepts]
    rows = [(k, c) for k, c in rows if k is not None and (cfg.min_score is None or k >= cfg.min_score)
            and (cfg.max_score is None or k <= cfg.max_score)]  # fmt: skip
    rows.sort(key=lambda kc: (-kc[0], kc[1].id))
    head = f"{'id':>6}  {'name':30s} {'confidence':>10}" + "".join(f" {s:>10.10}" for s in scorers) + "  other namers"
    lines = [head]
    for _, c in rows[: cfg.limit or None]:
        cells = "".join(f" {_short(c.scores.get(s, {}).get('score')):>10}" for s in scorers)
        others = ", ".join(f"{n}: {e.get('name')}" for n, e in c.names.items() if e.get("name") != c.name)
        lines.append(f"{c.id:>6}  {c.name[:30]:30s} {_short(c.confidence):>10}{cells}  {others}")
    lines.append(f"{len(rows)} concepts match (sorted by {cfg.sort})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import load_concepts

    cfg = build_config(ShowConfig, args)
    cd = load_concepts(args.dict_dir)
    if args.latent is None:
        print(format_ranking(cd, cfg))
        return 0
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
