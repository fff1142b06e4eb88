"""The whole flow on the embedded default (what ``make demo`` and ``conceptdict demo`` run): the all-MiniLM-L6-v2
sentence encoder over the standard library's docstrings, each labelled with its module family.

The demo is a list of steps, each ``step(ctx) -> StepResult``. A finished step leaves ``OUT/.demo/NAME.json`` and
is reused on the next run (``fresh=True`` redoes everything)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, format_summary
from conceptdict.activations import stdlib_docstrings, store_summary
from conceptdict.naming import load_cbm, load_concepts, write_report
from conceptdict.printing import format_cbm, format_concepts
from conceptdict.saes import describe_dictionary
from conceptdict.saes.config import heldout_batch_count
from conceptdict.settings import write_resolved_config

DEMO_HOOKPOINT = "sentence.mean_normalized"
DEMO_KIND = "topk"
"""The demo's dictionaries: train's default kind, which exports to SAELens exactly."""
TOKEN_HOOKPOINT = "blocks.3.hook_out"


class StepResult(NamedTuple):
    """What a step leaves for later steps (``artifacts``: name -> path or value) and for the summary."""

    artifacts: dict
    summary: list[str]
    done: bool = True
    """False: the step did not run (it needs something not there yet); the next demo tries it again."""


@dataclass
class DemoContext:
    """Shared by every step: the output root, the artifacts so far, and the summary lines."""

    out: Path
    fast: bool = False
    artifacts: dict = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    broad: dict = field(default_factory=dict)
    """Settings of the broad dictionary (``broad_api.BroadConfig``; empty: its defaults)."""
    build_broad: bool = False
    """Build the broad dictionary when it is not cached (tens of minutes once); else the broad step waits for it."""


def cache_step(ctx: DemoContext) -> StepResult:
    """MiniLM sentence embeddings of every stdlib docstring (labels: module, family) -> ``store/``; and token
    activations at blocks.3 over a few hundred docstrings -> ``store_tokens/``."""
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


def _fit(store: str, hookpoint: str, out: Path, kind: str, latents: int, k: int, batch_size: int,
         epochs: int) -> list[str]:
    from conceptdict.train_api import train

    rows = ActivationStore(store).num_rows
    batch_size = min(batch_size, max(8, rows // 8))
    # 2 batches held out for evaluation and, for a thresholded kind, 1 on which the threshold is calibrated
    settings = dict(latents=latents, k=k, kind=kind, batch_size=batch_size, eval_batches=2, calibration_batches=1,
                    checkpoint_every=0)
    from conceptdict.saes import train_config

    per_epoch = max(1, rows // batch_size - heldout_batch_count(train_config(**settings, tokens=1)))
    model = train(store=[store], hookpoint=[hookpoint], out=out, overwrite=True, tokens=per_epoch * batch_size * epochs,
                  **settings)
    return [f"{out} ({hookpoint}):", *describe_dictionary(model)]


def train_step(ctx: DemoContext) -> StepResult:
    """Sentence store -> ``sae/`` (the dictionary later steps name); token store -> ``sae_tokens/``. Both are
    ``topk``, train's default kind, which SAELens (and so Neuronpedia and SAEBench) holds exactly
    (docs/results/kinds.md#the-default-kind-and-saelens)."""
    art = ctx.artifacts
    summary = _fit(art["store"], art["hookpoint"], ctx.out / "sae", DEMO_KIND, latents=256 if ctx.fast else 1024,
                   k=8 if ctx.fast else 16, batch_size=256, epochs=5 if ctx.fast else 30)
    found = {"sae": str(ctx.out / "sae")}
    if art.get("token_store"):
        summary += _fit(art["token_store"], art["token_hookpoint"], ctx.out / "sae_tokens", DEMO_KIND,
                        latents=512 if ctx.fast else 2048, k=16 if ctx.fast else 32, batch_size=1024,
                        epochs=2 if ctx.fast else 5)
        found["token_sae"] = str(ctx.out / "sae_tokens")
    return StepResult(found, summary)


def _name(sae: str, store: str, hookpoint: str, out: Path, **settings) -> list[str]:
    from conceptdict.concept_api import name

    cd = name(sae, store=store, hookpoint=hookpoint, out=out, **settings)
    firing = sum(1 for c in cd.concepts if c.frequency > 0)
    return [f"{out}: {len(cd.concepts)} latents named by the {cd.meta['namer']} namer ({firing} fire)",
            format_concepts(cd, n=8)]


def name_step(ctx: DemoContext) -> StepResult:
    """``sae/`` -> ``concepts/`` (Discover-then-Name vocabulary); ``sae_tokens/`` -> ``concepts_tokens/``."""
    art = ctx.artifacts
    vocab = "wordfreq:en:2000" if ctx.fast else "wordfreq:en:20000"
    summary = _name(art["sae"], art["store"], art["hookpoint"], ctx.out / "concepts", namer="vocab", vocab=vocab)
    found = {"concepts": str(ctx.out / "concepts")}
    if art.get("token_sae"):
        summary += _name(art["token_sae"], art["token_store"], art["token_hookpoint"], ctx.out / "concepts_tokens",
                         namer="context", top_k=10)
        found["token_concepts"] = str(ctx.out / "concepts_tokens")
    return StepResult(found, summary)


def cbm_step(ctx: DemoContext) -> StepResult:
    """``concepts/`` + the sentence store's ``family`` labels -> ``cbm/``."""
    from conceptdict.concept_api import cbm

    art, out = ctx.artifacts, ctx.out / "cbm"
    result = cbm(art["concepts"], label_column=art.get("label_key", "family"), out=out)
    m = result.metrics
    return StepResult({"cbm": str(out), "cbm_accuracy": m["accuracy"], "probe_accuracy": m["probe_accuracy"]},
                      [f"{out}: predicts the module family of a docstring from its named concepts", format_cbm(result)])


def broad_step(ctx: DemoContext) -> StepResult:
    """The broad dictionary (``conceptdict broad``: built once on docstrings, man pages and package synopses, then
    cached) -> ``cbm_broad/``: the same CBM on the sentence store, from the broad dictionary's concepts. Its one-time
    build takes tens of minutes, so the demo builds it only with ``build_broad`` (``demo --broad``); otherwise it
    uses a cached one, or says how to build it and runs next time. Skipped with ``fast``."""
    if ctx.fast:
        return StepResult({}, ["broad dictionary: skipped with --fast (`conceptdict broad` builds it once)"])
    from conceptdict.broad_api import broad_dictionary, cached_broad_dictionary
    from conceptdict.concept_api import cbm

    art, out = ctx.artifacts, ctx.out / "cbm_broad"
    settings = {"hookpoint": art["hookpoint"], **ctx.broad}
    broad = broad_dictionary(**settings) if ctx.build_broad else cached_broad_dictionary(**settings)
    if broad is None:
        return StepResult({}, ["broad dictionary: not built yet. `conceptdict broad` builds it once (about 15 "
                               "minutes on a 2-core CPU, then cached); the next `conceptdict demo` then fits the "
                               "same CBM on its concepts (or run `conceptdict demo --broad`)"], done=False)
    result = cbm(broad.concepts, dataset=art["store"], label_column=art.get("label_key", "family"), out=out)
    info = broad.info
    return StepResult({"cbm_broad": str(out), "cbm_broad_accuracy": result.metrics["accuracy"]},
                      [f"{out}: the same task from the broad dictionary's concepts ({broad.concepts}: "
                       f"{info['latents']} latents trained on {broad.texts} texts: {_sources(info)})",
                       format_cbm(result)])


def _sources(info: dict) -> str:
    """``broad.json``'s texts per source in words: "4,518 stdlib, 19,482 packages, 14,923 man, 32,000 apt"."""
    return ", ".join(f"{n:,} {source}" for source, n in info.get("sources", {}).items()) or "?"


def report_step(ctx: DemoContext) -> StepResult:
    """``concepts/`` + ``cbm/`` -> ``report/index.html`` (and ``report/tokens/`` for the token concepts)."""
    art = ctx.artifacts
    cbm = load_cbm(art["cbm"]) if art.get("cbm") else None
    index = write_report(load_concepts(art["concepts"]), ctx.out / "report", cbm=cbm)
    lines = [f"concept dictionary: {art['concepts']}/concepts.json", f"report:             {index}"]
    found = {"report": str(index)}
    if art.get("token_concepts"):
        tokens = write_report(load_concepts(art["token_concepts"]), ctx.out / "report" / "tokens")
        lines.append(f"token concepts:     {tokens}")
        found["token_report"] = str(tokens)
    return StepResult(found, lines)


STEPS: list[tuple[str, Callable[[DemoContext], StepResult]]] = [
    ("cache", cache_step), ("train", train_step), ("name", name_step), ("cbm", cbm_step), ("broad", broad_step),
    ("report", report_step),
]
"""The steps in the order they run."""


def demo(out: str | Path = "runs/demo", fast: bool = False, fresh: bool = False,
         broad: bool = False) -> tuple[list[str], list[str]]:
    """Run (or reuse) every step of the demo in ``out``; returns (one status line per step, the summary lines).
    ``broad``: build the broad dictionary if it is not cached yet (tens of minutes, once)."""
    from conceptdict.outdir import writing

    with writing(out, "demo"):
        return _demo(DemoContext(out=Path(out), fast=fast, build_broad=broad), fresh)


def _demo(ctx: DemoContext, fresh: bool) -> tuple[list[str], list[str]]:
    done_dir = ctx.out / ".demo"
    done_dir.mkdir(parents=True, exist_ok=True)
    status = []
    for step_name, step in STEPS:
        marker = done_dir / f"{step_name}.json"
        saved = json.loads(marker.read_text()) if marker.exists() else None
        if saved is not None and not fresh and saved.get("fast") == ctx.fast:
            result = StepResult(saved["artifacts"], saved["summary"])
            status.append(f"{step_name:7s} reused (delete {marker} or pass --fresh to redo)")
        else:
            start = time.perf_counter()
            result = step(ctx)
            if result.done:
                marker.write_text(json.dumps({**result._asdict(), "fast": ctx.fast}, indent=1) + "\n")
            status.append(f"{step_name:7s} {'done' if result.done else 'waits'} in "
                          f"{time.perf_counter() - start:.1f} s")
        ctx.artifacts.update(result.artifacts)
        ctx.summary.extend(result.summary)
    return status, ctx.summary
