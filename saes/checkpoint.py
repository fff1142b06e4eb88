"""Training checkpoints: the mutable state of a run besides the model and optimizer, and its atomic file."""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import latents
from .adam import Adam
from .config import Resolved, TrainConfig
from .files import read_checkpoint, write_atomic
from .flat import flat_train_fields, to_flat
from .model import SparseCoder
from .stopping import StopState

log = logging.getLogger(__name__)

SKIP = ("checkpoint_every", "log_every", "log", "device", "kernel_impl", "latent_shards", "single_file_gib",
        "eval_every", "metrics", "eval_contexts")
"""Settings a resumed run may change (logging, evaluation and IO cadence, where it runs, over how many latent shards,
how the artifact is split into files)."""


STOP_KEYS = ("stop_patience", "stop_threshold", "stop_every")
"""The stopping rule's settings (saes.stopping); a checkpoint written before the rule existed records none."""


def config_key(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records: every flat setting (``saes.to_flat(every_kind=True)``, as written before
    kinds owned their settings) except :data:`SKIP`."""
    return {k: v for k, v in to_flat(cfg, every_kind=True).items() if k not in SKIP}


def shard_file(name: str, shard: int, shards: int) -> str:
    """The checkpoint file of latent shard ``shard`` of ``shards``: ``name`` itself unsharded, else
    ``checkpoint.shard-1-of-4.pt``."""
    if shards == 1:
        return name
    stem, _, ext = name.rpartition(".")
    return f"{stem}.shard-{shard}-of-{shards}.{ext}"


def save_sharded(out: Path, name: str, state: dict[str, Any], shards: Any) -> None:
    """Write this latent shard's ``state`` (``shards``: the seam's latent-shard group, saes.comm) as its file in
    ``out``; once every shard's is written, remove the files of another shard count (a run resumed on another)."""
    save_checkpoint(out / shard_file(name, shards.rank, shards.size), state)
    shards.barrier()
    if shards.rank == 0:
        stem = name.rpartition(".")[0]
        mine = {shard_file(name, i, shards.size) for i in range(shards.size)}
        for old in [out / name, *out.glob(f"{stem}.shard-*-of-*.*")]:
            if old.name not in mine and old.exists():
                old.unlink()


def load_sharded(out: Path, name: str, shard: int, shards: int) -> dict[str, Any]:
    """The checkpoint in ``out`` as latent shard ``shard`` of ``shards`` resumes it, whatever shard count wrote it:
    this shard's latents sliced out of the files (memory-mapped: only those slices are read) and joined; the
    complete set with the latest step when more than one is there."""
    stem = name.rpartition(".")[0]
    sets = {1: [out / name]} if (out / name).exists() else {}
    for path in out.glob(f"{stem}.shard-*-of-*.pt"):
        n = int(path.name.split("-of-")[1].split(".")[0])
        paths = [out / shard_file(name, i, n) for i in range(n)]
        if all(p.exists() for p in paths):
            sets[n] = paths
    if not sets:
        return load_checkpoint(out / name)  # names what is missing
    mapped = shards > 1 or max(sets) > 1
    parts = max(([read_checkpoint(p, mmap=mapped) for p in paths] for paths in sets.values()),
                key=lambda ps: ps[0]["step"])
    if len(parts) == 1 and shards == 1:
        return parts[0]
    return take_shard(parts, shard, shards)


def _axes(ck: dict[str, Any]) -> tuple[dict[str, tuple[int | None, int]], dict[int, tuple[int | None, int]]]:
    """(axis, groups) of each model and optimizer entry (saes.latents)."""
    axes = ck.get("latent_axes") or {"model": {}, "optimizer": {}}  # written before latent shards: never split
    groups = ck.get("latent_groups") or {"model": {}, "optimizer": {}}  # written before sharded CLTs: one group
    return ({k: (a, groups["model"].get(k, 1)) for k, a in axes["model"].items()},
            {i: (a, groups["optimizer"].get(i, 1)) for i, a in axes["optimizer"].items()})


def take_shard(parts: list[dict[str, Any]], shard: int, shards: int) -> dict[str, Any]:
    """Latent shard ``shard`` of ``shards`` out of a checkpoint written as ``len(parts)`` latent shards (in order):
    every per-latent tensor's slice of this shard's latents (copied out of the parts it spans; a CLT's slice of
    each layer, saes.latents), everything else part 0's."""
    model_axes, opt_axes = _axes(parts[0])
    layers = model_axes.get("b_enc", (0, 1))[1]  # since_fired runs over the latents as b_enc does

    def cut(tensors: list[Tensor], axis_groups: tuple[int | None, int] | None) -> Tensor:
        axis, groups = axis_groups or (None, 1)
        if axis is None or tensors[0].dim() == 0:
            return tensors[0].clone()
        return latents.cut(tensors, axis, groups, shard, shards)  # a copy, off the mapped files

    ck = {k: v.clone() if isinstance(v, Tensor) else v for k, v in parts[0].items()}
    ck["model"] = {k: cut([p["model"][k] for p in parts], model_axes.get(k)) for k in parts[0]["model"]}
    ck["optimizer"] = dict(parts[0]["optimizer"])
    ck["optimizer"]["state"] = {i: {k: cut([p["optimizer"]["state"][i][k] for p in parts], opt_axes.get(i))
                                    for k in st} for i, st in parts[0]["optimizer"]["state"].items()}
    ck["since_fired"] = cut([p["since_fired"] for p in parts], (0, layers))
    if parts[0].get("stop_weights") is not None:  # the stopping rule's copy of the model at its low
        ck["stop_weights"] = {k: cut([p["stop_weights"][k] for p in parts], model_axes.get(k))
                              for k in parts[0]["stop_weights"]}
    return ck


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic write (temporary name, fsync, rename) of a training state of tensors and plain values."""
    write_atomic(path, lambda fh: torch.save(state, fh))  # no .tmp survives a full disk


def load_checkpoint(path: Path) -> dict[str, Any]:
    return read_checkpoint(path)  # a truncated checkpoint.pt is named, not a traceback


@dataclass
class TrainState:
    """Mutable training state besides the model and optimizer (all of it goes into checkpoints)."""

    step: int = 0
    position: int = 0  # batches read from the start of the data, held-out ones included
    rows: int = 0  # training rows seen
    threshold_updates: int = 0
    scale: Tensor | None = None  # [S] normalisation factor
    since_fired: Tensor | None = None  # [L] int64 rows since each latent last fired
    stop: StopState = field(default_factory=StopState)  # the stopping rule's state (saes.stopping)


def checkpoint_state(model: SparseCoder, opt: Adam, st: TrainState, cfg: TrainConfig,
                      gen: torch.Generator, resolved: Resolved) -> dict:
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "step": st.step, "position": st.position, "rows": st.rows, "threshold_updates": st.threshold_updates,
        "scale": st.scale, "since_fired": st.since_fired, "rng": gen.get_state(), "stop": st.stop.to_dict(),
        "stop_weights": st.stop.weights,
        "config": config_key(cfg), "shape": [model.n_sources, model.d_in], "resolved": resolved.to_dict(),
        "latent_axes": latent_axes(model), "latent_groups": latent_groups_of(model),
    }


def latent_axes(model: SparseCoder) -> dict[str, dict]:
    """Along which axis each model and optimizer entry runs over the latents (None: every shard holds it whole),
    so that a checkpoint's latent shards join and split (``load_sharded``); the optimizer's entries are numbered as
    its parameters (``update.make_optimizer``: storage order, latents first)."""
    names = [name for name, _ in model.named_parameters()]
    return {"model": {k: model.latent_axis(k) for k in model.state_dict()},
            "optimizer": {i: None if model.latent_axis(n) is None else 0 for i, n in enumerate(names)}}


def latent_groups_of(model: SparseCoder) -> dict[str, dict]:
    """The groups along each entry's latent axis (saes.latents: a CLT's layers), named as :func:`latent_axes`."""
    names = [name for name, _ in model.named_parameters()]
    return {"model": {k: latents.latent_groups(model, k) for k in model.state_dict()},
            "optimizer": {i: latents.latent_groups(model, n) for i, n in enumerate(names)}}


FORMER_DEFAULTS = {"precision": "float32"}
"""Settings whose default changed after checkpoints were written without them: the value such a checkpoint's run
used (precision's default became auto, which a run resolves and records; before, float32)."""


def _resumed_settings(saved: dict[str, Any], cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint, now): the settings ``cfg``'s kind reads, from a checkpoint's record (a setting added after it was
    written at its default; other kinds' settings, which older runs recorded too, left out) and from ``cfg``; the
    stopping rule's settings left out of both when the checkpoint predates the rule (:func:`resumed_config`)."""
    defaults = {f.name: f.default for f in flat_train_fields() if f.default is not MISSING} | FORMER_DEFAULTS
    skip = SKIP + (STOP_KEYS if not any(k in saved for k in STOP_KEYS) else ())
    now = {k: v for k, v in to_flat(cfg).items() if k not in skip}
    merged = {**defaults, **saved}
    return {k: merged.get(k) for k in now}, now


def resumed_config(ck: dict, cfg: TrainConfig) -> TrainConfig:
    """``cfg`` for resuming ``ck``: a checkpoint written before the stopping rule existed (none of
    :data:`STOP_KEYS` recorded) was started without it and resumes with the rule off, to its recorded length."""
    if any(k in ck["config"] for k in STOP_KEYS) or not cfg.stop_patience:
        return cfg
    log.info("the checkpoint at step %d was written before the stopping rule existed: resuming it with the rule off "
             "(stop_patience=0), to its length tokens=%s", ck["step"], cfg.tokens)
    return replace(cfg, stop_patience=0)


def restore(ck: dict, model: SparseCoder, opt: Adam, cfg: TrainConfig, source: str) -> TrainState:
    saved, now = _resumed_settings(ck["config"], cfg)
    if saved != now:
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        raise ValueError(f"--resume with settings that differ from the checkpoint (checkpoint, now): {diff}; "
                         f"use the original settings or start a new run without --resume")
    if list(ck["shape"]) != [model.n_sources, model.d_in]:
        raise ValueError(f"checkpoint has (sources, d_in)={tuple(ck['shape'])} but {source} has "
                         f"{(model.n_sources, model.d_in)}; resume on the same store and hookpoint(s)")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    return TrainState(ck["step"], ck["position"], ck["rows"], ck["threshold_updates"], ck["scale"], ck["since_fired"],
                      StopState(**ck.get("stop", {}), weights=ck.get("stop_weights")))

