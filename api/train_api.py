"""Train dictionaries: on stores, or straight from a model's forward; one dictionary or a sweep on one pass."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypedDict, overload

from typing_extensions import Unpack

from conceptdict import ranks
from conceptdict.activations import ActivationStore  # noqa: F401 (StoreLike's hints name it)
from conceptdict.activations.live import LiveConfig
from conceptdict.saes import FlatField, SparseCoder, TrainConfig, flat_train_fields, train_config
from conceptdict.saes.flat import TrainingSettings
from conceptdict.saes.lazy import LazyDictionary
from conceptdict.saes.sweep_results import Sweep
from conceptdict.settings import (
    ConfigError,
    Setting,
    check_keys,
    coerce_settings,
    config_from_dict,
    home_of,
    takes_settings,
    parse_field_values,
    split_settings,
)
from conceptdict.objects import StoreLike
from conceptdict.train_run import TrainCommand, run_training
from conceptdict.outdir import guarded

log = logging.getLogger(__name__)


@functools.cache
def train_settings() -> tuple[Setting, ...]:
    """The training settings (``saes.flat_train_fields``: the shared ones, then each kind's own) as settings whose
    default is None (the default, which may depend on the kind and the data; ``--help`` shows the fixed ones): the
    flags of ``conceptdict train`` and ``diff`` and the keywords of :func:`train` (:class:`TrainingSettings`)."""
    def entry(f: FlatField) -> Setting:
        owners = f"{', '.join(f.kinds)}: " if f.kinds else ""  # the kinds that read it
        return Setting(f.name, f.type | None if f.default is dataclasses.MISSING else f.type, None, owners + f.help,
                       minimum=f.minimum, kinds=f.kinds, shown_default=f.default)

    return tuple(entry(f) for f in flat_train_fields())


class LiveSettings(TypedDict, total=False):
    """:class:`LiveConfig`'s settings as keywords of :func:`train` (training from a model's forward)."""

    model: str | None
    dataset: str | None
    text_column: str
    tokens_column: str | None
    split: str
    encoding: str
    context_length: int
    packing: bool | None
    prepend_bos: bool
    tokenizer: str | None
    model_dtype: str
    forward_batch_size: int


class TrainKeywords(TrainingSettings, LiveSettings, total=False):
    """Every keyword of :func:`train` but the store, hookpoint, layers and sweep: where it writes, the dictionary's
    settings and, with ``model=``, the model's."""

    out: str | Path | None
    resume: bool
    overwrite: bool
    buffer_rows: int


@overload
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | None = None,
          layers: None = None, sweep: None = None, **settings: Unpack[TrainKeywords]) -> SparseCoder: ...


@overload
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | Sequence[str] | None = None,
          layers: str | Sequence[str] | None = None, sweep: str | Sequence[str] | Mapping[str, Sequence[Any]],
          **settings: Unpack[TrainKeywords]) -> Sweep: ...


@overload
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | Sequence[str] | None = None,
          layers: str | Sequence[str] | None = None, sweep: str | Sequence[str] | Mapping[str, Sequence[Any]] | None
          = None, **settings: Unpack[TrainKeywords]) -> SparseCoder | Sweep: ...


@guarded("train", own_overwrite=True)
@takes_settings(TrainCommand, train_settings(), LiveConfig)
def train(store: StoreLike | Sequence[StoreLike] | None = None, *, hookpoint: str | Sequence[str] | None = None,
          layers: str | Sequence[str] | None = None,
          sweep: str | Sequence[str] | Mapping[str, Sequence[Any]] | None = None,
          **settings: Unpack[TrainKeywords]) -> SparseCoder | Sweep:
    """Train a dictionary (``conceptdict train``) on ``store`` (one or several activation stores: folders or
    opened stores; several over the same tokens train a crosscoder) or straight from ``model=`` over ``dataset=``
    (then ``tokens=`` is required); ``latents=`` and ``k=`` are required.

    ``sweep`` takes ``"k=16,32"``, ``["k=16,32", "kind=topk,batchtopk"]`` or ``{"k": [16, 32]}``: one dictionary per
    combination on one pass over the data. Returns the dictionary (it remembers its folder, ``out``); a run that
    makes several (a sweep, ``layers=``, or several hookpoints with ``model=``) returns a :class:`Sweep`: its
    dictionaries by sub-folder name and a summary table (``.to_pandas()``). Under torchrun every rank trains its
    part of each batch."""
    if sweep is not None and not sweep:
        raise ConfigError("sweep= is empty: give FIELD=V1,V2 (e.g. sweep='k=16,32'), or drop it for one dictionary")
    cmd, cfg, live, grid = train_configs(store=store, hookpoint=hookpoint, layers=layers, sweep=sweep, **settings)
    return _one_or_many(run_training(cmd, cfg, live, grid))


def train_configs(**settings: Any) -> tuple[TrainCommand, TrainConfig, LiveConfig, dict[str, list[Any]]]:
    """(where, what, from which model, sweep grid) of a training run from keyword settings, checked strictly."""
    sweep = settings.pop("sweep", None) or []
    if isinstance(sweep, str):
        sweep = [sweep]
    if settings.get("store") is not None:
        settings["store"] = [home_of(s, "store") for s in
                             (settings["store"] if isinstance(settings["store"], (list, tuple)) else [settings["store"]])]
    command, train_part, live_part = split_settings({k: v for k, v in settings.items() if v is not None}, TrainCommand, train_settings(), LiveConfig, where="train")
    train_part = coerce_settings(train_settings(), train_part, "train")
    grid = sweep_grid(sweep)
    both = [n for n in grid if train_part.get(n) is not None]
    if both:
        n = both[0]
        raise ConfigError(f"{n} is given twice, as {n}={train_part[n]!r} (--{n.replace('_', '-')}) and by the sweep "
                          f"{n}={','.join(map(str, grid[n]))}; give it once (the sweep's values, or the one value)")
    for n in ("latents", "k"):  # a swept field needs no flag: the base takes the sweep's first value
        if train_part.get(n) is None and grid.get(n):
            train_part[n] = grid[n][0]
    missing = [f"--{n}" for n in ("latents", "k") if train_part.get(n) is None]
    if missing:
        raise ConfigError(f"conceptdict train needs {' and '.join(missing)} (e.g. --latents 4096 --k 32; in Python "
                          f"latents= and k=)")
    cmd = config_from_dict(TrainCommand, {**command, "sweep": [str(s) for s in sweep]
                                          if not isinstance(sweep, dict) else []}, "train")
    cfg = train_config(**{k: v for k, v in train_part.items() if v is not None})
    live = config_from_dict(LiveConfig, live_part, "train")
    if live.dataset and not live.model:
        raise ConfigError("--dataset is read through a model: add --model M (or drop --dataset and train on --store)")
    return cmd, cfg, live, grid


def sweep_grid(sweep: list[str] | dict[str, list[Any]]) -> dict[str, list[Any]]:
    """field -> values of a sweep given as ``["FIELD=V1,V2", ...]`` or as a dict."""
    if isinstance(sweep, dict):
        grid = {k.replace("-", "_"): list(v) for k, v in sweep.items()}
        check_keys(grid, train_settings(), "sweep")
        return grid
    grid = dict(parse_field_values(train_settings(), spec, "--sweep") for spec in sweep)
    if len(sweep) != len(grid):
        raise ConfigError(f"--sweep names a field twice ({', '.join(sweep)}); give each field once")
    return grid


def _one_or_many(trained: list[tuple[str, Path, SparseCoder]]) -> SparseCoder | Sweep:
    """The trained dictionaries as :func:`load` returns them (for inference, with their ``.config`` and ``.path``);
    several as a :class:`Sweep` (by name, with a summary table)."""
    from conceptdict.saes import load_dictionary_config

    for _, out, model in trained:
        if ranks.current().main:  # the process that wrote it
            model.config = load_dictionary_config(out)
        model.path = out
        model.requires_grad_(False).eval()
    if len(trained) == 1 and trained[0][0] == "":
        return trained[0][2]
    return Sweep(trained)


@overload
def load(source: str | Path | None = None, device: str = "cpu", *, release: str | None = None,
         sae_id: str | None = None, lazy: Literal[False] = False) -> SparseCoder: ...


@overload
def load(source: str | Path | None = None, device: str = "cpu", *, release: str | None = None,
         sae_id: str | None = None, lazy: Literal[True]) -> LazyDictionary: ...


@overload
def load(source: str | Path | None = None, device: str = "cpu", *, release: str | None = None,
         sae_id: str | None = None, lazy: bool = False) -> SparseCoder | LazyDictionary: ...


def load(source: str | Path | None = None, device: str = "cpu", *, release: str | None = None,
         sae_id: str | None = None, lazy: bool = False) -> SparseCoder | LazyDictionary:
    """A dictionary from a directory in any format conceptdict reads (its own, SAELens, sparsify,
    dictionary_learning, Gemma Scope), a hub id ``hf:REPO[/SUBDIR][@REV]``, or a SAELens release: ``"RELEASE/SAE_ID"``
    or ``release=..., sae_id=...``. ``.config`` holds its config.json, ``.path`` where it was read from.

    ``sae.encode(x)`` -> codes [..., L], ``sae.decode(codes)`` -> [..., D], ``sae(x)`` -> reconstruction; plain
    tensors without autograd history unless gradients are enabled and the input requires them.

    ``lazy=True`` (conceptdict's own layout): a ``LazyDictionary`` that keeps the weights on disk and reads a block of
    latents at a time (``sae.latents(start, stop)``: a SparseCoder of that range; ``encode`` / ``decode`` / ``sae(x)``
    as the whole one's), for a dictionary larger than this process's memory (docs/guide/distributed.md)."""
    from conceptdict.saes import open_dictionary

    if (release is None) != (sae_id is None) or (release is not None) == (source is not None):
        raise ConfigError("cd.load takes a folder or name, or release= with sae_id= (SAELens's names), not both")
    source = f"{release}/{sae_id}" if release is not None else source
    model, config = open_dictionary(source, device=device, lazy=lazy)
    model.config = config
    model.path = source if str(source).startswith("hf:") or not Path(str(source)).exists() else Path(source)
    return model.requires_grad_(False).eval()
