"""Export a concept dictionary in the layout Neuronpedia imports (``export --format neuronpedia``).

Read from Neuronpedia's own code (hijohnnylin/neuronpedia: ``apps/webapp/app/api/admin/import/route.ts`` reads
the files, ``apps/webapp/prisma/schema.prisma`` fixes the columns, ``utils/neuronpedia-utils/neuronpedia_utils/
db_models`` and ``convert-saedashboard-to-neuronpedia-export.py`` write them). One source lives in
``OUT/<modelId>/<sourceId>/``, with ``sourceId = "<layer>-<source set>"``:

- ``release.jsonl``, ``model.jsonl``, ``sourceset.jsonl``, ``source.jsonl``: one record each;
- ``features/batch-0.jsonl.gz``: one ``Neuron`` row per latent: density (``frac_nonzero`` and the activation
  histogram as ``freq_hist_data_bar_*``), logits (``pos_str``/``pos_values``, ``neg_str``/``neg_values`` and
  ``logits_hist_data_bar_*`` from the decoder direction times the unembedding, when the model has one) and the
  decoder direction as the steering ``vector``;
- ``activations/batch-0.jsonl.gz``: one ``Activation`` row per top example: the context's ``tokens`` and the
  latent's ``values`` on every one of them (re-encoded from the store rows), ``maxValue``/``maxValueTokenIndex``;
- ``explanations/batch-0.jsonl.gz``: one ``Explanation`` row per named latent: ``description`` = the name,
  ``scoreV1`` = the namer's score, ``typeName``/``explanationModelName`` = the namer.

A sequence-level store (one row per input, e.g. the demo's pooled sentence embeddings) has one activation
per input: every token of the input carries it, and ``source.notes`` says so.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from conceptdict.naming.concepts import Concept, ConceptDictionary
from conceptdict.saes.formats.hookpoints import to_transformer_lens

EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()


@dataclass
class NeuronpediaConfig:
    """What Neuronpedia needs to file a source that the concept dictionary does not record."""

    model_id: str | None = field(default=None, metadata={
        "help": "Neuronpedia model id (e.g. gpt2-small); default: the last part of the dictionary's model name."})
    source_set: str = field(default="conceptdict", metadata={
        "help": "Source set name; the source id is ``<layer>-<source_set>``."})
    creator: str = field(default="conceptdict", metadata={
        "help": "Creator name, and the user id the importing Neuronpedia files the records under."})
    release: str = field(default="conceptdict", metadata={"help": "Release name (a Neuronpedia URL slug)."})
    url: str | None = field(default=None, metadata={"help": "URL of the paper or repository for the release."})


def _cuid(*parts: Any) -> str:
    """A deterministic 25-character id in Neuronpedia's cuid alphabet (lowercase letters and digits)."""
    return "c" + hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()[:24]


def _layer(hookpoint: str | None) -> int:
    m = re.match(r"blocks\.(\d+)\.", hookpoint or "")
    return int(m.group(1)) if m else 0


def _histogram(concept: Concept) -> tuple[list[float], list[float]]:
    """(bar heights, bar centres) of the latent's nonzero activations."""
    edges, counts = concept.histogram.get("edges") or [], concept.histogram.get("counts") or []
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    return [float(c) for c in counts], [float(c) for c in centres]


@dataclass
class Logits:
    """Per-latent logit tables from the decoder direction times the unembedding."""

    pos: list[tuple[list[str], list[float]]]
    neg: list[tuple[list[str], list[float]]]
    hist: list[tuple[list[float], list[float]]]


def logit_tables(directions: torch.Tensor, unembed: torch.Tensor, decode, k: int = 10, bins: int = 40) -> Logits:
    """Top/bottom ``k`` tokens with their logit values and a histogram of all logits, per latent."""
    pos, neg, hist = [], [], []
    for d in directions.float():
        logits = d @ unembed.float()
        top, bot = logits.topk(k), logits.topk(k, largest=False)
        pos.append((decode(top.indices.tolist()), top.values.tolist()))
        neg.append((decode(bot.indices.tolist()), bot.values.tolist()))
        counts = torch.histc(logits, bins=bins)
        lo, hi = float(logits.min()), float(logits.max())
        width = (hi - lo) / bins
        hist.append((counts.tolist(), [lo + width * (i + 0.5) for i in range(bins)]))
    return Logits(pos, neg, hist)


def context_values(sources, latent: int, row: int, before: int = 8, after: int = 4) -> tuple[list[str], list[float]]:
    """The tokens of ``row``'s context and the latent's activation on each (sequence level: the whole input, the
    input's one activation on every token)."""
    store, sae, hp = sources.store, sources.model, sources.hookpoint
    ctx = store.row_context(row, before=before, after=after)
    if ctx.marked < 0:
        with torch.no_grad():
            value = float(sae.encode(store.rows(hp, row, row + 1).float())[0, latent])
        return list(ctx.tokens), [value] * len(ctx.tokens)
    lo = row - ctx.marked
    with torch.no_grad():
        codes = sae.encode(store.rows(hp, lo, lo + len(ctx.tokens)).float())
    return list(ctx.tokens), codes[:, latent].tolist()


def _jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, compresslevel=5, mtime=0))


def _jsonl(path: Path, row: dict[str, Any]) -> None:
    path.write_text(json.dumps(row) + "\n")


def write_neuronpedia(cd: ConceptDictionary, out: Path, cfg: NeuronpediaConfig, sources,
                      logits: Logits | None = None) -> Path:
    """Write the Neuronpedia export of ``cd`` under ``out``; returns the source directory.

    ``sources`` (``naming.open_sources`` of the dictionary) re-encodes each top example's context; ``logits``
    (:func:`logit_tables`) fills the logit tables when the model has an unembedding."""
    model_id = cfg.model_id or str(cd.meta.get("model") or "model").rstrip("/").split("/")[-1]
    hookpoint = cd.meta.get("hookpoint")
    layer = _layer(hookpoint)
    source_id = f"{layer}-{cfg.source_set}"
    where = out / model_id / source_id
    where.mkdir(parents=True, exist_ok=True)
    who = cfg.creator
    sequence = sources.store.level == "sequence"
    _jsonl(where / "release.jsonl", {"name": cfg.release, "description": f"{cfg.release}: exported by conceptdict",
                                     "descriptionShort": cfg.release, "urls": [cfg.url] if cfg.url else [],
                                     "creatorName": who, "creatorNameShort": who, "creatorId": who,
                                     "visibility": "PUBLIC", "createdAt": EPOCH})
    _jsonl(where / "model.jsonl", {"id": model_id, "displayName": model_id, "displayNameShort": model_id,
                                   "creatorId": who, "instruct": model_id.endswith("-it"), "layers": layer + 1,
                                   "neuronsPerLayer": len(cd.concepts), "owner": who, "visibility": "PUBLIC",
                                   "inferenceEnabled": False, "createdAt": EPOCH, "updatedAt": EPOCH})
    _jsonl(where / "sourceset.jsonl", {"modelId": model_id, "name": cfg.source_set, "creatorId": who,
                                       "creatorName": who, "description": f"conceptdict dictionary at {hookpoint}",
                                       "releaseName": cfg.release, "visibility": "PUBLIC", "urls": [],
                                       "createdAt": EPOCH})
    _jsonl(where / "source.jsonl", {
        "id": source_id, "modelId": model_id, "setName": cfg.source_set, "creatorId": who, "visibility": "PUBLIC",
        "hasDashboards": True, "inferenceEnabled": False, "dataset": str(cd.meta.get("store") or ""),
        "num_prompts": None, "num_tokens_in_prompt": None, "createdAt": EPOCH,
        "notes": ("sequence-level dictionary: each input has one activation, shown on every token" if sequence
                  else f"conceptdict hookpoint {hookpoint}")})
    features, activations, explanations = [], [], []
    directions = cd.directions.reshape(len(cd.concepts), -1)
    for c in cd.concepts:
        heights, centres = _histogram(c)
        key = {"modelId": model_id, "layer": source_id, "index": str(c.id)}
        rows = []
        for n, ex in enumerate(c.top_examples):
            tokens, values = context_values(sources, c.id, ex.row)
            if not tokens:
                continue
            top = max(range(len(values)), key=values.__getitem__)
            rows.append({"id": _cuid(model_id, source_id, c.id, "act", n), **key, "tokens": tokens,
                         "values": values, "maxValue": values[top], "maxValueTokenIndex": top,
                         "minValue": min(values), "creatorId": who, "dataSource": str(cd.meta.get("store") or ""),
                         "dataIndex": str(ex.row), "createdAt": EPOCH})
        activations += rows
        feature = {**key, "creatorId": who, "createdAt": EPOCH, "sourceSetName": cfg.source_set,
                   "maxActApprox": max([r["maxValue"] for r in rows], default=float(c.stats.get("max", 0.0))),
                   "hasVector": True, "vector": directions[c.id].tolist(),
                   "hookName": to_transformer_lens(hookpoint) if hookpoint else None,
                   "frac_nonzero": float(c.frequency), "freq_hist_data_bar_heights": heights,
                   "freq_hist_data_bar_values": centres, "pos_str": [], "pos_values": [], "neg_str": [],
                   "neg_values": [], "logits_hist_data_bar_heights": [], "logits_hist_data_bar_values": []}
        if logits is not None:
            feature.update(pos_str=logits.pos[c.id][0], pos_values=logits.pos[c.id][1],
                           neg_str=logits.neg[c.id][0], neg_values=logits.neg[c.id][1],
                           logits_hist_data_bar_heights=logits.hist[c.id][0],
                           logits_hist_data_bar_values=logits.hist[c.id][1])
        features.append(feature)
        if c.name:
            explanations.append({"id": _cuid(model_id, source_id, c.id, "explanation"), **key,
                                 "description": c.name, "authorId": who, "scoreV1": float(c.score),
                                 "typeName": f"conceptdict-{c.namer or 'namer'}",
                                 "explanationModelName": c.namer or None,
                                 "notes": "runner-ups: " + ", ".join(c.runner_ups) if c.runner_ups else None,
                                 "createdAt": EPOCH})
    _jsonl_gz(where / "features" / "batch-0.jsonl.gz", features)
    _jsonl_gz(where / "activations" / "batch-0.jsonl.gz", activations)
    _jsonl_gz(where / "explanations" / "batch-0.jsonl.gz", explanations)
    return where


def export_neuronpedia(dict_dir: Path, out: Path, cfg: NeuronpediaConfig, device: str = "cpu") -> Path:
    """Load the concept dictionary at ``dict_dir``, re-open its dictionary and store, compute the logit tables
    when its model has an unembedding, and write the export (:func:`write_neuronpedia`)."""
    from conceptdict.naming.concepts import load_concepts
    from conceptdict.naming.pipeline import open_sources

    cd = load_concepts(dict_dir)
    if not cd.meta.get("sae_dir"):
        raise ValueError(f"{dict_dir} records no sae_dir; Neuronpedia's activations are re-encoded from the "
                         f"dictionary, so name it with `conceptdict name SAE_DIR` first")
    sources = open_sources(cd.meta["sae_dir"], cd.meta.get("store"), cd.meta.get("hookpoint"), device)
    logits = None
    if cd.meta.get("model") and sources.store.level == "token":
        from conceptdict.activations import load_model

        lm = load_model(str(cd.meta["model"]), device=device)
        unembed = lm.unembed()
        if unembed is not None and unembed.shape[0] == cd.directions.shape[-1]:
            logits = logit_tables(cd.directions.reshape(len(cd.concepts), -1), unembed, lm.decode)
    return write_neuronpedia(cd, out, cfg, sources, logits)
