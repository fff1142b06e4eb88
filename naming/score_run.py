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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import llm_scorers  # noqa: F401  (registers the detection and fuzzing scorers)
from conceptdict.naming.interventions import steering_scorer  # noqa: F401  (registers the steering scorer)
from .agreement import agreement, candidate_names, choose, confidence, headline, namer_for
from .concepts import Concept, ConceptDictionary
from .concepts_file import ConceptsFile
from .negatives import Negatives, build_pool
from .pipeline import NameConfig, TruncatingContextCache, open_sources
from .scoring import (
    ScoreConfig,
    ScoringContext,
    TextEmbedder,
    control_names,
    get_scorer,
    model_embedder,
    summary_of,
    summary_table,
)
from .written import NamedSummary, NamedWriter

log = logging.getLogger(__name__)


def scored_ids(concepts: Iterable[Concept], max_latents: int = 0) -> list[int]:
    """Latents with at least one activating example, lowest ids first, at most ``max_latents`` (0: all)."""
    ids = [c.id for c in concepts if c.top_examples]
    return ids[:max_latents] if max_latents else ids


def open_for_scoring(cfg: ScoreConfig, meta: dict[str, Any], sources=None) -> Any:
    """The dictionary, store and hookpoint the concept dictionary (of ``meta``) was named from, unless given."""
    for name in cfg.scorers:
        get_scorer(name)  # an unknown scorer fails before any work
    if sources is not None:
        return sources
    sae_dir = cfg.sae_dir or meta.get("sae_dir")
    if not sae_dir:
        raise ValueError("the concept dictionary records no sae_dir; pass --sae-dir DICT_DIR")
    return open_sources(sae_dir, cfg.store or meta.get("store"), meta.get("hookpoint"), cfg.device,
                        lazy=None)  # encoded a block of latents at a time if it does not fit


def open_negatives(cfg: ScoreConfig, sources, tops: Sequence[Sequence[int]],
                   directions: Callable[[int, int], Tensor]) -> tuple[Negatives, dict[str, Any]]:
    """The negatives' pool over every latent's top rows (``tops``) and the base examples (``options``)."""
    pool = build_pool((r for rows in tops for r in rows), sources.model, sources.store,
                      sources.inputs or sources.hookpoint, cfg.negatives, len(tops))
    cache = TruncatingContextCache(sources.store, 8, 4, 600)
    gen = torch.Generator().manual_seed(cfg.negatives.seed + 2)
    base_rows = pool.rows[torch.randperm(len(pool.rows), generator=gen)[:512]].tolist()
    options = {"base_examples": tuple(cache.example(r, 0.0) for r in base_rows)}
    return Negatives(pool, cfg.negatives, cache, tops, directions), options


def prepare_context(cd: ConceptDictionary, cfg: ScoreConfig, *, embed: TextEmbedder | None = None,
                    sources=None, workdir: Path | None = None, options: dict | None = None) -> ScoringContext:  # fmt: skip
    """Open the sources (unless given), draw every scored latent's samples, and build the ScoringContext."""
    sources = open_for_scoring(cfg, cd.meta, sources)
    negatives, base = open_negatives(cfg, sources, [tuple(e.row for e in c.top_examples) for c in cd.concepts],
                                     lambda a, b: cd.directions[a:b])
    samples = negatives.draw(cd.concepts, scored_ids(cd.concepts, cfg.max_latents))
    embed = embed or model_embedder(cfg.encoder, cfg.encoder_hookpoint, cfg.batch_size, cfg.device)
    ctx = ScoringContext(cd, samples, cfg, embed, sources, workdir, dict(options or {}))
    ctx.options.setdefault("base_examples", base["base_examples"])
    return ctx


Names = dict[str, dict[int, tuple[str, float]]]
"""namer -> latent -> (name, the namer's own score)."""


Blocks = Callable[[], Iterable[tuple[Sequence[Concept], Tensor]]]
"""A concept dictionary's (concepts, directions), whole or a block at a time, read anew at each call."""


def names_by_namer(blocks: Blocks, n_latents: int, meta: dict[str, Any], ctx: ScoringContext,
                   name_cfg: NameConfig) -> Names:
    """Every latent's names by namer: the names stored by earlier runs (``Concept.names``), the dictionary's own
    namer's (its current names, for latents without a stored entry), and each ``--namer``'s, run on each of
    ``blocks()`` (read once, and once per namer run; each namer built once)."""
    out: Names = {}
    own_names: dict[int, tuple[str, float]] = {}
    for concepts, _ in blocks():
        for c in concepts:
            for namer, entry in c.names.items():
                out.setdefault(namer, {})[c.id] = (str(entry.get("name", "")), float(entry.get("score", 0.0)))
            own_names[c.id] = (c.name, c.score)
    own = out.setdefault(meta.get("namer") or "given", {})
    for j, named in own_names.items():
        own.setdefault(j, named)
    del own_names
    for namer in ctx.cfg.namers:
        if namer in out:
            continue
        out[namer] = {}
        built = namer_for(meta, namer, name_cfg)  # once: it may load a model or embed a vocabulary
        for concepts, directions in blocks():  # a block as a dictionary of its own (ids from 0)
            block = ConceptDictionary(tuple(dataclasses.replace(c, id=i) for i, c in enumerate(concepts)),
                                      directions, meta)
            res = candidate_names(block, namer, name_cfg, ctx.options["base_examples"], built=built)
            out[namer].update({c.id: (r.name, float(r.score)) for c, r in zip(concepts, res)})
        log.info("namer %s: %d names", namer, sum(1 for name, _ in out[namer].values() if name))
    return {n: {j: names.get(j, ("", 0.0)) for j in range(n_latents)} for n, names in out.items()}


def controls_by_namer(by_namer: Names, ids: Sequence[int], seed: int) -> dict[str, dict[int, str]]:
    """namer -> the random-name control of each scored latent (``ids``), drawn over all of them."""
    return {namer: control_names({j: names[j][0] for j in ids}, seed) for namer, names in by_namer.items()}


def score_block(concepts: Sequence[Concept], by_namer: Names, controls: dict[str, dict[int, str]],
                cfg: ScoreConfig, ctx: ScoringContext) -> list[Concept]:
    """``concepts`` (a block, or all) with the names of ``by_namer`` scored on their latents of ``ctx.samples``,
    with the controls of :func:`controls_by_namer`."""
    scorers = [(s, get_scorer(s)) for s in cfg.scorers]
    by_id = {c.id: c for c in concepts}
    entries: dict[int, dict[str, dict[str, Any]]] = {j: {n: dict(e) for n, e in by_id[j].names.items()}
                                                     for j in ctx.samples}  # fmt: skip
    for namer, names in by_namer.items():
        wanted = {j: names[j][0] for j in ctx.samples}
        mine = dataclasses.replace(ctx, controls={j: controls[namer][j] for j in ctx.samples if j in controls[namer]})
        for j in ctx.samples:
            old = entries[j].get(namer, {})
            keep = old.get("scores", {}) if old.get("name") == names[j][0] else {}
            entries[j][namer] = {"name": names[j][0], "score": names[j][1], "scores": dict(keep)}
        for scorer_name, scorer in scorers:
            for j, metrics in scorer(mine, wanted).items():
                entries[j][namer]["scores"][scorer_name] = metrics
            log.info("scored the %s names with %s", namer, scorer_name)
    return [_rescored(c, entries.get(c.id), cfg, ctx, len(by_namer) > 1) for c in concepts]


def scoring_meta(meta: dict[str, Any], cfg: ScoreConfig, by_namer: Names, n_scored: int, ctx: ScoringContext,
                 table: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """The concept dictionary's meta with how it was scored (``meta["scoring"]``), its summary from ``table``."""
    out = {**meta, "scoring": {"scorers": list(cfg.scorers), "namers": list(by_namer),
                               "negatives": dataclasses.asdict(cfg.negatives), "control": cfg.control,
                               "encoder": f"{cfg.encoder}:{cfg.encoder_hookpoint}",
                               "scored_latents": n_scored}}  # fmt: skip
    if "llm_calls" in ctx.options:
        out["scoring"]["llm_usage"] = dataclasses.asdict(ctx.options["llm_calls"].usage)
    out["scoring"]["summary"] = summary_of(table)
    return out


def score_concepts(cd: ConceptDictionary, cfg: ScoreConfig, ctx: ScoringContext | None = None,
                   name_cfg: NameConfig | None = None) -> ConceptDictionary:  # fmt: skip
    """Score every firing latent's names; returns a new ConceptDictionary (module docstring)."""
    ctx = ctx or prepare_context(cd, cfg)
    name_cfg = name_cfg or NameConfig(vocab=cfg.vocab, device=cfg.device)
    by_namer = names_by_namer(lambda: [(cd.concepts, cd.directions)], len(cd.concepts), cd.meta, ctx, name_cfg)
    concepts = score_block(cd.concepts, by_namer, controls_by_namer(by_namer, list(ctx.samples), cfg.seed), cfg, ctx)
    meta = scoring_meta(cd.meta, cfg, by_namer, len(ctx.samples), ctx, summary_table(concepts))
    return ConceptDictionary(tuple(concepts), cd.directions, meta)


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


BLOCK = 512
"""Concepts scored at a time by :func:`score_in_place`."""


def score_in_place(directory: Path, cfg: ScoreConfig, *, embed: TextEmbedder | None = None, sources=None,
                   block: int = BLOCK) -> NamedSummary:
    """Score the concept dictionary in ``directory`` a block of ``block`` concepts at a time and write it back in
    place (concepts.json, concepts.safetensors and report/, as ``conceptdict name`` writes them a block at a time):
    the same files as :func:`score_concepts` of the whole dictionary, holding one block of records (and, of the
    whole dictionary, each latent's names and top rows, the pool's rows and (row, latent) firings). The records
    are read three times (once more per ``--namer``): for the top rows and names, for the names, and to score."""
    file = ConceptsFile(directory)
    sources = open_for_scoring(cfg, file.meta, sources)
    tops: list[tuple[int, ...]] = []
    for concepts, _ in file.blocks(block):
        tops.extend(tuple(e.row for e in c.top_examples) for c in concepts)
    ids = [j for j, rows in enumerate(tops) if rows]
    ids = ids[: cfg.max_latents] if cfg.max_latents else ids
    negatives, options = open_negatives(cfg, sources, tops, file.directions)
    embed = embed or model_embedder(cfg.encoder, cfg.encoder_hookpoint, cfg.batch_size, cfg.device)
    # the scorers' context holds the dictionary's meta, not its concepts (a block's samples at a time)
    ctx = ScoringContext(ConceptDictionary((), torch.zeros(0), file.meta), {}, cfg, embed, sources, directory,
                         options)
    by_namer = names_by_namer(lambda: file.blocks(block), file.n_concepts, file.meta, ctx,
                              NameConfig(vocab=cfg.vocab, device=cfg.device))
    controls = controls_by_namer(by_namer, ids, cfg.seed)
    table: dict[str, dict[str, list[float]]] = {}
    with NamedWriter(directory, file.n_concepts, file.directions_shape) as out:
        for concepts, directions in file.blocks(block):
            samples = negatives.draw(concepts, [j for j in ids if concepts[0].id <= j <= concepts[-1].id])
            scored = score_block(concepts, by_namer, controls, cfg, dataclasses.replace(ctx, samples=samples))
            summary_table(scored, table)
            out.add(scored, directions)
            del scored, samples, concepts, directions
            embed.forget()  # the contexts' own cache is kept: it holds the pool's rows at most
        summary = out.finish(scoring_meta(file.meta, cfg, by_namer, len(ids), ctx, table))
    if "llm_calls" in ctx.options:  # what the command prints (not written)
        summary.meta["scoring"]["llm_usage_line"] = ctx.options["llm_calls"].usage.line(cfg.llm)
    return summary
