"""Concepts: name a dictionary's latents, score the names, fit concept bottlenecks, export what other tools read."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from conceptdict.activations import ActivationStore, first_batches, heldout_batches, heldout_row_ids
from conceptdict.naming import (
    CbmConfig,
    CbmResult,
    ConceptDictionary,
    concept_directions,
    NameConfig,
    load_concepts,
    name_dictionary,
    open_sources,
    save_cbm,
    save_concepts,
    store_features,
    train_cbm,
    write_report,
)
from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
from conceptdict.naming.scoring import ScoreConfig
from conceptdict.saes.artifact import FORMAT as ARTIFACT_FORMAT
from conceptdict.eval_api import training_heldout
from conceptdict.export_formats import export_format, formats_help, write_export
from conceptdict.settings import ConfigError, config_from_dict, write_resolved_config
from conceptdict.outdir import guarded

log = logging.getLogger(__name__)


@guarded("name")
def name(dictionary: str | Path, **settings: Any) -> ConceptDictionary:
    """Name every latent of a dictionary (``conceptdict name``): discover (stream the store through it, gather each
    latent's evidence), then name (vocab as in Discover-then-Name, context, logit-lens or llm). Settings are
    :class:`NameConfig`'s; with ``out=`` writes concepts.json, concepts.safetensors and report/ there."""
    cfg = config_from_dict(NameConfig, settings, "name")
    src = open_sources(dictionary, cfg.store, cfg.hookpoint, cfg.device)
    cfg = dataclasses.replace(cfg, hookpoint=src.hookpoint, store=src.store.path)
    cd = name_dictionary(src.model, src.store, cfg, src.inputs)
    cd = dataclasses.replace(cd, meta={**cd.meta, "sae_dir": str(dictionary)})
    if cfg.out is not None:
        save_concepts(cd, cfg.out)
        write_resolved_config(cfg, cfg.out, "name_config.json")
        write_report(cd, cfg.out / "report")
    return cd


def score(concepts: str | Path, **settings: Any) -> ConceptDictionary:
    """Score every concept's name (``conceptdict score``): embedding AUROC, LLM detection / fuzzing, against random
    and hard negatives; the scores are written into the concept dictionary in place. Settings are ScoreConfig's."""
    from conceptdict.naming.score_run import prepare_context, score_concepts

    cfg = config_from_dict(ScoreConfig, settings, "score")
    cd = load_concepts(concepts)
    ctx = prepare_context(cd, cfg, workdir=concepts)
    scored = score_concepts(cd, cfg, ctx)
    save_concepts(scored, concepts)
    write_resolved_config(cfg, concepts, "score_config.json")
    write_report(scored, Path(concepts) / "report")
    if "llm_calls" in ctx.options:
        scored.meta["scoring"]["llm_usage_line"] = ctx.options["llm_calls"].usage.line(cfg.llm)
    return scored


@guarded("cbm")
def cbm(concepts: str | Path, **settings: Any) -> CbmResult:
    """A sparse concept bottleneck model on a concept dictionary, beside a linear probe on the raw activations
    (``conceptdict cbm``). ``label_column`` names the store's label column (default: the store's only one);
    ``dataset`` is "store" (the dictionary's own store) or another store at the same hookpoint. Settings are
    :class:`CbmConfig`'s; with ``out=`` writes cbm.json, cbm.safetensors and report/cbm.html there."""
    from conceptdict.naming.images import cbm_rows
    from conceptdict.naming.pipeline import resolve_hookpoint
    from conceptdict.saes import open_dictionary

    cfg = config_from_dict(CbmConfig, settings, "cbm")
    cd = load_concepts(concepts)
    sae = cfg.sae or cd.meta.get("sae_dir")
    if not sae:
        raise ConfigError("the concept dictionary records no sae_dir; pass --sae SAE_DIR")
    store = cbm_rows(ActivationStore(labelled_store(cd, cfg.dataset)))  # patch stores: patch tokens, no CLS rows
    cfg = dataclasses.replace(cfg, label_column=label_column_of(store, cfg.label_column))
    hookpoint = resolve_hookpoint(store, cd.meta.get("hookpoint"))
    model, config = open_dictionary(sae, device=cfg.device)
    check_sae_fits(model, config, sae, cd, store, hookpoint)
    feats = store_features(model, store, hookpoint, cfg.label_column, cfg.pooling,
                           cfg.super_quantile, device=cfg.device, codes=cfg.codes)
    result = train_cbm(feats.concepts, feats.labels, cd.names, cfg, raw=feats.raw,
                       directions=concept_directions(model, feats.raw.shape[1]))
    result.metrics["dictionary"] = dictionary_fit(sae, model, store, hookpoint)
    result = dataclasses.replace(result, meta={"dict_dir": str(concepts), "store": str(store.path),
                                               "hookpoint": hookpoint, "label_column": cfg.label_column,
                                               "pooling": cfg.pooling if store.level == "token" else "none"})
    if cfg.out is not None:
        save_cbm(result, cfg.out)
        write_resolved_config(cfg, cfg.out, "cbm_config.json")
        write_report(cd, cfg.out / "report", cbm=result)
    return result


def check_sae_fits(model, config: dict, sae: str | Path, cd: ConceptDictionary, store, hookpoint: str) -> None:
    """The dictionary a CBM encodes with must be the concept dictionary's: its latents, the store's hookpoint
    and width (--sae of another hookpoint used to fail deep inside with a ZeroDivisionError)."""
    # our own format records the hookpoints by the store's names; foreign ones by their library's
    recorded = [str(h) for h in config.get("hookpoints") or []] if config.get("format") == ARTIFACT_FORMAT else []
    fix = f"pass the dictionary the concepts were named from ({cd.meta.get('sae_dir', 'see concepts.json')})"
    if model.d_in != store.d_in(hookpoint):
        raise ConfigError(f"--sae {sae} reads {model.d_in}-wide inputs, but store {store.path} holds {hookpoint} at "
                          f"width {store.d_in(hookpoint)}; {fix}")
    if recorded and hookpoint not in recorded:
        raise ConfigError(f"--sae {sae} was trained on {', '.join(recorded)}, not on {hookpoint} (the concept "
                          f"dictionary's hookpoint); {fix}")
    if model.n_latents != len(cd):
        raise ConfigError(f"--sae {sae} has {model.n_latents} latents, the concept dictionary names {len(cd)}; {fix}")


def dictionary_fit(sae_dir: str | Path, model, store, hookpoint: str, rows: int = 65536) -> dict[str, Any]:
    """The dictionary's held-out FVU and L0 on a labelled store (what a CBM's gap to its probe is explained by):
    on the batches its training held out when it was trained on this store, else on the store's first ``rows``
    rows (held out when it was trained on other stores); beside the held-out FVU its training recorded."""
    from conceptdict.saes import evaluate

    batches = heldout_batches(training_heldout(sae_dir, [hookpoint]), store, [hookpoint], rows)
    where = "training's held-out batches"
    if batches is None:
        from conceptdict.saes import load_dictionary_config

        stores = [] if str(sae_dir).startswith("hf:") else load_dictionary_config(sae_dir).get("stores") or []
        trained_on = [str(Path(s).resolve()) for s in stores]
        where = "its training store's first rows" if str(store.path.resolve()) in trained_on else "not trained on"
        batches = first_batches(store, [hookpoint], rows, 4096)
    res = evaluate(model, batches)
    summary = getattr(model, "training_summary", None) or {}
    own = (summary.get("heldout_eval") or {}).get("fvu")
    return {"fvu": res.fvu, "l0": res.l0, "k": res.k, "n_latents": res.n_latents, "rows": res.n_tokens,
            "rows_from": where, "training_fvu": own, "fit_gap": summary.get("fit_gap")}


def labelled_store(cd: ConceptDictionary, dataset: str) -> Path:
    """The store holding a CBM's labelled inputs: the concept dictionary's own ("store") or another store."""
    if dataset == "store":
        store = cd.meta.get("store")
        if not store:
            raise ConfigError("the concept dictionary records no store; pass --dataset STORE_DIR")
        return Path(store)
    path = Path(dataset)
    if not (path / "manifest.json").exists():
        raise ConfigError(f"--dataset {dataset!r} is neither 'store' nor an activation store directory; "
                          "cache the labelled dataset first with `conceptdict cache ... --out DIR`")
    return path


def label_column_of(store, wanted: str | None) -> str:
    """``wanted``, checked against the store's label columns; None: the store's only label column."""
    keys = list(store.manifest.get("label_keys") or [])
    if wanted is None:
        if len(keys) == 1:
            return keys[0]
        raise ConfigError(f"pass --label-column: store {store.path} holds label columns {keys or 'none'}"
                          + ("" if keys else "; cache a labelled dataset with `conceptdict cache --label-column`"))
    if wanted not in keys:
        raise ConfigError(f"--label-column {wanted!r} is not a label column of store {store.path} (it holds "
                          f"{keys or 'none'}); pass one of those")
    return wanted


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
def cbsae(dictionary: str | Path, label_column: str | None = None, **settings: Any) -> CbSaeResult:
    """CB-SAE (``conceptdict cbsae``): prune the latents a scored concept dictionary rates low on interpretability or
    steerability and add bottleneck latents for the user's concepts it lacks. ``dictionary``: the scored concept
    dictionary's directory. Settings are CbSaeConfig's (``concepts`` = a text file of concepts, ``out`` required);
    ``label_column``: a store label column for CBM accuracy before and after."""
    from conceptdict.naming.bottleneck.cbsae import config_dict, save_cbsae
    from conceptdict.naming.bottleneck.cbsae_run import build_cbsae, read_concept_list

    cfg = config_from_dict(CbSaeConfig, settings, "cbsae")
    if cfg.out is None or cfg.concepts is None:
        raise ConfigError("conceptdict cbsae needs --concepts FILE and --out DIR")
    cd = load_concepts(dictionary)
    if not cd.meta.get("sae_dir"):
        raise ConfigError(f"{dictionary} records no sae_dir; name the dictionary with `conceptdict name` first")
    src = open_sources(cd.meta["sae_dir"], cd.meta.get("store"), cd.meta.get("hookpoint"), cfg.device)
    held = heldout_row_ids(training_heldout(cd.meta["sae_dir"], [src.hookpoint]), src.store)
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
def export(source: str | Path, **settings: Any) -> Path:
    """Write a concept dictionary (json, html report, Neuronpedia) or a dictionary (SAELens, sparsify,
    dictionary_learning, circuit-tracer layouts, with a model card) for other tools (``conceptdict export``; the
    formats: ``conceptdict.export_formats``); returns the main file or directory written. Exports name the model by
    its hub id, never a local path. ``push="hf:OWNER/REPO"`` then uploads the ``out`` directory to that repo."""
    cfg = config_from_dict(ExportConfig, settings, "export")
    if cfg.out is None:
        raise ConfigError("conceptdict export needs --out DIR")
    if cfg.push is not None:
        from conceptdict.saes.formats import hub

        hub.push_token(cfg.push)  # a bad name, offline mode or no login fails before anything is written
    written = write_export(Path(source), cfg)
    if cfg.push is not None:
        from conceptdict.activations.lock import LOCK_NAME
        from conceptdict.outdir import MARKER

        url = hub.push(cfg.out, cfg.push, message=f"conceptdict export --format {cfg.format}",
                       ignore=[MARKER, LOCK_NAME])
        log.info("uploaded %s to %s", cfg.out, url)
    return written
