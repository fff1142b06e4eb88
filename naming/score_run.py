"""``score_concepts``: a concept dictionary -> the same dictionary with every name scored (``conceptdict score``).

Steps: open the dictionary and store the concept dictionary was named from; draw positives and negatives per
firing latent (naming/negatives.py); collect every namer's names (the dictionary's own plus ``--namer``);
run each ``--scorer`` (naming/scoring.py registry) on each namer's names; choose the best-scoring name per
latent (the first scorer decides), keep the others as runner-ups, and store the confidence
(naming/agreement.py). Per latent the result is ``Concept.scores`` (the chosen name's), ``Concept.names``
(every namer's name and scores) and ``Concept.confidence``; ``meta["scoring"]`` records how.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from . import llm_scorers  # noqa: F401  (registers the detection and fuzzing scorers)
from conceptdict.naming.interventions import steering_scorer  # noqa: F401  (registers the steering scorer)
from .agreement import agreement, candidate_names, choose, confidence, headline
from .concepts import Concept, ConceptDictionary
from .negatives import build_pool, draw_negatives
from .pipeline import NameConfig, TruncatingContextCache, open_sources
from .scoring import ScoreConfig, ScoringContext, TextEmbedder, get_scorer, model_embedder, score_summary

log = logging.getLogger(__name__)


def scored_ids(cd: ConceptDictionary, max_latents: int = 0) -> list[int]:
    """Latents with at least one activating example, lowest ids first, at most ``max_latents`` (0: all)."""
    ids = [c.id for c in cd.concepts if c.top_examples]
    return ids[:max_latents] if max_latents else ids


def prepare_context(cd: ConceptDictionary, cfg: ScoreConfig, *, embed: TextEmbedder | None = None,
                    sources=None, workdir: Path | None = None, options: dict | None = None) -> ScoringContext:  # fmt: skip
    """Open the sources (unless given), draw every scored latent's samples, and build the ScoringContext."""
    for name in cfg.scorers:
        get_scorer(name)  # an unknown scorer fails before any work
    if sources is None:
        sae_dir = cfg.sae_dir or cd.meta.get("sae_dir")
        if not sae_dir:
            raise ValueError("the concept dictionary records no sae_dir; pass --sae-dir DICT_DIR")
        sources = open_sources(sae_dir, cfg.store or cd.meta.get("store"), cd.meta.get("hookpoint"), cfg.device,
                               lazy=None)  # encoded a block of latents at a time if it does not fit
    pool = build_pool(cd, sources.model, sources.store, sources.inputs or sources.hookpoint, cfg.negatives)
    cache = TruncatingContextCache(sources.store, 8, 4, 600)
    samples = draw_negatives(cd, pool, cfg.negatives, cache, scored_ids(cd, cfg.max_latents))
    embed = embed or model_embedder(cfg.encoder, cfg.encoder_hookpoint, cfg.batch_size, cfg.device)
    ctx = ScoringContext(cd, samples, cfg, embed, sources, workdir, dict(options or {}))
    gen = torch.Generator().manual_seed(cfg.negatives.seed + 2)
    base_rows = pool.rows[torch.randperm(len(pool.rows), generator=gen)[:512]].tolist()
    ctx.options.setdefault("base_examples", tuple(cache.example(r, 0.0) for r in base_rows))
    return ctx


def _names_by_namer(ctx: ScoringContext, name_cfg: NameConfig) -> dict[str, dict[int, tuple[str, float]]]:
    """namer -> latent -> (name, namer's own score): the names stored by earlier runs (``Concept.names``), the
    dictionary's own namer's (its current names, for latents without a stored entry), and each ``--namer``."""
    cd = ctx.cd
    out: dict[str, dict[int, tuple[str, float]]] = {}
    for c in cd.concepts:
        for namer, entry in c.names.items():
            out.setdefault(namer, {})[c.id] = (str(entry.get("name", "")), float(entry.get("score", 0.0)))
    own = out.setdefault(cd.meta.get("namer") or "given", {})
    for c in cd.concepts:
        own.setdefault(c.id, (c.name, c.score))
    for namer in ctx.cfg.namers:
        if namer in out:
            continue
        res = candidate_names(cd, namer, name_cfg, ctx.options["base_examples"])
        out[namer] = {j: (r.name, float(r.score)) for j, r in enumerate(res)}
        log.info("namer %s: %d names", namer, sum(1 for r in res if r.name))
    return {n: {c.id: names.get(c.id, ("", 0.0)) for c in cd.concepts} for n, names in out.items()}


def score_concepts(cd: ConceptDictionary, cfg: ScoreConfig, ctx: ScoringContext | None = None,
                   name_cfg: NameConfig | None = None) -> ConceptDictionary:  # fmt: skip
    """Score every firing latent's names; returns a new ConceptDictionary (module docstring)."""
    ctx = ctx or prepare_context(cd, cfg)
    name_cfg = name_cfg or NameConfig(vocab=cfg.vocab, device=cfg.device)
    scorers = [(s, get_scorer(s)) for s in cfg.scorers]
    by_namer = _names_by_namer(ctx, name_cfg)
    entries: dict[int, dict[str, dict[str, Any]]] = {j: {n: dict(e) for n, e in cd.concepts[j].names.items()}
                                                     for j in ctx.samples}  # fmt: skip
    for namer, names in by_namer.items():
        wanted = {j: names[j][0] for j in ctx.samples}
        for j in ctx.samples:
            old = entries[j].get(namer, {})
            keep = old.get("scores", {}) if old.get("name") == names[j][0] else {}
            entries[j][namer] = {"name": names[j][0], "score": names[j][1], "scores": dict(keep)}
        for scorer_name, scorer in scorers:
            for j, metrics in scorer(ctx, wanted).items():
                entries[j][namer]["scores"][scorer_name] = metrics
            log.info("scored the %s names with %s", namer, scorer_name)
    concepts = [_rescored(c, entries.get(c.id), cfg, ctx, len(by_namer) > 1) for c in cd.concepts]
    meta = {**cd.meta, "scoring": {"scorers": list(cfg.scorers), "namers": list(by_namer),
                                   "negatives": dataclasses.asdict(cfg.negatives), "control": cfg.control,
                                   "encoder": f"{cfg.encoder}:{cfg.encoder_hookpoint}",
                                   "scored_latents": len(ctx.samples)}}  # fmt: skip
    if "llm_calls" in ctx.options:
        meta["scoring"]["llm_usage"] = dataclasses.asdict(ctx.options["llm_calls"].usage)
    out = ConceptDictionary(tuple(concepts), cd.directions, meta)
    out.meta["scoring"]["summary"] = score_summary(out)
    return out


def _rescored(c: Concept, entries, cfg: ScoreConfig, ctx: ScoringContext, several: bool) -> Concept:
    if not entries:
        return c
    current = next((n for n, e in entries.items() if e["name"] == c.name), c.namer)
    chosen, others = choose(entries, cfg.scorers[0], current) if several else (current, [])
    agree = agreement([e["name"] for e in entries.values()], ctx.embed) if several else None
    best = entries.get(chosen, {"name": c.name, "score": c.score, "scores": {}})
    update: dict[str, Any] = {"scores": best["scores"], "names": entries, "confidence": confidence(agree, best["scores"])}
    if several:
        runner = [(entries[n]["name"], headline(entries[n], cfg.scorers[0])) for n in others]
        runner = [(n, s) for n, s in runner if n != best["name"]]
        update.update(name=best["name"], score=float(best["score"]), namer=chosen,
                      runner_ups=tuple(n for n, _ in runner),
                      runner_up_scores=tuple(s if s > float("-inf") else float("nan") for _, s in runner))
        if agree is not None:
            update["extra"] = {**c.extra, "name_agreement": agree}
    return dataclasses.replace(c, **update)
