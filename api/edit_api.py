"""Act on concepts: steer a model through latents, erase or switch a labelled concept, splice a dictionary in."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from conceptdict.activations import ActivationStore, ModelHandle, load_model
from conceptdict.activations.intervene import dictionary_edits, dictionary_hookpoint, spliced
from conceptdict.activations.tokens import causal_lm_source
from conceptdict.naming import dictionary_of, load_cbm
from conceptdict.naming.interventions.erase import (
    EraseConfig,
    apply_eraser,
    ce_change_function,
    dictionary_at,
    erase_table,
    load_labelled,
    write_erase,
)
from conceptdict.naming.pipeline import resolve_hookpoint
from conceptdict.naming.interventions.steer import (
    SteerConfig,
    dictionary_edit,
    resolve_latents,
    steer_document,
    steer_model_name,
    write_steer,
)
from conceptdict.saes import SparseCoder, load_dictionary, load_dictionary_config
from conceptdict.settings import ConfigError, config_from_dict, write_resolved_config
from conceptdict.outdir import guarded


@guarded("steer")
def steer(dictionary: str | Path, **settings: Any) -> dict[str, Any]:
    """Steer a model through latents of a dictionary (or of a concept dictionary, by name) (``conceptdict steer``):
    add, clamp or ablate at the dictionary's hookpoint, error term kept; continuations and log-prob shifts for a
    causal LM, cosine shifts against texts for a sentence encoder. Settings are :class:`SteerConfig`'s; with
    ``out=`` writes steer.json and steer.html. Returns the steer.json document."""
    cfg = config_from_dict(SteerConfig, settings, "steer")
    ref = dictionary_of(dictionary)
    config = load_dictionary_config(ref.path)
    hookpoint = (config.get("hookpoints") or [config.get("hookpoint")])[0]
    if not hookpoint:
        raise ConfigError(f"dictionary {ref.path} records no hookpoint; steering needs one")
    sae = load_dictionary(ref.path, device=cfg.device)
    latents = resolve_latents(cfg.latents, ref.names, sae.n_latents)
    model = load_model(steer_model_name(cfg.model, config), device=cfg.device)
    doc = steer_document(model, hookpoint, sae, latents, ref.names, cfg, load_cbm(cfg.cbm) if cfg.cbm else None,
                         source=str(ref.path))
    if cfg.out is not None:
        write_steer(doc, cfg.out)
        write_resolved_config(cfg, cfg.out, "steer_config.json")
    return doc


class EraseResult(NamedTuple):
    """The erasure table (erase.json's content) and the files written."""

    table: dict[str, Any]
    paths: dict[str, Path]

    def format(self) -> str:
        from conceptdict.naming.interventions.erase import format_table

        return format_table(self.table)

    def to_dict(self) -> dict[str, Any]:
        """erase.json's content as plain JSON types, with the paths written."""
        from conceptdict.saes.tables import plain

        return plain({**self.table, "paths": self.paths})

    def to_pandas(self) -> Any:
        """A DataFrame with one row per method: method, its probe accuracies, displacement, switch rate, CE change
        (None where not measured), ``skipped`` (why a method did not run), latents (SAE ablation's)."""
        from conceptdict.naming.interventions.erase import COLUMNS
        from conceptdict.saes.tables import frame

        return frame(self.table["records"], ["method", *COLUMNS])


@guarded("erase")
def erase(store: str | Path, apply: str | Path | None = None, **settings: Any) -> EraseResult | ActivationStore:
    """Erase or switch a labelled concept (``conceptdict erase``): SAE ablation, LEACE, SPLINCE, LEACE-Switch and
    MidSteer fitted on one split and measured on another, one table (erase.json, erase.html, erasers/ in ``out``).
    Settings are :class:`EraseConfig`'s. With ``apply=ERASER_DIR`` (an eraser an earlier run wrote): a new store at
    ``out``, ``store`` with that eraser applied; returns it."""
    cfg = config_from_dict(EraseConfig, settings, "erase")
    if cfg.out is None:
        raise ConfigError("conceptdict erase needs --out DIR")
    opened = ActivationStore(store)
    hookpoint = resolve_hookpoint(opened, cfg.hookpoint)
    if apply is not None:
        return ActivationStore(apply_eraser(Path(apply), opened, hookpoint, cfg.out))
    sae, names = dictionary_at(cfg.dictionary, hookpoint, cfg.device) if cfg.dictionary else (None, None)
    data = load_labelled(opened, hookpoint, cfg)
    ce = None
    lm = cfg.model or causal_lm_source(opened)
    if lm and cfg.contexts and opened.level == "token":
        ce = ce_change_function(load_model(lm, device=cfg.device), opened, hookpoint, cfg.contexts)
    doc, erasers = erase_table(data, cfg, sae, names, ce)
    meta = {"store": str(opened.path), "hookpoint": hookpoint, "concept_column": cfg.concept_column,
            "target_column": cfg.target_column, "dictionary": str(cfg.dictionary) if cfg.dictionary else None}
    path = write_erase(doc, erasers, cfg.out, meta)
    write_resolved_config(cfg, cfg.out, "erase_config.json")
    return EraseResult(doc, {"table": path, "report": cfg.out / "erase.html", "erasers": cfg.out / "erasers"})


def splice(model: ModelHandle, dictionary: SparseCoder | str | Path, hookpoint: str | None = None, edit=None):
    """A context manager under which ``model``'s forward runs with ``dictionary`` spliced in at its hookpoint (the
    context-manager form of ``model.run_with_saes``, the same splice): ``edit=None`` replaces the activations by
    their reconstruction; ``{latent: value}`` clamps latents (0 ablates) and ``{latent: ("add", a)}`` adds a * d_j,
    keeping the error term; a callable maps the codes [n, L] to new codes, error term kept.

        with cd.splice(model, sae, edit={12: 0.0}):
            logits = model("The cat sat on the mat")
    """
    if isinstance(model, (str, Path)):
        raise TypeError(f"splice(model={model!r}): pass a loaded model, e.g. model = cd.load_model({str(model)!r}), "
                        "then splice(model, ...)")
    if not isinstance(dictionary, SparseCoder):
        config = load_dictionary_config(dictionary_of(dictionary).path)
        hookpoint = hookpoint or (config.get("hookpoints") or [config.get("hookpoint")])[0]
        dictionary = load_dictionary(dictionary_of(dictionary).path, device=model.device)
    hookpoint = hookpoint or dictionary_hookpoint(dictionary)
    if hookpoint is None:
        raise ValueError("the dictionary records no hookpoint; pass hookpoint=")
    edits = None if edit is None else {hookpoint: dictionary_edit(dictionary, edit)}
    return spliced(model, dictionary_edits({hookpoint: dictionary}, edits))
