"""Concepts: name a dictionary's latents, score the names, fit concept bottlenecks, export what other tools read."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict, overload

import torch
from conceptdict.activations import (  # ActivationStore: StoreLike's hints name it (typing.get_type_hints(cd.score))
    ActivationStore,  # noqa: F401
    first_batches,
    heldout_batches,
    heldout_row_ids,
)
from conceptdict.export_formats import export_format, formats_help, write_export
from conceptdict.naming import (
    CbmConfig,
    CbmResult,
    ConceptDictionary,
    NameConfig,
    NamedSummary,
    Naming,
    concept_directions,
    load_concepts,
    name_dictionary,
    open_sources,
    save_cbm,
    save_concepts,
    train_cbm,
    write_named,
    write_report,
)
from conceptdict.cbm_inputs import cbm_inputs, check_sae_fits, label_column_of, labelled_store  # noqa: F401
from conceptdict.naming.bottleneck.added import cbm_residual
from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
from conceptdict.naming.llm import LlmConfig
from conceptdict.naming.negatives import NegativeConfig
from conceptdict.naming.scoring import ScoreConfig
from conceptdict.naming.sources import Run, open_run, training_heldout
from conceptdict.objects import CbmLike, ConceptsLike, DictionaryLike, StoreLike
from conceptdict.outdir import guarded
from conceptdict.saes import SparseCoder  # noqa: F401 (DictionaryLike's hints name it: typing.get_type_hints(cd.name))
from conceptdict.settings import (
    ConfigError,
    config_from_dict,
    given,
    home_of,
    takes_settings,
    write_resolved_config,
)
from typing_extensions import Unpack

log = logging.getLogger(__name__)


class NameKeywords(TypedDict, total=False):
    """Every keyword of :func:`name` but the dictionary and ``in_memory``: :class:`NameConfig`'s settings and
    ``overwrite``."""

    store: StoreLike | None
    out: str | Path | None
    namer: str
    vocab: str
    hookpoint: str | None
    model: str | None
    top_k: int
    n_bins: int
    quantile: float | Sequence[float] | None
    context_before: int
    context_after: int
    max_chars: int
    runner_ups: int
    base_rows: int
    logit_tokens: int
    source: int
    cache_dir: str | Path | None
    chunk: int
    device: str
    seed: int
    llm: LlmConfig | dict[str, Any] | None
    overwrite: bool


@overload
def name(dictionary: DictionaryLike, *, in_memory: Literal[True] = True,
         **settings: Unpack[NameKeywords]) -> ConceptDictionary: ...


@overload
def name(dictionary: DictionaryLike, *, in_memory: Literal[False], **settings: Unpack[NameKeywords]) -> NamedSummary: ...


@overload
def name(dictionary: DictionaryLike, *, in_memory: bool = True,
         **settings: Unpack[NameKeywords]) -> ConceptDictionary | NamedSummary: ...


@guarded("name")
@takes_settings(NameConfig, extra=("overwrite", "in_memory"))
def name(dictionary: DictionaryLike, *, in_memory: bool = True,
         **settings: Unpack[NameKeywords]) -> ConceptDictionary | NamedSummary:
    """Name every latent of a dictionary (a folder or SparseCoder; ``conceptdict name``): discover (stream the store
    through it, gather each latent's evidence), then name (vocab as in Discover-then-Name, context, logit-lens or
    llm). With ``out`` writes concepts.json, concepts.safetensors and report/ there; the result remembers it.

    ``in_memory=False`` (needs ``out``; the command line's way) writes them a block of latents at a time and returns
    a :class:`~conceptdict.naming.written.NamedSummary` (counts and the most frequent concepts) instead of every
    concept: a dictionary read lazily (``saes.lazy``: it does not fit in memory) is then named one block in memory
    at a time. The files are the same either way."""
    cfg = config_from_dict(NameConfig, given(settings, "overwrite"), "name")
    if not in_memory and cfg.out is None:
        raise ConfigError("name(in_memory=False) writes the concepts to out= as it goes: pass out=DIR (or leave "
                          "in_memory=True to get them in memory)")
    src = open_sources(dictionary, cfg.store, cfg.hookpoint, cfg.device, lazy=None)  # lazily if it does not fit
    cfg = dataclasses.replace(cfg, hookpoint=src.hookpoint, store=src.store.path)
    home = dictionary if isinstance(dictionary, (str, Path)) else getattr(dictionary, "path", None)
    sae_dir = {"sae_dir": None if home is None else str(home)}
    if not in_memory:
        run = Naming(src.model, src.store, cfg, src.inputs)
        summary = write_named(run.blocks(), cfg.out, run.directions_shape,
                              lambda num_rows, images: {**run.meta(num_rows, images), **sae_dir})
        write_resolved_config(cfg, cfg.out, "name_config.json")
        return summary
    cd = name_dictionary(src.model, src.store, cfg, src.inputs)
    cd = dataclasses.replace(cd, meta={**cd.meta, **sae_dir})
    if cfg.out is not None:
        save_concepts(cd, cfg.out)
        write_resolved_config(cfg, cfg.out, "name_config.json")
        write_report(cd, cfg.out / "report")
        cd = dataclasses.replace(cd, path=cfg.out)
    return cd


@takes_settings(ScoreConfig, extra=("in_memory",))
def score(concepts: ConceptsLike, *, scorer: str | Sequence[str] | None = None,
          namer: str | Sequence[str] | None = None, negatives: NegativeConfig | dict[str, Any] | None = None,
          control: bool = True, encoder: str = "default", encoder_hookpoint: str = "sentence.mean_normalized",
          store: StoreLike | None = None, sae_dir: DictionaryLike | None = None, vocab: str = "wordfreq:en:20000",
          max_latents: int = 0, batch_size: int = 256, device: str = "cpu", seed: int = 0,
          llm: LlmConfig | dict[str, Any] | None = None, in_memory: bool = True) -> ConceptDictionary | NamedSummary:
    """Score every concept's name (``conceptdict score``): embedding AUROC, LLM detection / fuzzing, against random
    and hard negatives; the scores are written into the concept dictionary's folder in place, a block of concepts
    at a time (``naming.score_run.score_in_place``: one block of its records in memory). Returns the scored
    concept dictionary, read back whole; ``in_memory=False`` (the command line's way) a
    :class:`~conceptdict.naming.written.NamedSummary` instead (counts, most frequent concepts, the meta with the
    scoring summary)."""
    settings = given(locals(), "concepts", "in_memory")  # first: before any local name
    from conceptdict.naming.score_run import score_in_place

    cfg = config_from_dict(ScoreConfig, settings, "score")
    concepts = home_of(concepts, "concepts")
    summary = score_in_place(Path(concepts), cfg)
    write_resolved_config(cfg, concepts, "score_config.json")
    if not in_memory:
        return summary
    scored = load_concepts(concepts)
    if "llm_usage_line" in summary.meta["scoring"]:
        scored.meta["scoring"]["llm_usage_line"] = summary.meta["scoring"]["llm_usage_line"]
    return dataclasses.replace(scored, path=Path(concepts))


@guarded("cbm")
@takes_settings(CbmConfig, extra=("overwrite",))
def cbm(concepts: ConceptsLike, *, label_column: str | None = None, dataset: str | Path = "store",
        out: str | Path | None = None, sae: DictionaryLike | None = None,
        also: ConceptsLike | Sequence[ConceptsLike] | None = None, pooling: str = "super",
        codes: str = "relu", scale: str = "probe", super_quantile: float = 0.1,
        lam: float | Sequence[float] | None = None, probe_l2: float | Sequence[float] | None = None,
        max_iter: int = 5000, tol: float = 0.0001, refit_l2: float | Sequence[float] | None = None,
        val_tolerance: float = 0.005, grow_lambda: int = 3, max_per_prediction: int = 32, cv_folds: int = 5,
        cv_max_rows: int = 4000,
        add_pairs: int = 0, add_max_share: float = 0.5, add_scale: str = "capped", add_reads: str = "raw",
        val_fraction: float = 0.15, test_fraction: float = 0.2, zero_tol: float = 0.01, min_class_size: int = 5,
        seed: int = 0,
        device: str = "cpu", overwrite: bool = False) -> CbmResult:
    """A sparse concept bottleneck model on a concept dictionary (a folder or the object ``cd.name`` returned),
    beside a linear probe on the raw activations (``conceptdict cbm``). ``label_column`` names the store's label
    column (default: the store's only one); ``dataset`` is "store" (the dictionary's own store) or another store at
    the same hookpoint. ``also``: other concept dictionaries of the same labelled texts (e.g. a token-level one),
    their concepts joined to these in one bottleneck (names prefixed by hookpoint; ``naming.bottleneck.joined``).
    With ``out`` writes cbm.json, cbm.safetensors and report/cbm.html there."""
    settings = given(locals(), "concepts", "overwrite")  # first: before any local name
    if not isinstance(settings.get("dataset", ""), str):
        settings["dataset"] = str(home_of(settings["dataset"], "dataset"))
    if "also" in settings:
        others = settings["also"] if isinstance(settings["also"], (list, tuple)) else [settings["also"]]
        settings["also"] = [home_of(o, "also") for o in others]
    cfg = config_from_dict(CbmConfig, settings, "cbm")
    cd = concepts if isinstance(concepts, ConceptDictionary) else load_concepts(concepts)
    concepts = cd.path if cd.path is not None else "(in memory)"
    got = cbm_inputs(cd, cfg)
    cfg, feats, (model, config, store, hookpoint, sae) = got.cfg, got.features, got.sources[0]
    # with --also, got.parts: each dictionary's columns (ids run on from one to the next; directions unused)
    result = train_cbm(feats.concepts, feats.labels, got.names, cfg, raw=feats.raw,
                       directions=concept_directions(model, feats.raw.shape[1]),
                       residual=cbm_residual(model, feats.raw, cfg.add_reads) if cfg.add_pairs else None,
                       parts=got.parts)
    result.metrics["dictionary"] = dictionary_fit(Run(model, config, store, [hookpoint], sae))
    result = dataclasses.replace(result, meta={"dict_dir": str(concepts), "store": str(store.path),
                                               "hookpoint": hookpoint, "label_column": cfg.label_column,
                                               "pooling": cfg.pooling if any(s[2].level == "token" for s in
                                                                             got.sources) else "none",
                                               "codes": cfg.codes, "super_quantile": cfg.super_quantile,
                                               "sae": str(sae), **({"also": [str(o) for o in cfg.also]} if cfg.also
                                                                   else {})})  # fmt: skip
    if cfg.out is not None:
        save_cbm(result, cfg.out)
        write_resolved_config(cfg, cfg.out, "cbm_config.json")
        write_report(cd, cfg.out / "report", cbm=result)
        result = dataclasses.replace(result, path=cfg.out)
    return result


def dictionary_fit(run: Run, rows: int = 65536) -> dict[str, Any]:
    """The dictionary's held-out FVU and L0 on a labelled store (what a CBM's gap to its probe is explained by):
    on the batches its training held out when it was trained on this store, else on the store's first ``rows``
    rows (held out when it was trained on other stores); beside the held-out FVU its training recorded."""
    from conceptdict.saes import evaluate

    model, store, hookpoint = run.dictionary, run.store, run.hookpoints[0]
    batches = heldout_batches(training_heldout(run), store, [hookpoint], rows)
    where = "training's held-out batches"
    if batches is None:
        trained_on = [str(Path(s).resolve()) for s in run.config.get("stores") or []]
        where = "its training store's first rows" if str(store.path.resolve()) in trained_on else "not trained on"
        batches = first_batches(store, [hookpoint], rows, 4096)
    res = evaluate(model, batches)
    summary = getattr(model, "training_summary", None) or {}
    own = (summary.get("heldout_eval") or {}).get("fvu")
    return {"fvu": res.fvu, "l0": res.l0, "k": res.k, "n_latents": res.n_latents, "rows": res.n_tokens,
            "rows_from": where, "training_fvu": own, "fit_gap": summary.get("fit_gap")}


class CbSaeResult(NamedTuple):
    """A CB-SAE: where its dictionary and concepts went, and the summary written to cbsae.json."""

    dictionary: Path
    concepts: Path
    summary: dict[str, Any]

    def format(self) -> str:
        from conceptdict.naming.bottleneck.cbsae_run import summary_lines

        return "\n".join(summary_lines(self.summary))

    def to_dict(self) -> dict[str, Any]:
        """cbsae.json's summary as plain JSON types, with where the dictionary and its concepts went."""
        from conceptdict.saes.tables import plain

        return plain({"dictionary": self.dictionary, "concepts": self.concepts, **self.summary})

    def to_pandas(self) -> Any:
        """A DataFrame with one row per measure (latents, FVU, interpretability, steerability, CBM accuracy, each added
        concept's alignment): before, pruned, after (``cbsae_run.summary_rows``)."""
        from conceptdict.naming.bottleneck.cbsae_run import summary_rows
        from conceptdict.saes.tables import frame

        return frame(summary_rows(self.summary), ["measure", "before", "pruned", "after"])


@guarded("cbsae")
@takes_settings(CbSaeConfig, extra=("label_column", "overwrite"))
def cbsae(dictionary: ConceptsLike, label_column: str | None = None, *, concepts: str | Path | None = None,
          out: str | Path | None = None, interpretability: str = "embedding", min_interpretability: float = 0.7,
          min_steerability: float = 0.6, match_cosine: float = 0.8, align_weight: float = 1.0,
          fire_fraction: float = 0.1, steps: int = 3000, batch_size: int = 256, lr: float = 0.001,
          max_rows: int = 20000, seed: int = 0, device: str = "cpu", overwrite: bool = False) -> CbSaeResult:
    """CB-SAE (``conceptdict cbsae``): prune the latents a scored concept dictionary rates low on interpretability or
    steerability and add bottleneck latents for the user's concepts it lacks. ``dictionary``: the scored concept
    dictionary (its folder or the object ``cd.score`` returned); ``concepts``: a text file of concepts, one per
    line; ``out`` is required; ``label_column``: a store label column for CBM accuracy before and after."""
    settings = given(locals(), "dictionary", "label_column", "overwrite")  # first: before any local name
    from conceptdict.naming.bottleneck.cbsae import config_dict, save_cbsae
    from conceptdict.naming.bottleneck.cbsae_run import build_cbsae, read_concept_list

    cfg = config_from_dict(CbSaeConfig, settings, "cbsae")
    if cfg.out is None or cfg.concepts is None:
        raise ConfigError("conceptdict cbsae needs --concepts FILE and --out DIR")
    dictionary = home_of(dictionary, "dictionary")
    cd = load_concepts(dictionary)
    if not cd.meta.get("sae_dir"):
        raise ConfigError(f"{dictionary} records no sae_dir; name the dictionary with `conceptdict name` first")
    run = open_run(cd.meta["sae_dir"], store=cd.meta.get("store"), hookpoint=cd.meta.get("hookpoint"),
                   device=cfg.device)
    src = open_sources(run.dictionary, run.store.path, run.hookpoints[0], cfg.device)
    held = heldout_row_ids(training_heldout(run), src.store)
    model, scored, summary = build_cbsae(cd, src, read_concept_list(cfg.concepts), cfg, label_column=label_column,
                                         heldout=None if held is None else torch.from_numpy(held))
    save_cbsae(model, cfg.out / "dictionary", cd.meta["sae_dir"],
               extra={"stores": [str(src.store.path)], "hookpoints": [src.hookpoint]})
    scored.meta["sae_dir"] = str(cfg.out / "dictionary")
    save_concepts(scored, cfg.out / "concepts")
    write_report(scored, cfg.out / "concepts" / "report")
    doc = {"config": config_dict(cfg), "source": str(dictionary), **summary}
    (cfg.out / "cbsae.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return CbSaeResult(cfg.out / "dictionary", cfg.out / "concepts", summary)


@dataclass
class ExportConfig:
    """Settings of ``conceptdict export``."""

    out: Path | None = field(default=None, metadata={"help": "Output directory."})
    format: str = field(default="html", metadata={"help": formats_help()})
    cbm: Path | None = field(default=None, metadata={"help": "html only: a CBM directory whose pages are added."})
    per_page: int = field(default=200, metadata={"help": "html only: concept cards per page."})
    neuronpedia_model: str | None = field(default=None, metadata={
        "help": "neuronpedia only: the Neuronpedia model id; default: the last part of the model's name."})
    source_set: str = field(default="conceptdict", metadata={
        "help": "neuronpedia only: the source set name (the source id is LAYER-SOURCE_SET)."})
    creator: str = field(default="conceptdict", metadata={"help": "neuronpedia only: the creator name and id."})
    device: str = field(default="cpu", metadata={"help": "neuronpedia only: device for re-encoding examples."})
    push: str | None = field(default=None, metadata={
        "help": ("Upload the written --out directory to a Hugging Face repo: hf:OWNER/REPO[/SUBDIR] (created when "
                 "missing; needs `hf auth login` or HF_TOKEN).")})

    def __post_init__(self) -> None:
        if self.per_page < 1:
            raise ConfigError(f"per_page={self.per_page} must be at least 1")
        export_format(self.format)  # an unknown name lists the formats


@guarded("export")
@takes_settings(ExportConfig, extra=("overwrite",))
def export(source: DictionaryLike | ConceptsLike, *, out: str | Path | None = None, format: str = "html",
           cbm: CbmLike | None = None, per_page: int = 200, neuronpedia_model: str | None = None,
           source_set: str = "conceptdict", creator: str = "conceptdict", device: str = "cpu",
           push: str | None = None, overwrite: bool = False) -> Path:
    """Write a concept dictionary (json, html report, Neuronpedia) or a dictionary (SAELens, sparsify,
    dictionary_learning, circuit-tracer layouts, with a model card) for other tools (``conceptdict export``; the
    formats: ``conceptdict.export_formats``); returns the main file or directory written. Exports name the model by
    its hub id, never a local path. ``push="hf:OWNER/REPO"`` then uploads the ``out`` directory to that repo.
    ``source``: a folder, or the object that was written there."""
    cfg = config_from_dict(ExportConfig, given(locals(), "source", "overwrite"), "export")
    if cfg.out is None:
        raise ConfigError("conceptdict export needs --out DIR")
    if cfg.push is not None:
        from conceptdict.saes.formats import hub

        hub.push_token(cfg.push)  # a bad name, offline mode or no login fails before anything is written
    written = write_export(Path(home_of(source, "source")), cfg)
    if cfg.push is not None:
        from conceptdict.activations.lock import LOCK_NAME
        from conceptdict.outdir import MARKER

        url = hub.push(cfg.out, cfg.push, message=f"conceptdict export --format {cfg.format}",
                       ignore=[MARKER, LOCK_NAME])
        log.info("uploaded %s to %s", cfg.out, url)
    return written
