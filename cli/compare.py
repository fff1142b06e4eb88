"""``conceptdict compare DICT... --store STORE --out DIR``: several dictionaries on the same rows, side by side.

Each DICT is a dictionary directory (any format ``saes.formats`` reads) or a concept dictionary made by
``conceptdict name`` (its names then join the comparison). The rows are the batches the first dictionary's
``conceptdict train`` held out when it was trained on STORE (the same rows for every dictionary, each at its
own hookpoints), else the first ``--rows`` rows of STORE. The metrics are ``saes.compare``'s (each
dictionary's evaluation equals ``conceptdict eval``'s on the same rows); the table is printed and written to
DIR/compare.json, the page to DIR/index.html (naming.compare).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, to_jsonable

HELP = "compare dictionaries on the same rows: L0, FVU, CE/KL, dead/dense, weight metrics, shared and unique latents"
log = logging.getLogger(__name__)


@dataclass
class CompareConfig:
    """Flags of ``conceptdict compare``."""

    store: Path | None = None
    """Store whose rows every dictionary reads (it must hold each dictionary's hookpoints)."""
    out: Path | None = None
    """Output directory: compare.json and index.html."""
    model: str | None = None
    """Causal language model for CE loss recovered / KL score (each dictionary spliced in at its hookpoint)."""
    rows: int = 16384
    """Compare on at most this many rows."""
    batch_size: int = 4096
    """Rows per batch when reading the first rows of the store."""
    contexts: int = 32
    """Contexts for the spliced CE/KL evaluation (with --model); 0 skips it."""
    match_threshold: float = 0.7
    """Decoder cosine at which two latents of different dictionaries count as the same direction."""
    device: str = "cpu"
    """Device for the dictionaries and the model."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dicts", nargs="+", type=Path, metavar="DICT",
                        help="dictionary directories (any format) or concept dictionaries from `conceptdict name`")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, CompareConfig)


def _dictionary_of(path: Path) -> tuple[Path, list[str] | None]:
    """(dictionary directory, concept names or None) for a dictionary or a concept dictionary."""
    from conceptdict.naming import is_concept_dir, load_concepts

    if not is_concept_dir(path):
        return path, None
    cd = load_concepts(path)
    sae_dir = cd.meta.get("sae_dir")
    if not sae_dir or not Path(sae_dir).exists():
        raise ValueError(f"concept dictionary {path} records sae_dir={sae_dir!r}, which does not exist; pass the "
                         f"dictionary directory instead")
    return Path(sae_dir), cd.names


def _labels(paths: list[Path]) -> list[str]:
    """Short distinct names: the folder names, with their parent's where two are alike."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def _entries(paths: list[Path], cfg: CompareConfig):
    """saes.compare entries on the same rows, the rows' origin, and each dictionary's EvalConfig."""
    from conceptdict.cli.eval_cmd import EvalConfig, heldout_recipe, open_on_store, recipe_batches, store_batches
    from conceptdict.saes.compare import Entry

    recipe, entries, evals = None, [], []
    for i, (path, label) in enumerate(zip(paths, _labels(paths))):
        sae_dir, names = _dictionary_of(path)
        ecfg = EvalConfig(store=cfg.store, model=cfg.model, rows=cfg.rows, batch_size=cfg.batch_size,
                          contexts=cfg.contexts if cfg.model else 0, device=cfg.device)
        model, store, hookpoints = open_on_store(sae_dir, ecfg)
        if i == 0:
            recipe = heldout_recipe(sae_dir, store, hookpoints)
            rows_from = (f"the batches `conceptdict train` held out for {sae_dir}" if recipe else
                         "the first rows of the store")
        batches = (recipe_batches(recipe, store, hookpoints, cfg.rows) if recipe else
                   store_batches(store, hookpoints, cfg.rows, cfg.batch_size))
        entries.append(Entry(label, model, list(batches), hookpoints[-1], names,
                             {"path": str(path), "hookpoints": hookpoints}))
        evals.append((ecfg, store))
    return entries, rows_from, evals


def run(args: argparse.Namespace) -> int:
    from conceptdict.cli.eval_cmd import splice_scores
    from conceptdict.naming.compare import comparison_table, write_comparison
    from conceptdict.saes.compare import compare

    cfg = build_config(CompareConfig, args, args.config)
    if cfg.store is None or cfg.out is None:
        raise ConfigError("conceptdict compare needs --store STORE_DIR and --out DIR")
    entries, rows_from, evals = _entries(list(args.dicts), cfg)
    result = compare(entries, cfg.match_threshold)
    for row, entry, (ecfg, store) in zip(result["dictionaries"], entries, evals):
        if cfg.model and cfg.contexts:
            from conceptdict.saes import EvalResult

            scored = splice_scores(EvalResult(**row["metrics"]), entry.model, store, row["hookpoints"], ecfg)
            row["metrics"] = scored.to_dict()
    result["rows_from"] = rows_from
    result["config"] = to_jsonable(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    page = write_comparison(result, cfg.out)
    print(f"{len(entries)} dictionaries on {result['n_rows']} rows of {cfg.store} ({rows_from}):")
    print(comparison_table(result))
    for row in result["dictionaries"]:
        if row.get("unique_names"):
            print(f"names only {row['name']} found ({row['unique_names']['count']}): "
                  + ", ".join(itertools.islice(row["unique_names"]["examples"], 10)))
    print(f"compare: {cfg.out / 'compare.json'}, {page}")
    return 0
