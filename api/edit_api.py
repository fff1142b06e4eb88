"""Act on concepts: steer a model through latents, erase or switch a labelled concept, splice a dictionary in."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Sequence

from conceptdict.activations import ActivationStore, ModelHandle, load_model
from conceptdict.activations.intervene import dictionary_edits, dictionary_hookpoint, spliced
from conceptdict.activations.tokens import causal_lm_source
from conceptdict.naming import CbmResult, ConceptDictionary, dictionary_of, load_cbm  # noqa: F401 (hints)
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
from conceptdict.objects import CbmLike, ConceptsLike, DictionaryLike, StoreLike
from conceptdict.settings import ConfigError, config_from_dict, given, home_of, takes_settings, write_resolved_config
from conceptdict.outdir import guarded


@guarded("steer")
@takes_settings(SteerConfig, extra=("overwrite",))
def steer(dictionary: DictionaryLike | ConceptsLike, *, latent: str | int | Sequence[str | int] | None = None,
          mode: str = "add", alpha: float = 1.0, prompt: str | Sequence[str] | None = None,
          token: str | Sequence[str] | None = None, text: str | Sequence[str] | None = None,
          cbm: CbmLike | None = None, max_new_tokens: int = 20, temperature: float = 1.0,
          random_directions: int = 8, seed: int = 0, model: str | None = None, out: str | Path | None = None,
          device: str = "cpu", overwrite: bool = False) -> dict[str, Any]:
    """Steer a model through latents of a dictionary (a folder or SparseCoder; a concept dictionary's latents by
    name) (``conceptdict steer``): add, clamp or ablate at the dictionary's hookpoint, error term kept;
    continuations and log-prob shifts for a causal LM, cosine shifts against texts for a sentence encoder. With
    ``out`` writes steer.json and steer.html. Returns the steer.json document."""
    cfg = config_from_dict(SteerConfig, given(locals(), "dictionary", "overwrite"), "steer")
    if isinstance(dictionary, SparseCoder):  # in memory, or loaded: its recorded config names the hookpoint
        sae, config, names = dictionary.to(cfg.device), dictionary.config or {}, None
        where = str(dictionary.path) if dictionary.path is not None else "this dictionary (made in memory)"
    else:
        ref = dictionary_of(home_of(dictionary, "dictionary"))
        config, names, where = load_dictionary_config(ref.path), ref.names, str(ref.path)
        sae = load_dictionary(ref.path, device=cfg.device)
    hookpoint = (config.get("hookpoints") or [config.get("hookpoint")])[0]
    if not hookpoint:
        raise ConfigError(f"dictionary {where} records no hookpoint; steering needs one")
    latents = resolve_latents(cfg.latents, names, sae.n_latents)
    model = load_model(steer_model_name(cfg.model, config), device=cfg.device)
    doc = steer_document(model, hookpoint, sae, latents, names, cfg, load_cbm(cfg.cbm) if cfg.cbm else None,
                         source=where)
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
@takes_settings(EraseConfig, extra=("apply", "overwrite"))
def erase(store: StoreLike, apply: str | Path | None = None, *, concept_column: str = "",
          target_column: str | None = None, hookpoint: str | None = None, dictionary: DictionaryLike | None = None,
          method: str | Sequence[str] | None = None, ablate_latents: int = 8, ablate_l1: float = 1.0,
          switch_from: str | None = None, switch_to: str | None = None, test_fraction: float = 0.3,
          max_rows: int = 20000, min_class_size: int = 5, model: str | None = None, contexts: int = 16,
          mlp_epochs: int = 300, seed: int = 0, out: str | Path | None = None, device: str = "cpu",
          overwrite: bool = False) -> EraseResult | ActivationStore:
    """Erase or switch a labelled concept (``conceptdict erase``): SAE ablation, LEACE, SPLINCE, LEACE-Switch and
    MidSteer fitted on one split and measured on another, one table (erase.json, erase.html, erasers/ in ``out``).
    With ``apply=ERASER_DIR`` (an eraser an earlier run wrote): a new store at ``out``, ``store`` with that eraser
    applied; returns it."""
    cfg = config_from_dict(EraseConfig, given(locals(), "store", "apply", "overwrite"), "erase")
    if cfg.out is None:
        raise ConfigError("conceptdict erase needs --out DIR")
    opened = store if isinstance(store, ActivationStore) else ActivationStore(store)
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
