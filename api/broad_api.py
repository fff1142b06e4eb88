"""The broad dictionary (``conceptdict broad``): Discover-then-Name's first half done once per model and hookpoint.

Discover-then-Name trains its dictionary once on a large, broad dataset and fits each task's concept bottleneck on
top of it. Here the broad text is what a machine that runs conceptdict has: the docstrings of the standard library
and of every installed package, the man pages and the Debian package synopses (``broad-text``,
``activations.broad``; half of those sources is held out for evaluations). :func:`broad_dictionary` caches
them at the hookpoint, trains a dictionary with ``train``'s defaults (the stopping rule picks the length) and names
its latents with ``name``'s, all under the cache directory the vocabulary embeddings use, keyed by the model, the
hookpoint, the recipe and the text's fingerprint; later calls return the cached one. A build holds a lock (a second
one waits for it) and resumes where an interrupted one stopped. Its concepts fit a CBM on any task's labelled
store at the same hookpoint: ``cd.cbm(broad.concepts, dataset=STORE, ...)``."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from conceptdict.settings import given, takes_settings, config_from_dict

log = logging.getLogger(__name__)

RECIPE = 3
"""The version of how a broad dictionary is built; a change here makes every cached one stale."""
DONE_FILE = "broad.json"


@dataclass
class BroadConfig:
    """Settings of ``conceptdict broad``."""

    model: str = field(default="default", metadata={"help": "Model (name or directory; default: all-MiniLM-L6-v2)."})
    hookpoint: str = field(default="sentence.mean_normalized", metadata={
        "help": "Hookpoint the dictionary reads (the task stores a CBM uses must hold it)."})
    dataset: str = field(default="broad-text", metadata={
        "help": "The broad text: broad-text (docstrings of the standard library and every installed package, man "
                "pages, Debian package synopses), broad-docstrings (the docstrings alone), or any dataset `cache` "
                "reads."})
    latents: int = field(default=4096, metadata={"min": 2, "help": "Latents of the broad dictionary."})
    k: int = field(default=16, metadata={"min": 1, "help": "Active latents per row (train's default kind, topk)."})
    vocab: str = field(default="wordfreq:en:20000", metadata={"help": "Vocabulary its latents are named from."})
    context_length: int = field(default=128, metadata={"min": 2, "help": "Tokens per text (cache's default)."})
    cache_dir: Path | None = field(default=None, metadata={
        "help": "Where it is kept (default: the vocabulary cache, $CONCEPTDICT_CACHE or ~/.cache/conceptdict)."})
    device: str = field(default="cpu", metadata={"help": "Torch device for the model and the training."})
    fresh: bool = field(default=False, metadata={"help": "Build it again even when a cached one exists."})


class BroadDictionary(NamedTuple):
    """Where a broad dictionary lies (its store, dictionary and concept dictionary) and how it was made."""

    root: Path
    store: Path
    sae: Path
    concepts: Path
    texts: int
    """Rows of its store (one per text)."""
    built: bool
    """True when this call built it, False when it was read from the cache."""
    info: dict[str, Any]
    """``broad.json``: the settings, the dataset's descriptor, the texts per source and the seconds per stage."""


def broad_key(cfg: BroadConfig) -> str:
    """Hex digest of what a broad dictionary is made from: the recipe, model, hookpoint, settings and the dataset's
    descriptor (for broad-text: the Python version, every installed distribution's version, the man pages and the
    apt lists)."""
    from conceptdict.activations.data import describe_dataset

    parts = [RECIPE, cfg.model, cfg.hookpoint, cfg.latents, cfg.k, cfg.vocab, cfg.context_length,
             describe_dataset(cfg.dataset)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def broad_root(cfg: BroadConfig) -> Path:
    from conceptdict.naming.vocab import default_cache_dir

    return Path(cfg.cache_dir or default_cache_dir()) / f"broad-{broad_key(cfg)}"


@takes_settings(BroadConfig)
def cached_broad_dictionary(
    *, model: str = "default", hookpoint: str = "sentence.mean_normalized", dataset: str = "broad-text",
    latents: int = 4096, k: int = 16, vocab: str = "wordfreq:en:20000", context_length: int = 128,
    cache_dir: str | Path | None = None, device: str = "cpu", fresh: bool = False,
) -> BroadDictionary | None:
    """The broad dictionary these settings describe if it is cached, else None (nothing is built:
    :func:`broad_dictionary` builds it)."""
    return _cached(broad_root(config_from_dict(BroadConfig, given(locals()), "broad")))


@takes_settings(BroadConfig)
def broad_dictionary(
    *, model: str = "default", hookpoint: str = "sentence.mean_normalized", dataset: str = "broad-text",
    latents: int = 4096, k: int = 16, vocab: str = "wordfreq:en:20000", context_length: int = 128,
    cache_dir: str | Path | None = None, device: str = "cpu", fresh: bool = False,
) -> BroadDictionary:
    """The broad dictionary of ``model`` at ``hookpoint`` (``conceptdict broad``): read from the cache, or built
    (cache the broad text, train with train's defaults, name with name's) and cached."""
    settings = given(locals())  # first: before any local name
    from conceptdict.activations.lock import writer_lock

    cfg = config_from_dict(BroadConfig, settings, "broad")
    root = broad_root(cfg)
    cached = None if cfg.fresh else _cached(root)
    if cached is not None:
        log.info("broad dictionary from cache %s", root)
        return cached
    with writer_lock(root, "broad dictionary", wait=math.inf):  # another process building it: wait, then reuse
        cached = None if cfg.fresh else _cached(root)  # built by the process this one waited for
        if cached is not None:
            return cached
        if cfg.fresh:
            (root / DONE_FILE).unlink(missing_ok=True)
        info = _build(cfg, root)
        (root / DONE_FILE).write_text(json.dumps(info, indent=1, default=str) + "\n")  # written last: finished
    return _result(root, info, built=True)


def _cached(root: Path) -> BroadDictionary | None:
    """The finished build under ``root`` (its DONE_FILE written last), or None."""
    done = root / DONE_FILE
    return _result(root, json.loads(done.read_text()), built=False) if done.exists() else None


def _result(root: Path, info: dict, built: bool) -> BroadDictionary:
    return BroadDictionary(root, root / "store", root / "sae", root / "concepts", info["texts"], built, info)


def _build(cfg: BroadConfig, root: Path) -> dict[str, Any]:
    from collections import Counter

    from conceptdict.activations import ActivationStore, CacheConfig, cache_activations
    from conceptdict.activations.data import describe_dataset, iter_records
    from conceptdict.concept_api import name
    from conceptdict.train_api import train

    seconds = {}
    t0 = time.perf_counter()
    records = list(iter_records(cfg.dataset))
    seconds["texts"] = time.perf_counter() - t0
    log.info("broad dictionary: %d texts from %s -> %s", len(records), cfg.dataset, root)
    t0 = time.perf_counter()
    store = root / "store"
    cache_activations(CacheConfig(model=cfg.model, hookpoints=[cfg.hookpoint], dataset=cfg.dataset, out=store,
                                  context_length=cfg.context_length, device=cfg.device, overwrite=True),
                      records=records)
    seconds["cache"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    resume = (root / "sae" / "checkpoint.pt").exists() and not cfg.fresh  # an interrupted build goes on from there
    sae = train(store=[store], hookpoint=[cfg.hookpoint], latents=cfg.latents, k=cfg.k, device=cfg.device,
                out=root / "sae", resume=resume, overwrite=not resume)
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    name(root / "sae", vocab=cfg.vocab, device=cfg.device, out=root / "concepts", overwrite=True)
    seconds["name"] = time.perf_counter() - t0
    summary = sae.training_summary
    return {
        "recipe": RECIPE, "model": cfg.model, "hookpoint": cfg.hookpoint, "dataset": describe_dataset(cfg.dataset),
        "latents": cfg.latents, "k": cfg.k, "vocab": cfg.vocab, "texts": ActivationStore(store).num_rows,
        "sources": dict(Counter(r.get("source", cfg.dataset) for r in records)),
        "packages": len({r["package"] for r in records if r.get("source") in ("stdlib", "packages")}),
        "steps": summary["steps"], "upper_bound": summary["resolved"]["total_steps"],
        "heldout_fvu": (summary.get("heldout_eval") or {}).get("fvu"), "seconds": seconds,
    }
