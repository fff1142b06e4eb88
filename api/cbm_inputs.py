"""What a concept bottleneck model reads: its dictionaries, their labelled stores and each input's concept
activations (``conceptdict cbm``, ``cd.cbm_features``).

- :func:`cbm_inputs`: for ``cd.cbm``, the dictionary (and with ``--also`` the further dictionaries) checked against
  their stores, and every labelled input's concept activations, one dictionary's beside the next's.
- :func:`cbm_features`: the same inputs of a CBM already made, read back from what it records, for explaining or
  changing its predictions in a notebook (``cbm.contributions``, ``naming.explain_input``, ``naming.intervene``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch
from conceptdict.activations import ActivationStore
from conceptdict.naming import (CbmConfig, CbmResult, ConceptDictionary, concept_directions, load_concepts,
                                store_features)
from conceptdict.naming.bottleneck.cbm import load_cbm
from conceptdict.naming.bottleneck.features import CbmFeatures
from conceptdict.naming.bottleneck.joined import ConceptPart, align_inputs, check_same_texts, route_names
from conceptdict.objects import CbmLike
from conceptdict.saes.artifact import FORMAT as ARTIFACT_FORMAT
from conceptdict.settings import ConfigError, home_of

__all__ = ["CbmInputs", "cbm_features", "cbm_inputs", "check_sae_fits", "label_column_of", "labelled_store"]


class CbmInputs(NamedTuple):
    sources: list[tuple]
    """Per dictionary: (the dictionary, its config, its labelled store, the hookpoint, the dictionary's path)."""
    features: CbmFeatures
    """Every labelled input (the first store's order): concepts [N, L] of every dictionary side by side, the first
    store's raw activations, labels and context index."""
    parts: list[ConceptPart] | None
    """Per dictionary its part of the columns (None for one dictionary)."""
    names: list[str]
    """The columns' concept names (prefixed by hookpoint where there are several dictionaries)."""
    cfg: CbmConfig
    """The settings with the label column resolved."""


def cbm_inputs(cd: ConceptDictionary, cfg: CbmConfig) -> CbmInputs:
    """The dictionary of concept dictionary ``cd`` (``cfg.sae`` or the one it was named from) on its labelled store
    (``cfg.dataset``), and those of ``cfg.also`` on their own stores, matched to the first's inputs by context index
    (stores of other texts refused, ``naming.bottleneck.joined``); each input's concept activations, pooled per input
    as ``cfg`` says."""
    dicts = [cd] + [load_concepts(o) for o in cfg.also]
    sources = [cbm_source(cd, cfg.sae, cfg.dataset, cfg)] + [cbm_source(o, None, "store", cfg) for o in dicts[1:]]
    store = sources[0][2]
    cfg = dataclasses.replace(cfg, label_column=label_column_of(store, cfg.label_column))
    got = [store_features(m, st, h, cfg.label_column, cfg.pooling, cfg.super_quantile, device=cfg.device,
                          codes=cfg.codes) for m, _, st, h, _ in sources]  # fmt: skip
    if len(got) == 1:
        return CbmInputs(sources, got[0], None, list(cd.names), cfg)
    for s in sources[1:]:
        check_same_texts(store, s[2])
    got = got[:1] + [align_inputs(got[0], f, str(store.path), str(s[2].path)) for f, s in zip(got[1:], sources[1:])]
    routes = route_names([s[3] for s in sources])
    parts = [ConceptPart(r, f.concepts.shape[1], f.raw if j else None, concept_directions(s[0], f.raw.shape[1]))
             for j, (r, f, s) in enumerate(zip(routes, got, sources))]  # the first part: the CBM's own raw probe
    names = [f"{r}: {n}" for r, d in zip(routes, dicts) for n in d.names]
    features = got[0]._replace(concepts=torch.cat([f.concepts for f in got], 1))
    return CbmInputs(sources, features, parts, names, cfg)


def cbm_features(cbm: CbmLike, device: str = "cpu") -> CbmFeatures:
    """The inputs CBM ``cbm`` (a folder or the object ``cd.cbm`` returned) reads, recomputed from the dictionaries,
    store and settings it records: ``concepts`` [N, L] in its column order (with ``--also``, the dictionaries' side
    by side), ``raw`` [N, D] (its probe's), ``labels`` and each input's context index (``inputs``), one row per
    labelled input of its store, rare classes included. ``cbm.logits(f.concepts)`` predicts them,
    ``naming.explain_input(cbm, f.concepts[i])`` explains one. A CBM with concepts ``--add-pairs`` added reads
    more: ``cbm.concepts_of(dictionary, raw)`` gives those."""
    cbm = cbm if isinstance(cbm, CbmResult) else load_cbm(home_of(cbm, "cbm"))
    meta: dict[str, Any] = cbm.meta
    if "dict_dir" not in meta or "store" not in meta:
        raise ConfigError("this CBM records no concept dictionary or store (it was not made by `conceptdict cbm`); "
                          "compute its inputs with naming.store_features")  # fmt: skip
    pooling = meta.get("pooling")  # "none": every store sequence-level (no pooling), else the one it pooled with
    cfg = CbmConfig(label_column=meta.get("label_column"), dataset=meta["store"], sae=meta.get("sae"),
                    also=[Path(p) for p in meta.get("also") or []],
                    pooling=pooling if pooling in ("mean", "max", "super") else "super",
                    codes=meta.get("codes", "relu"), super_quantile=meta.get("super_quantile", 0.1),
                    device=device)  # fmt: skip
    got = cbm_inputs(load_concepts(meta["dict_dir"]), cfg)
    width = len(got.names) + len((cbm.metrics.get("added_concepts") or {}).get("names", ()))
    if width != cbm.weight.shape[1]:
        raise ConfigError(f"the dictionaries {cbm.meta['dict_dir']} (+ {meta.get('also') or 'none'}) now hold "
                          f"{len(got.names)} concepts, but this CBM reads {cbm.weight.shape[1]}; they changed since "
                          "it was made: run `conceptdict cbm` again")  # fmt: skip
    return got.features


def cbm_source(cd: ConceptDictionary, sae, dataset: str, cfg: CbmConfig) -> tuple:
    """(the dictionary a CBM encodes with, its config, the labelled store, the hookpoint, the dictionary's path):
    ``sae`` or the one the concept dictionary was named from, checked to fit the store (:func:`check_sae_fits`)."""
    from conceptdict.naming.images import cbm_rows
    from conceptdict.naming.pipeline import resolve_hookpoint
    from conceptdict.saes import open_dictionary

    sae = sae or cd.meta.get("sae_dir")
    if not sae:
        raise ConfigError(f"the concept dictionary {cd.path or '(in memory)'} records no sae_dir; pass --sae SAE_DIR")
    store = cbm_rows(ActivationStore(labelled_store(cd, dataset)))  # patch stores: patch tokens, no CLS rows
    hookpoint = resolve_hookpoint(store, cd.meta.get("hookpoint"))
    model, config = open_dictionary(sae, device=cfg.device)
    check_sae_fits(model, config, sae, cd, store, hookpoint)
    return model, config, store, hookpoint, sae


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
