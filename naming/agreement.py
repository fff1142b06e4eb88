"""Namer agreement: several namers' names per latent, the best-scoring one chosen, and a confidence.

``candidate_names`` runs namers over what a concept dictionary already holds (decoder directions, top and
quantile examples) plus random store rows for the context namer's base rates. ``agreement`` is the mean
pairwise cosine between the sentence embeddings of the namers' names (1 when they all say the same thing).
``confidence`` combines it with the scores::

    confidence = mean( agreement (when >= 2 namers gave a name),
                       clip(2 * (score - 0.5), 0, 1) for each scorer's headline score of the chosen name )

so a name that several namers agree on and that predicts where the latent fires is near 1, and a name at
chance on every scorer that no other namer shares is near 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Sequence

from .concepts import Example
from .namers import NameResult, NamingInputs, check_results
from .pipeline import NameConfig, build_namer, model_loader
from .scoring import TextEmbedder


def namer_for(meta: dict[str, Any], namer: str, cfg: NameConfig):
    """The namer ``namer`` as ``conceptdict name`` builds it for a dictionary of ``meta`` (its model, hookpoint):
    build it once and pass it to :func:`candidate_names` for every block (it may load a model or a vocabulary)."""
    cfg = dataclasses.replace(cfg, namer=namer)
    model_name = cfg.model or meta.get("model")
    hookpoint = cfg.hookpoint or meta.get("hookpoint")
    return build_namer(cfg, model_name, hookpoint, model_loader(model_name, cfg.device))


def candidate_names(cd, namer: str, cfg: NameConfig, base: Sequence[Example], negatives=None,
                    built=None) -> list[NameResult]:
    """One name per latent of ``cd`` from ``namer`` (vocab, context, logit-lens, llm), built as
    ``conceptdict name`` builds it (or ``built``, from :func:`namer_for`); ``base`` are random store rows
    (context namer), ``negatives`` optional per-latent non-activating examples (llm namer)."""
    built = built if built is not None else namer_for(cd.meta, namer, cfg)
    directions = cd.directions if cd.directions.ndim == 2 else cd.directions[:, cfg.source]
    top = [c.top_examples for c in cd.concepts]
    inputs = NamingInputs(directions.float(), top, [c.quantile_examples for c in cd.concepts],
                          negatives or (), tuple(base))  # fmt: skip
    return check_results(built(inputs), len(cd.concepts), built.kind)


def agreement(names: Sequence[str], embed: TextEmbedder) -> float | None:
    """Mean pairwise cosine of the names' embeddings (case-insensitive; empty names skipped); None below 2."""
    names = [n.strip().lower() for n in names if n and n.strip()]
    if len(names) < 2:
        return None
    e = embed(names)
    sims = [float(e[a] @ e[b]) for a, b in itertools.combinations(range(len(names)), 2)]
    return sum(sims) / len(sims)


def headline(entry: dict[str, Any], scorer: str) -> float:
    """The ``score`` of ``scorer`` in a namer entry, -inf when absent (for ranking)."""
    v = entry.get("scores", {}).get(scorer, {}).get("score")
    return float(v) if v is not None and math.isfinite(v) else float("-inf")


def confidence(agree: float | None, scores: dict[str, dict[str, Any]]) -> float | None:
    """The module docstring's formula; None when there is nothing to combine."""
    parts = [] if agree is None else [max(0.0, min(1.0, agree))]
    for m in scores.values():
        s = m.get("score")
        if s is not None and math.isfinite(s):
            parts.append(max(0.0, min(1.0, 2.0 * (s - 0.5))))
    return sum(parts) / len(parts) if parts else None


def choose(entries: dict[str, dict[str, Any]], scorer: str, current: str) -> tuple[str, list[str]]:
    """The namer whose name scores best on ``scorer`` (``current`` on ties) and the other namers, best first."""
    order = sorted(entries, key=lambda n: (headline(entries[n], scorer), n == current), reverse=True)
    named = [n for n in order if entries[n].get("name")]
    if not named:
        return current, []
    return named[0], named[1:]
