"""``conceptdict demo``: the whole flow on the embedded default (what ``make demo`` runs).

The demo is a list of steps, each a function ``step(ctx: DemoContext) -> StepResult``. A step lives
in the module named in :data:`STEPS` (``conceptdict.cli.demo_<stage>``), so each stage adds its own
step in its own file. A finished step
leaves ``<out>/.demo/<name>.json`` and is reused on the next run (``--fresh`` redoes everything).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

HELP = "run the whole flow on the embedded default model and the standard-library docstrings"

# (step name, "module:function"), in the order they run.
STEPS: list[tuple[str, str]] = [
    ("cache", "conceptdict.cli.demo:cache_step"),
    ("train", "conceptdict.cli.demo_train:train_step"),
    ("name", "conceptdict.cli.demo_name:name_step"),
    ("cbm", "conceptdict.cli.demo_cbm:cbm_step"),
    ("report", "conceptdict.cli.demo_report:report_step"),
]


class StepResult(NamedTuple):
    """What a step leaves for later steps (``artifacts``: name -> path or value) and for the summary."""

    artifacts: dict
    summary: list[str]


@dataclass
class DemoContext:
    """Shared by every step: the output root, the artifacts so far, and the summary lines."""

    out: Path
    fast: bool = False
    artifacts: dict = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output root (default: runs/demo)")
    parser.add_argument("--fresh", action="store_true", help="redo every step instead of reusing finished ones")
    parser.add_argument("--fast", action="store_true", help="a small slice of the data (for smoke tests)")


# ---------------------------------------------------------------- stage 1: cache (owned by activations/)

DEMO_HOOKPOINT = "sentence.mean_normalized"
TOKEN_HOOKPOINT = "blocks.3.hook_out"


def cache_step(ctx: DemoContext) -> StepResult:
    """MiniLM sentence embeddings of every stdlib docstring (labels: module, family) -> ``store/``; and
    token activations at blocks.3 over a few hundred docstrings -> ``store_tokens/``."""
    from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, stdlib_docstrings
    from conceptdict.activations import store_summary
    from conceptdict.cli.args import write_resolved_config
    from conceptdict.cli.store import format_summary

    docs = stdlib_docstrings()
    if ctx.fast:
        docs = docs[::10]
    length = 64 if ctx.fast else 128
    sentence = CacheConfig(model="default", hookpoints=[DEMO_HOOKPOINT], dataset="stdlib-docstrings",
                           out=ctx.out / "store", context_length=length, batch_size=32, overwrite=True)
    tokens = CacheConfig(model="default", hookpoints=[TOKEN_HOOKPOINT], dataset="stdlib-docstrings",
                         out=ctx.out / "store_tokens", context_length=length, batch_size=16, overwrite=True,
                         tokens=2048 if ctx.fast else 32768)
    summary = []
    for cfg in (sentence, tokens):
        path = cache_activations(cfg, records=docs if cfg is sentence else docs[::5])
        write_resolved_config(cfg, path, "cache_config.json")
        summary.append(format_summary(store_summary(ActivationStore(path))))
    return StepResult({"store": str(sentence.out), "token_store": str(tokens.out), "hookpoint": DEMO_HOOKPOINT,
                       "token_hookpoint": TOKEN_HOOKPOINT, "label_key": "family"}, summary)


# ---------------------------------------------------------------- the runner


def resolve_step(target: str) -> Callable[[DemoContext], StepResult]:
    """The step function named ``"module:function"``."""
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def run_steps(ctx: DemoContext, fresh: bool = False) -> list[str]:
    """Run (or reuse) every step in order; returns one status line per step."""
    done_dir = ctx.out / ".demo"
    done_dir.mkdir(parents=True, exist_ok=True)
    status = []
    for name, target in STEPS:
        marker = done_dir / f"{name}.json"
        step = resolve_step(target)
        saved = json.loads(marker.read_text()) if marker.exists() else None
        if saved is not None and not fresh and saved.get("fast") == ctx.fast:
            result = StepResult(saved["artifacts"], saved["summary"])
            status.append(f"{name:7s} reused (delete {marker} or pass --fresh to redo)")
        else:
            start = time.perf_counter()
            result = step(ctx)
            marker.write_text(json.dumps({**result._asdict(), "fast": ctx.fast}, indent=1) + "\n")
            status.append(f"{name:7s} done in {time.perf_counter() - start:.1f} s")
        ctx.artifacts.update(result.artifacts)
        ctx.summary.extend(result.summary)
    return status


def run(args: argparse.Namespace) -> int:
    ctx = DemoContext(out=Path(args.out), fast=bool(args.fast))
    status = run_steps(ctx, fresh=bool(args.fresh))
    print("\n".join(status))
    print()
    print("\n\n".join(ctx.summary))
    return 0
