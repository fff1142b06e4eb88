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

:func:`export_neuronpedia` reads the concept dictionary a block of concepts (and their directions) at a time
(``naming.concepts_file.ConceptsFile``) and writes each ``.jsonl.gz`` a record at a time (:class:`GzipLines`):
the files of the whole dictionary (:func:`write_neuronpedia`), holding one block: byte for byte where each
context is encoded alone (``BATCH_ROWS`` 1), the activations' values within float32 rounding where the contexts of
several concepts' examples are encoded together (the default: a batch's matmul may sum in another order).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import json
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from conceptdict.naming.concepts import Concept, ConceptDictionary
from conceptdict.saes.formats.hookpoints import to_transformer_lens
from torch import Tensor

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
    centres = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
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


MEMO = 1 << 21
"""Nonzero codes :class:`ContextValues` keeps of the contexts it encoded (12 bytes each; emptied when full)."""

BATCH_BYTES = 1 << 25
"""Dense codes (float32) of one :meth:`ContextValues.prefetch` batch: the store rows of the contexts it encodes in
one call, at most this over 4 x latents (and at most :data:`BATCH_ROWS`)."""

BATCH_ROWS = 4096


class ContextValues:
    """The tokens of a store row's context and a latent's activation on each (sequence level: the whole input, the
    input's one activation on every token), from ``sources`` (``naming.open_sources``).

    :meth:`prefetch` encodes the contexts of the next concepts' examples together, a batch of up to
    :data:`BATCH_ROWS` store rows per call (one pass over a dictionary read a block of latents at a time, instead
    of one per context); a row asked for without it is encoded alone. Each context's nonzero codes (and negative
    zeros) are kept, up to :data:`MEMO` of them, so that the latents whose examples share a row read it again
    without encoding it. A context's values are those of encoding its rows alone, bit for bit when it was (or
    ``BATCH_ROWS`` is 1), within float32 rounding when batched (a batch's matmul may sum in another order)."""

    def __init__(self, sources, before: int = 8, after: int = 4) -> None:
        self.sources, self.before, self.after = sources, before, after
        self.memo: dict[int, tuple[list[str], int, Tensor, Tensor, Tensor]] = {}
        self.held = 0
        latents = int(getattr(sources.model, "n_latents", 1))
        self.batch_rows = max(1, min(BATCH_ROWS, BATCH_BYTES // (4 * latents)))

    def _context(self, row: int) -> tuple[int, list[str], int, int]:
        """(row, the context's tokens, its first store row, its rows)."""
        ctx = self.sources.store.row_context(row, before=self.before, after=self.after)
        lo, n = (row, 1) if ctx.marked < 0 else (row - ctx.marked, len(ctx.tokens))
        return row, list(ctx.tokens), lo, n

    def _encode(self, contexts: Sequence[tuple[int, list[str], int, int]], needed: Iterable[int] = ()) -> None:
        """Encode ``contexts`` in one call and keep each one's codes; when the memo would overflow, it first drops
        every context but the ``needed`` rows'."""
        store, sae = self.sources.store, self.sources.model
        inputs = self.sources.inputs or (self.sources.hookpoint,)  # several: a crosscoder's or a CLT's, [n, S, D]
        rows = [torch.cat([store.rows(h, lo, lo + n) for _, _, lo, n in contexts]).float() for h in inputs]
        with torch.no_grad():
            codes = sae.encode(rows[0] if len(rows) == 1 else torch.stack(rows, 1))
        kept = (codes != 0) | torch.signbit(codes)
        total = int(kept.sum())
        if self.held + total > MEMO:
            self.memo = {r: self.memo[r] for r in needed if r in self.memo}
            self.held = sum(len(held[2]) for held in self.memo.values())
        start = 0
        for row, tokens, _, n in contexts:
            at, latent = kept[start: start + n].nonzero(as_tuple=True)
            self.memo[row] = (tokens, n, at.to(torch.int32), latent.to(torch.int32), codes[start + at, latent])
            self.held += len(at)
            start += n

    def prefetch(self, rows: Iterable[Sequence[int]]) -> int:
        """Encode the contexts not yet kept of the example rows of the next concepts (``rows``: each concept's), in
        batches of at most :attr:`batch_rows` store rows (a context longer than that alone), until a batch is full
        with at least one concept covered or every concept is; returns how many concepts are covered."""
        todo: dict[int, tuple[int, list[str], int, int]] = {}
        size, covered, needed = 0, 0, set()
        for mine in rows:
            needed.update(mine)
            for r in dict.fromkeys(mine):
                if r in self.memo or r in todo:
                    continue
                context = self._context(r)
                if todo and size + context[3] > self.batch_rows:
                    self._encode(list(todo.values()), needed)
                    if covered:
                        return covered
                    todo, size = {}, 0
                todo[r] = context
                size += context[3]
            covered += 1
        if todo:
            self._encode(list(todo.values()), needed)
        return covered

    def __call__(self, latent: int, row: int) -> tuple[list[str], list[float]]:
        if row not in self.memo:
            self._encode([self._context(row)])
        tokens, n, at, latents, values = self.memo[row]
        out = [0.0] * n
        mine = latents == latent
        for i, v in zip(at[mine].tolist(), values[mine].tolist()):
            out[i] = v
        return list(tokens), out * len(tokens) if n == 1 and len(tokens) != 1 else out


class GzipLines:
    """A ``.jsonl.gz`` written a record at a time: the bytes ``gzip.compress(all the lines, compresslevel=5,
    mtime=0)`` gives (its header, one raw deflate stream fed line by line, the CRC-32 and size). Written to
    ``PATH.part`` until :meth:`close`; :meth:`discard` removes it."""

    LEVEL = 5

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.part = path, path.with_name(path.name + ".part")
        self.file = open(self.part, "wb")  # noqa: SIM115 (closed by close / discard)
        self.file.write(gzip.compress(b"", compresslevel=self.LEVEL, mtime=0)[:10])
        self.deflate = zlib.compressobj(self.LEVEL, zlib.DEFLATED, -15)
        self.crc, self.size = 0, 0

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps(row) + "\n").encode()
        self.crc, self.size = zlib.crc32(data, self.crc), self.size + len(data)
        self.file.write(self.deflate.compress(data))

    def close(self) -> None:
        self.file.write(self.deflate.flush() + struct.pack("<LL", self.crc, self.size & 0xFFFFFFFF))
        self.file.close()
        self.part.replace(self.path)

    def discard(self) -> None:
        self.file.close()
        self.part.unlink(missing_ok=True)


def _jsonl(path: Path, row: dict[str, Any]) -> None:
    path.write_text(json.dumps(row) + "\n")


BLOCK = 512
"""Concepts :func:`export_neuronpedia` reads at a time."""

Blocks = Iterable[tuple[Sequence[Concept], Tensor]]
"""A concept dictionary's (concepts, their directions) a block at a time, in latent order."""


def write_neuronpedia(cd: ConceptDictionary, out: Path, cfg: NeuronpediaConfig, sources,
                      logits: Callable[[Tensor], Logits] | None = None) -> Path:
    """Write the Neuronpedia export of ``cd`` under ``out``; returns the source directory
    (:func:`write_neuronpedia_blocks` of one block)."""
    return write_neuronpedia_blocks(cd.meta, len(cd.concepts), [(cd.concepts, cd.directions)], out, cfg, sources,
                                    logits)


def write_neuronpedia_blocks(meta: dict[str, Any], n_concepts: int, blocks: Blocks, out: Path,
                             cfg: NeuronpediaConfig, sources, logits: Callable[[Tensor], Logits] | None = None) -> Path:
    """Write the Neuronpedia export of a concept dictionary (its ``meta``, ``n_concepts`` concepts given in
    ``blocks``) under ``out``, a block at a time; returns the source directory.

    ``sources`` (``naming.open_sources`` of the dictionary) re-encodes each top example's context (:class:`
    ContextValues`); ``logits`` (:func:`logit_tables` given the unembedding) gives a block's logit tables from its
    directions when the model has an unembedding."""
    model_id = cfg.model_id or str(meta.get("model") or "model").rstrip("/").split("/")[-1]
    hookpoint = meta.get("hookpoint")
    layer = _layer(hookpoint)
    source_id = f"{layer}-{cfg.source_set}"
    where = out / model_id / source_id
    where.mkdir(parents=True, exist_ok=True)
    who = cfg.creator
    sequence = sources.store.level == "sequence"
    values = ContextValues(sources)
    files = [GzipLines(where / sub / "batch-0.jsonl.gz") for sub in ("features", "activations", "explanations")]
    features, activations, explanations = files
    try:  # the source's records after the concepts: a damaged concept dictionary leaves no export
        for concepts, directions in blocks:
            # several sources (a crosscoder, a CLT's target layers): the logit tables of the source the names read
            named = directions if directions.ndim == 2 else directions[:, int(meta.get("source", -1))]
            directions = directions.reshape(len(concepts), -1)
            tables = logits(named) if logits is not None else None
            ready = 0
            for i, c in enumerate(concepts):
                if i == ready:  # the contexts of the next concepts' examples, encoded together
                    ready = i + max(1, values.prefetch([ex.row for ex in cc.top_examples] for cc in concepts[i:]))
                heights, centres = _histogram(c)
                key = {"modelId": model_id, "layer": source_id, "index": str(c.id)}
                top_max = None
                for n, ex in enumerate(c.top_examples):
                    tokens, acts = values(c.id, ex.row)
                    if not tokens:
                        continue
                    top = max(range(len(acts)), key=acts.__getitem__)
                    top_max = acts[top] if top_max is None else max(top_max, acts[top])
                    activations.write({"id": _cuid(model_id, source_id, c.id, "act", n), **key, "tokens": tokens,
                                       "values": acts, "maxValue": acts[top], "maxValueTokenIndex": top,
                                       "minValue": min(acts), "creatorId": who,
                                       "dataSource": str(meta.get("store") or ""), "dataIndex": str(ex.row),
                                       "createdAt": EPOCH})
                feature = {**key, "creatorId": who, "createdAt": EPOCH, "sourceSetName": cfg.source_set,
                           "maxActApprox": float(c.stats.get("max", 0.0)) if top_max is None else top_max,
                           "hasVector": True, "vector": directions[i].tolist(),
                           "hookName": to_transformer_lens(hookpoint) if hookpoint else None,
                           "frac_nonzero": float(c.frequency), "freq_hist_data_bar_heights": heights,
                           "freq_hist_data_bar_values": centres, "pos_str": [], "pos_values": [], "neg_str": [],
                           "neg_values": [], "logits_hist_data_bar_heights": [], "logits_hist_data_bar_values": []}
                if tables is not None:
                    feature.update(pos_str=tables.pos[i][0], pos_values=tables.pos[i][1],
                                   neg_str=tables.neg[i][0], neg_values=tables.neg[i][1],
                                   logits_hist_data_bar_heights=tables.hist[i][0],
                                   logits_hist_data_bar_values=tables.hist[i][1])
                features.write(feature)
                if c.name:
                    explanations.write({"id": _cuid(model_id, source_id, c.id, "explanation"), **key,
                                        "description": c.name, "authorId": who, "scoreV1": float(c.score),
                                        "typeName": f"conceptdict-{c.namer or 'namer'}",
                                        "explanationModelName": c.namer or None,
                                        "notes": "runner-ups: " + ", ".join(c.runner_ups) if c.runner_ups else None,
                                        "createdAt": EPOCH})
    except BaseException:
        for f in files:
            f.discard()
        for made in (*(f.path.parent for f in files), where, where.parent):  # those left empty
            with contextlib.suppress(OSError):
                made.rmdir()
        raise
    for f in files:
        f.close()
    _jsonl(where / "release.jsonl", {"name": cfg.release, "description": f"{cfg.release}: exported by conceptdict",
                                     "descriptionShort": cfg.release, "urls": [cfg.url] if cfg.url else [],
                                     "creatorName": who, "creatorNameShort": who, "creatorId": who,
                                     "visibility": "PUBLIC", "createdAt": EPOCH})
    _jsonl(where / "model.jsonl", {"id": model_id, "displayName": model_id, "displayNameShort": model_id,
                                   "creatorId": who, "instruct": model_id.endswith("-it"), "layers": layer + 1,
                                   "neuronsPerLayer": n_concepts, "owner": who, "visibility": "PUBLIC",
                                   "inferenceEnabled": False, "createdAt": EPOCH, "updatedAt": EPOCH})
    _jsonl(where / "sourceset.jsonl", {"modelId": model_id, "name": cfg.source_set, "creatorId": who,
                                       "creatorName": who, "description": f"conceptdict dictionary at {hookpoint}",
                                       "releaseName": cfg.release, "visibility": "PUBLIC", "urls": [],
                                       "createdAt": EPOCH})
    _jsonl(where / "source.jsonl", {
        "id": source_id, "modelId": model_id, "setName": cfg.source_set, "creatorId": who, "visibility": "PUBLIC",
        "hasDashboards": True, "inferenceEnabled": False, "dataset": str(meta.get("store") or ""),
        "num_prompts": None, "num_tokens_in_prompt": None, "createdAt": EPOCH,
        "notes": ("sequence-level dictionary: each input has one activation, shown on every token" if sequence
                  else f"conceptdict hookpoint {hookpoint}")})
    return where


def export_neuronpedia(dict_dir: Path, out: Path, cfg: NeuronpediaConfig, device: str = "cpu",
                       block: int = BLOCK) -> Path:
    """Read the concept dictionary at ``dict_dir`` ``block`` concepts at a time (``naming.concepts_file``), re-open
    its dictionary (a block of latents at a time where it does not fit in memory) and store, compute each block's
    logit tables when its model has an unembedding, and write the export (:func:`write_neuronpedia_blocks`)."""
    from functools import partial

    from conceptdict.naming.concepts_file import ConceptsFile
    from conceptdict.naming.pipeline import open_sources

    file = ConceptsFile(dict_dir)
    meta = file.meta
    if not meta.get("sae_dir"):
        raise ValueError(f"{dict_dir} records no sae_dir; Neuronpedia's activations are re-encoded from the "
                         f"dictionary, so name it with `conceptdict name SAE_DIR` first")
    sources = open_sources(meta["sae_dir"], meta.get("store"), meta.get("hookpoint"), device, lazy=None)
    logits = None
    if meta.get("model") and sources.store.level == "token":
        from conceptdict.activations import load_model

        lm = load_model(str(meta["model"]), device=device)
        unembed = lm.unembed()
        if unembed is not None and unembed.shape[0] == file.directions_shape[-1]:
            logits = partial(logit_tables, unembed=unembed, decode=lm.decode)
    return write_neuronpedia_blocks(meta, file.n_concepts, file.blocks(block), out, cfg, sources, logits)
