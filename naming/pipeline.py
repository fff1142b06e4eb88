"""``name_dictionary``: a trained dictionary + its activation store -> a named ConceptDictionary."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

import torch
from torch import Tensor

from .concepts import Concept, ConceptDictionary
from .evidence import ContextCache, LatentEvidence, collect_evidence, logit_lens
from .images import add_image_evidence, image_vocab_namer, is_image_store
from .llm import LlmConfig, LlmNamer
from .namers import ContextNamer, LogitLensNamer, Namer, NameResult, NamingInputs, VocabNamer, check_results
from .protocols import Dictionary, Store
from .vocab import DEFAULT_VOCAB, default_cache_dir, embed_vocabulary, load_vocabulary

log = logging.getLogger(__name__)

VOCAB_BATCH = 1024  # vocabulary words are short: large batches amortise the per-call cost of the model


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
        "help": "Crosscoders: which source's decoder directions are named (default the last, model B)."})
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
    from conceptdict.saes import match_hookpoint  # the same tensor under another spelling (saes.formats)

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


def _latent_flags(model: Dictionary, directions: Tensor) -> list[dict[str, Any]]:
    """Per latent: of a 2-source crosscoder, its Delta (``relative_norm``), tag and decoder cosine (``cos_AB``) as
    ``conceptdict diff`` computes them (saes.diffing.decoder_table); of a cross-layer transcoder, the layer it reads
    and its decoder norm per target layer (``decoder_norms``, raw units; zero for the layers before its own);
    empty records otherwise. directions: the decoder rows [L, D] or [L, S, D]."""
    from conceptdict.saes.diffing import decoder_table

    L = directions.shape[0]
    if _layered(model):
        norms = directions.norm(dim=2)
        layer = torch.arange(L) // (L // model.n_sources)
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


def name_dictionary(model: Dictionary, store: Store, cfg: NameConfig,
                    inputs: tuple[str, ...] = ()) -> ConceptDictionary:
    """Gather evidence for every latent of ``model`` over ``store``, name it with ``cfg.namer``. ``inputs``: the
    hookpoints the dictionary encodes (a cross-layer transcoder's MLP inputs, :class:`Sources`' ``inputs``);
    default ``cfg.hookpoint``. A cross-layer transcoder's directions named (and logit-lensed) are its decoders to
    the layer ``cfg.source`` (default the last)."""
    hookpoint = resolve_hookpoint(store, cfg.hookpoint)
    inputs = list(inputs) or [hookpoint]
    missing = [h for h in inputs if h not in store.hookpoints]
    if missing:
        raise ValueError(f"the dictionary reads hookpoints {inputs}; store {store.path} lacks {missing} (it holds "
                         f"{store.hookpoints}): pass --store with the store it was trained on")
    model_name = cfg.model or model_id_of(store)
    get_model = model_loader(model_name, cfg.device)
    directions = model.decoder_directions().detach().float().cpu()
    named = directions if directions.ndim == 2 else directions[:, cfg.source]
    level = getattr(store, "level", "token")
    namer = build_namer(cfg, model_name, hookpoint, get_model)  # before the evidence pass: a bad --vocab fails now
    if hasattr(model, "to"):
        model.to(cfg.device)
    ev = collect_evidence(
        model, store, inputs, top_k=cfg.top_k, n_bins=cfg.n_bins, quantile_levels=cfg.quantiles,
        n_negatives=cfg.llm.n_heldout if cfg.namer == "llm" else 0, chunk=cfg.chunk, seed=cfg.seed,
        device=cfg.device,
    )  # fmt: skip
    cache = TruncatingContextCache(store, cfg.context_before, cfg.context_after, cfg.max_chars)
    L = named.shape[0]
    top = [cache.examples(ev.top_rows[j], ev.top_values[j]) for j in range(L)]
    quant = [cache.examples(ev.quantile_rows[j], ev.quantile_row_values[j]) for j in range(L)]
    neg = [cache.examples(ev.negative_rows[j], torch.zeros(ev.negative_rows.shape[1])) for j in range(L)]
    image_meta = {}
    if is_image_store(store):  # thumbnails, and heat maps over the patches of each example image
        groups, image_meta = add_image_evidence(model, store, hookpoint, list(zip(top, quant)), cfg.device)
        top, quant = [g[0] for g in groups], [g[1] for g in groups]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    base_rows = torch.randperm(store.num_rows, generator=gen)[: cfg.base_rows]
    base = tuple(cache.example(int(r), 0.0) for r in base_rows.tolist()) if cfg.namer == "context" else ()
    inputs = NamingInputs(named, top, quant, neg, base)
    results = check_results(namer(inputs), L, namer.kind)
    logit_top, logit_bottom = _logit_tokens(named, level, cfg, get_model)
    flags = _latent_flags(model, directions)
    concepts = tuple(
        _concept(j, results[j], namer.kind, ev, top[j], quant[j], logit_top[j], logit_bottom[j], flags[j])
        for j in range(L)
    )
    meta = {
        "model": model_name,
        "hookpoint": hookpoint,
        "store": str(store.path),
        "level": level,
        "namer": namer.kind,
        "vocab": cfg.vocab if cfg.namer == "vocab" else None,
        "num_rows": ev.num_rows,
        **image_meta,
        "dictionary": dict(
            kind=getattr(model, "kind", None), d_in=getattr(model, "d_in", None), k=getattr(model, "k", None)
        ),
    }
    log.info("named %d latents with the %s namer", L, namer.kind)
    return ConceptDictionary(concepts=concepts, directions=directions, meta=meta)


def _concept(j, res: NameResult, kind, ev, top, quant, ltop, lbot, flags) -> Concept:
    extra = dict(flags)
    if int(ev.count[j]) == 0:
        extra["dead"] = True
    extra.update(getattr(res, "extra", None) or {})
    return Concept(
        id=j,
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
    """The hookpoints the dictionary encodes: ``(hookpoint,)``, or a cross-layer transcoder's MLP inputs."""


def open_sources(sae_dir: Any, store: str | Path | None = None, hookpoint: str | None = None,
                 device: str = "cpu", lazy: bool | None = False) -> Sources:  # fmt: skip
    """The dictionary (folder or SparseCoder) with the store and hookpoint it is named over (``store`` or the one
    its config.json records: ``conceptdict.naming.sources.open_run``; a crosscoder is named over model A's store).
    ``lazy``: as ``open_run``'s (None: read a block of latents at a time where it does not fit in memory, ``saes.lazy``)."""
    from conceptdict.naming.sources import open_run

    run = open_run(sae_dir, store=store, hookpoint=hookpoint, device=device, reads=True, lazy=lazy)
    model, hp = run.dictionary, run.hookpoints[0]
    inputs = tuple(run.hookpoints[: model.n_sources]) if _layered(model) else (hp,)
    return Sources(model, run.store, hp, run.config, inputs)
