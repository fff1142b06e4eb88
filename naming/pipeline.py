"""``name_dictionary``: a trained dictionary + its activation store -> a named ConceptDictionary."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple

import torch
from torch import Tensor

from .concepts import Concept, ConceptDictionary
from .evidence import ContextCache, LatentEvidence, collect_evidence, iter_inputs, logit_lens
from .images import add_image_evidence, image_vocab_namer, is_image_store
from .llm import LlmConfig, LlmNamer
from .namers import ContextNamer, LogitLensNamer, Namer, NameResult, NamingInputs, VocabNamer, check_results
from .protocols import Dictionary, Store
from .vocab import DEFAULT_VOCAB, default_cache_dir, embed_vocabulary, load_vocabulary
from .written import joined_image_meta

log = logging.getLogger(__name__)

VOCAB_BATCH = 1024  # vocabulary words are short: large batches amortise the per-call cost of the model
PIECE = 1024
"""Latents whose examples, names and records are built at once (their evidence is gathered for the whole
dictionary, or a lazily read dictionary's block): what ``conceptdict name`` holds of them before they are written
(``naming.written``), whatever the dictionary's width. A multiple of the namers' own chunks (1024, 256), so that
their numbers do not depend on it."""


@dataclass
class NameConfig:
    """Flags of ``conceptdict name``."""

    out: Path | None = field(default=None, metadata={
        "help": "Directory for the concept dictionary (concepts.json, concepts.safetensors, report/)."})
    store: Path | None = field(default=None, metadata={
        "help": ("Activation store to draw evidence from (default: the store recorded in the dictionary's "
                 "config.json).")})
    namer: Literal["vocab", "context", "logit-lens", "llm"] = field(default="vocab", metadata={
        "help": "How latents get their names: vocab (Discover-then-Name), context, logit-lens or llm."})
    vocab: str = field(default=DEFAULT_VOCAB, metadata={
        "help": "Vocabulary for the vocab namer: wordfreq:LANG:N or a word-list file (one word per line)."})
    hookpoint: str | None = field(default=None, metadata={
        "help": ("Hookpoint the dictionary was trained on (default: from its config.json, else the store's only "
                 "one).")})
    model: str | None = field(default=None, metadata={
        "help": ("Model name or directory used to embed the vocabulary / for the logit lens (default: the store's "
                 "model).")})
    top_k: int = field(default=20, metadata={"help": "Top-activating examples kept per latent."})
    n_bins: int = field(default=32, metadata={"help": "Activation histogram bins per latent."})
    quantiles: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], metadata={"flag": "quantile",
        "help": "Activation quantiles to draw one example from each (repeat the flag)."})
    context_before: int = field(default=8, metadata={
        "help": "Tokens of context before the activating token (token-level stores)."})
    context_after: int = field(default=4, metadata={"help": "Tokens of context after the activating token."})
    max_chars: int = field(default=600, metadata={
        "help": "Longest text kept for a sequence-level example (whole inputs are truncated to this)."})
    runner_ups: int = field(default=4, metadata={"help": "Runner-up names kept per latent."})
    base_rows: int = field(default=512, metadata={"help": "Random rows for the context namer's base rates."})
    logit_tokens: int = field(default=10, metadata={
        "help": ("Top/bottom logit-lens tokens recorded per latent (token-level stores of models with an "
                 "unembedding).")})
    source: int = field(default=-1, metadata={
        "help": "Crosscoders: which source's decoder directions are named (default the last)."})
    cache_dir: Path | None = field(default=None, metadata={
        "help": "Where vocabulary embeddings are cached (default $CONCEPTDICT_CACHE or ~/.cache/conceptdict)."})
    chunk: int = field(default=4096, metadata={"help": "Store rows encoded at once."})
    device: str = field(default="cpu", metadata={"help": "Device for encoding and embedding."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed for sampled examples."})
    llm: LlmConfig = field(default_factory=LlmConfig, metadata={"help": "Settings of the llm namer."})

    def __post_init__(self) -> None:
        for name in ("top_k", "n_bins", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        bad = [q for q in self.quantiles if not 0 < q < 1]
        if bad:
            raise ValueError(f"quantiles {bad} must lie strictly between 0 and 1")


def model_id_of(store: Store) -> str | None:
    """The model name recorded in a store's manifest, if any."""
    m = store.manifest.get("model")
    if isinstance(m, dict):
        m = m.get("id") or m.get("name") or m.get("name_or_dir")
    return str(m) if m else None


def resolve_hookpoint(store: Store, hookpoint: str | None) -> str:
    if hookpoint is None:
        if len(store.hookpoints) != 1:
            raise ValueError(f"store {store.path} has hookpoints {store.hookpoints}; pick one with --hookpoint")
        return store.hookpoints[0]
    from conceptdict.saes import (
        match_hookpoint,  # the same tensor under another spelling (saes.formats)
    )

    found = match_hookpoint(hookpoint, store.hookpoints)
    if found is None:
        raise ValueError(f"hookpoint {hookpoint!r} is not in store {store.path}; it has {store.hookpoints}")
    return found


def model_loader(name: str | None, device: str) -> Callable[[], Any]:
    @functools.cache
    def get():
        if not name:
            raise ValueError("no model id: the store manifest names none; pass --model NAME_OR_DIR")
        from conceptdict.activations import load_model

        return load_model(name, device=device)

    return get


def build_namer(cfg: NameConfig, model_name: str | None, hookpoint: str, get_model) -> Namer:
    """The namer ``cfg.namer`` asks for (may load the model to embed a vocabulary or unembed)."""
    from conceptdict.activations import family_of

    if cfg.namer == "vocab" and family_of(model_name).modality == "image":
        return image_vocab_namer(cfg.vocab, model_name or "?", hookpoint, get_model, cfg.runner_ups,
                                 cfg.cache_dir or default_cache_dir(), VOCAB_BATCH)
    if cfg.namer == "vocab":
        def embed(texts: list[str]) -> Tensor:
            from conceptdict.activations import embed_texts

            with torch.no_grad():
                return embed_texts(get_model(), texts, hookpoint, batch_size=VOCAB_BATCH)

        words = load_vocabulary(cfg.vocab)
        ve = embed_vocabulary(words, model_name or "?", hookpoint, embed, cfg.cache_dir or default_cache_dir())
        return VocabNamer(tuple(ve.words), ve.embeddings, cfg.runner_ups)
    if cfg.namer == "context":
        return ContextNamer(cfg.runner_ups)
    if cfg.namer == "logit-lens":
        handle = get_model()
        W_U = handle.unembed()
        if W_U is None:
            raise ValueError(f"model {model_name} has no unembedding; use --namer vocab or context")
        return LogitLensNamer(W_U.float().cpu(), handle.decode, cfg.runner_ups)
    if cfg.namer == "llm":
        return LlmNamer(cfg.llm)
    raise ValueError(f"unknown namer {cfg.namer!r}; choose vocab, context, logit-lens or llm")


def _latent_flags(model: Dictionary, directions: Tensor, first: int = 0, total: int | None = None
                  ) -> list[dict[str, Any]]:
    """Per latent: of a 2-source crosscoder, its Delta (``relative_norm``), tag and decoder cosine (``cos_AB``) as
    ``conceptdict diff`` computes them (saes.diffing.decoder_table); of a cross-layer transcoder, the layer it reads
    and its decoder norm per target layer (``decoder_norms``, raw units; zero for the layers before its own);
    empty records otherwise. directions: the decoder rows [L, D] or [L, S, D] of ``model``'s latents, which are
    latents ``[first, first + L)`` of a dictionary of ``total`` (default L)."""
    from conceptdict.saes.diffing import decoder_table

    L = directions.shape[0]
    if _layered(model):
        norms = directions.norm(dim=2)
        layer = torch.arange(first, first + L) // ((total or L) // model.n_sources)
        return [{"layer": int(l), "decoder_norms": [round(float(v), 4) for v in row]}
                for l, row in zip(layer.tolist(), norms)]
    if getattr(model, "n_sources", 1) != 2:
        return [{} for _ in range(L)]
    table = decoder_table(model)
    return [{"relative_norm": d, "tag": tag, "cos_AB": c}
            for d, tag, c in zip(table.delta.tolist(), table.tags, table.cosine.tolist())]


def _layered(model: Dictionary) -> bool:
    """Whether ``model`` is a cross-layer transcoder (its latents read one layer's MLP input each)."""
    return bool(getattr(getattr(model, "spec", None), "layered", False))


def _stats(ev: LatentEvidence, j: int) -> dict[str, float]:
    s = {
        "max": float(ev.max[j]),
        "mean": float(ev.mean[j]),
        "mean_active": float(ev.mean_active[j]),
        "std_active": float(ev.std_active[j]),
        "count": float(ev.count[j]),
    }
    for q, v in zip(ev.quantile_levels.tolist(), ev.quantile_values[j].tolist()):
        s[f"q{round(q * 100):02d}"] = float(v)
    return s


class NamedBlock(NamedTuple):
    """The concepts of latents ``[first, first + len(concepts))`` (:meth:`Naming.block`)."""

    first: int
    concepts: tuple[Concept, ...]
    directions: Tensor
    """[l, D] or [l, S, D]: the block's decoder rows in raw activation units."""
    num_rows: int
    image_meta: dict[str, Any]
    """Of an image store: ``thumbnails`` (context -> data URI) of the examples this block shows, and ``patch_grid``."""


class Naming:
    """One naming run, prepared (store, hookpoints and namer checked, the namer built) and then run a range of
    latents at a time (:meth:`block`): every record of a latent depends on its own codes and direction alone
    (``naming.evidence``), so the blocks' concepts equal the whole dictionary's."""

    def __init__(self, model: Dictionary, store: Store, cfg: NameConfig, inputs: tuple[str, ...] = ()) -> None:
        self.hookpoint = resolve_hookpoint(store, cfg.hookpoint)
        self.inputs = list(inputs) or [self.hookpoint]
        missing = [h for h in self.inputs if h not in store.hookpoints]
        if missing:
            raise ValueError(f"the dictionary reads hookpoints {self.inputs}; store {store.path} lacks {missing} (it "
                             f"holds {store.hookpoints}): pass --store with the store it was trained on")
        self.model, self.store, self.cfg = model, store, cfg
        self.model_name = cfg.model or model_id_of(store)
        self.get_model = model_loader(self.model_name, cfg.device)
        self.level = getattr(store, "level", "token")
        self.namer = build_namer(cfg, self.model_name, self.hookpoint, self.get_model)  # a bad --vocab fails now
        if hasattr(model, "to"):
            model.to(cfg.device)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        base_rows = torch.randperm(store.num_rows, generator=gen)[: cfg.base_rows]
        cache = TruncatingContextCache(store, cfg.context_before, cfg.context_after, cfg.max_chars)
        self.base = tuple(cache.example(int(r), 0.0) for r in base_rows.tolist()) if cfg.namer == "context" else ()
        self.llm_named = 0  # latents the llm namer has named, against its max_latents

    def block(self, encoder: Dictionary, first: int = 0, cutoff: Tensor | None = None,
              exact: Dictionary | None = None, piece: int | None = None,
              inputs: tuple[str, ...] = ()) -> Iterator[NamedBlock]:
        """Name the latents of ``encoder`` (latents ``[first, first + its latents)`` of the dictionary; ``cutoff``:
        per store row, the least code of the whole dictionary's TopK, ``LazyDictionary.cutoffs``; ``exact``: an
        encoder of those latents that gives the whole dictionary's codes for any rows, for image heat maps;
        default ``encoder``; ``inputs``: the hookpoints it encodes, default the dictionary's): the evidence of all of
        them (tensors), then their examples, names and concepts ``piece`` latents at a time (None: all at once),
        each piece yielded as it is named."""
        cfg, store = self.cfg, self.store
        directions = encoder.decoder_directions().detach().float().cpu()
        ev = collect_evidence(
            encoder, store, list(inputs) or self.inputs, top_k=cfg.top_k, n_bins=cfg.n_bins,
            quantile_levels=cfg.quantiles, n_negatives=cfg.llm.n_heldout if cfg.namer == "llm" else 0,
            chunk=cfg.chunk, seed=cfg.seed, device=cfg.device, first=first, cutoff=cutoff,
        )  # fmt: skip
        flags = _latent_flags(encoder, directions, first, getattr(self.model, "n_latents", None))
        L = directions.shape[0]
        for p in range(0, L, piece or L):
            q = min(L, p + (piece or L))
            yield self._piece(ev, directions[p:q], flags[p:q], first, p, exact or encoder)

    def _piece(self, ev: LatentEvidence, directions: Tensor, flags: list[dict[str, Any]], first: int, p: int,
               exact: Dictionary) -> NamedBlock:
        """The concepts of latents ``first + p + [0, len(directions))``, the evidence's ``p, p + 1, ...``."""
        cfg, store = self.cfg, self.store
        named = directions if directions.ndim == 2 else directions[:, cfg.source]
        cache = TruncatingContextCache(store, cfg.context_before, cfg.context_after, cfg.max_chars)
        rows = range(p, p + named.shape[0])
        top = [cache.examples(ev.top_rows[j], ev.top_values[j]) for j in rows]
        quant = [cache.examples(ev.quantile_rows[j], ev.quantile_row_values[j]) for j in rows]
        neg = [cache.examples(ev.negative_rows[j], torch.zeros(ev.negative_rows.shape[1])) for j in rows]
        image_meta = {}
        if is_image_store(store):  # thumbnails, and heat maps over the patches of each example image
            groups, image_meta = add_image_evidence(_Columns(exact, p, p + len(rows)), store, self.hookpoint,
                                                    list(zip(top, quant)), cfg.device)
            top, quant = [g[0] for g in groups], [g[1] for g in groups]
        results = check_results(self._namer(top)(NamingInputs(named, top, quant, neg, self.base, first + p)),
                                len(rows), self.namer.kind)
        logit_top, logit_bottom = _logit_tokens(named, self.level, cfg, self.get_model)
        concepts = tuple(
            _concept(first + j, results[i], self.namer.kind, ev, j, top[i], quant[i], logit_top[i], logit_bottom[i],
                     flags[i])
            for i, j in enumerate(rows)
        )
        return NamedBlock(first + p, concepts, directions, ev.num_rows, image_meta)

    def _namer(self, top: list[tuple[Any, ...]]) -> Namer:
        """The namer of the next piece: the llm namer's ``max_latents`` counts every piece named before."""
        limit = self.cfg.llm.max_latents if isinstance(self.namer, LlmNamer) else 0
        if not limit:
            return self.namer
        left = max(limit - self.llm_named, 0)
        self.llm_named += min(left, sum(1 for t in top if t))
        return LlmNamer(dataclasses.replace(self.cfg.llm, max_latents=left)) if left else _Unnamed(self.namer.kind)

    @property
    def directions_shape(self) -> tuple[int, ...]:
        """Of the directions named: [L, D], or [L, S, D] with S > 1 sources."""
        m = self.model
        return (m.n_latents, m.d_in) if getattr(m, "n_sources", 1) == 1 else (m.n_latents, m.n_sources, m.d_in)

    def meta(self, num_rows: int, image_meta: dict[str, Any]) -> dict[str, Any]:
        """The concept dictionary's provenance (``ConceptDictionary.meta``)."""
        model, cfg = self.model, self.cfg
        return {
            "model": self.model_name,
            "hookpoint": self.hookpoint,
            "store": str(self.store.path),
            "level": self.level,
            "namer": self.namer.kind,
            "vocab": cfg.vocab if cfg.namer == "vocab" else None,
            "num_rows": num_rows,
            **image_meta,
            "dictionary": {"kind": getattr(model, "kind", None), "d_in": getattr(model, "d_in", None),
                           "k": getattr(model, "k", None)},
            # several sources: whose decoder rows the names (and an export's logit tables) read
            **({"source": cfg.source} if getattr(model, "n_sources", 1) > 1 else {}),
        }

    def blocks(self) -> Iterator[NamedBlock]:
        """The named pieces in latent order, :data:`PIECE` latents each: of the whole dictionary (its evidence
        gathered at once), or of a lazily read dictionary's blocks (``saes.lazy``), one block in memory at a time
        (its TopK's per-row cutoffs read first, one pass over the store per block); a lazily read cross-layer
        transcoder's layer by layer, each block's latents of that layer reading that layer's input alone
        (``LazyCLT.layer_latents``; ``clt``'s cutoffs per layer)."""
        from conceptdict.saes.lazy import LazyDictionary
        from conceptdict.saes.lazy_clt import LazyCLT

        model, cfg, n = self.model, self.cfg, self.store.num_rows
        if not isinstance(model, LazyDictionary):
            yield from self.block(model, piece=PIECE)
            return
        if not isinstance(model, LazyCLT):
            cutoff = model.cutoffs(lambda: iter_inputs(self.store, self.inputs, cfg.chunk), n)
            for a, b in model.blocks:
                yield from self.block(model.latents(a, b), a, cutoff, _Columns(model, a, b), PIECE)
            return
        for l, hp in enumerate(self.inputs):  # the layers' inputs
            cutoff = model.layer_cutoffs(l, lambda h=hp: iter_inputs(self.store, [h], cfg.chunk), n)
            for a, b in model.blocks:
                first = l * model.per_layer + a
                yield from self.block(model.layer_latents(l, a, b), first, cutoff,
                                      _Columns(model, first, first + b - a), PIECE, (hp,))


class _Columns:
    """Latents ``[start, stop)`` of ``model`` with their codes under the whole model's rule (a lazily read
    dictionary's reads every block per call: for the few rows of image heat maps)."""

    def __init__(self, model: Any, start: int, stop: int) -> None:
        self.model, self.start, self.stop = model, start, stop

    def encode(self, x: Tensor) -> Tensor:
        return self.model.encode(x)[..., self.start: self.stop]


@dataclass(frozen=True)
class _Unnamed:
    """The llm namer once ``max_latents`` latents are named: every latent stays unnamed."""

    kind: str

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        return [NameResult("", 0.0) for _ in inputs.directions]


def name_dictionary(model: Dictionary, store: Store, cfg: NameConfig,
                    inputs: tuple[str, ...] = ()) -> ConceptDictionary:
    """Gather evidence for every latent of ``model`` over ``store``, name it with ``cfg.namer``. ``inputs``: the
    hookpoints the dictionary encodes (a cross-layer transcoder's MLP inputs, :class:`Sources`' ``inputs``);
    default ``cfg.hookpoint``. A cross-layer transcoder's directions named (and logit-lensed) are its decoders to
    the layer ``cfg.source`` (default the last). Every concept in memory: :class:`Naming` names a block at a time
    (``naming.written`` writes each to disk)."""
    run = Naming(model, store, cfg, inputs)
    blocks = list(run.blocks())
    image_meta = joined_image_meta([b.image_meta for b in blocks])
    concepts = tuple(c for b in blocks for c in b.concepts)
    directions = torch.cat([b.directions for b in blocks]) if len(blocks) > 1 else blocks[0].directions
    log.info("named %d latents with the %s namer", len(concepts), run.namer.kind)
    return ConceptDictionary(concepts=concepts, directions=directions, meta=run.meta(blocks[0].num_rows, image_meta))


def _concept(id_, res: NameResult, kind, ev, j, top, quant, ltop, lbot, flags) -> Concept:
    """The concept of latent ``id_``, the ``j``-th of the evidence ``ev``."""
    extra = dict(flags)
    if int(ev.count[j]) == 0:
        extra["dead"] = True
    extra.update(getattr(res, "extra", None) or {})
    return Concept(
        id=id_,
        name=res.name,
        score=float(res.score),
        runner_ups=tuple(res.runner_ups),
        runner_up_scores=tuple(float(s) for s in res.runner_up_scores),
        namer=kind,
        frequency=float(ev.frequency[j]),
        stats=_stats(ev, j),
        histogram={"edges": ev.hist_edges[j].tolist(), "counts": [float(c) for c in ev.hist_counts[j].tolist()]},
        top_examples=top,
        quantile_examples=quant,
        logit_top=ltop,
        logit_bottom=lbot,
        extra=extra,
    )


def _logit_tokens(directions: Tensor, level: str, cfg: NameConfig, get_model):
    """Top/bottom logit-lens tokens per latent, or empty tuples where there is no unembedding."""
    L = directions.shape[0]
    empty = [()] * L
    if level != "token" or cfg.logit_tokens <= 0:
        return empty, empty
    try:
        handle = get_model()
    except Exception as e:  # the model is optional evidence: name without it
        log.warning("no logit lens: could not load the model (%s)", e)
        return empty, empty
    W_U = handle.unembed()
    if W_U is None or W_U.shape[0] != directions.shape[1]:
        return empty, empty
    lens = logit_lens(directions, W_U.cpu(), k=cfg.logit_tokens)
    top = [tuple(handle.decode(ids)) for ids in lens.top_ids.tolist()]
    bot = [tuple(handle.decode(ids)) for ids in lens.bottom_ids.tolist()]
    return top, bot


class TruncatingContextCache(ContextCache):
    """Context cache that keeps sequence-level inputs as truncated text (no token list)."""

    def __init__(self, store, before: int, after: int, max_chars: int) -> None:
        super().__init__(store, before, after)
        self.max_chars = max_chars

    def example(self, row: int, activation: float):
        e = super().example(row, activation)
        if e.marked >= 0:
            return e
        text = e.text if len(e.text) <= self.max_chars else e.text[: self.max_chars - 1] + "\u2026"
        return dataclasses.replace(e, tokens=(), text=text)


class Sources(NamedTuple):
    """A loaded dictionary with the store and hookpoint it is named over."""

    model: Dictionary
    store: Store
    hookpoint: str
    sae_config: dict
    inputs: tuple[str, ...] = ()
    """The hookpoints the dictionary encodes: ``(hookpoint,)``, a CLT's MLP inputs or a crosscoder's hookpoints."""


def open_sources(sae_dir: Any, store: str | Path | None = None, hookpoint: str | None = None,
                 device: str = "cpu", lazy: bool | None = False) -> Sources:  # fmt: skip
    """The dictionary (folder or SparseCoder) with the store and hookpoint it is named over (``store`` or the one
    its config.json records: ``conceptdict.naming.sources.open_run``) and the hookpoints it encodes
    (``naming.sources.encoded_inputs``). ``lazy``: as ``open_run``'s (None: read a block of latents at a time where it
    does not fit in memory, ``saes.lazy``)."""
    from conceptdict.naming.sources import encoded_inputs, open_run

    run = open_run(sae_dir, store=store, hookpoint=hookpoint, device=device, reads=True, lazy=lazy)
    model, hp, inputs = run.dictionary, run.hookpoints[0], encoded_inputs(run)
    return Sources(model, run.store, hp, run.config, inputs)
