"""Training checkpoints: the mutable state of a run besides the model and optimizer, and its atomic file."""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import Resolved, TrainConfig
from .files import read_checkpoint, write_atomic
from .flat import flat_train_fields, to_flat
from .model import SparseCoder
from .stopping import StopState

log = logging.getLogger(__name__)

SKIP = ("checkpoint_every", "log_every", "log", "device", "kernel_impl")
"""Settings a resumed run may change (logging and IO cadence, where it runs)."""


STOP_KEYS = ("stop_patience", "stop_threshold", "stop_every")
"""The stopping rule's settings (saes.stopping); a checkpoint written before the rule existed records none."""


def config_key(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records: every flat setting (``saes.to_flat(every_kind=True)``, as written before
    kinds owned their settings) except :data:`SKIP`."""
    return {k: v for k, v in to_flat(cfg, every_kind=True).items() if k not in SKIP}


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


def checkpoint_state(model: SparseCoder, opt: torch.optim.Optimizer, st: TrainState, cfg: TrainConfig,
                      gen: torch.Generator, resolved: Resolved) -> dict:
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "step": st.step, "position": st.position, "rows": st.rows, "threshold_updates": st.threshold_updates,
        "scale": st.scale, "since_fired": st.since_fired, "rng": gen.get_state(), "stop": st.stop.to_dict(),
        "config": config_key(cfg), "shape": [model.n_sources, model.d_in], "resolved": resolved.to_dict(),
    }


def _resumed_settings(saved: dict[str, Any], cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint, now): the settings ``cfg``'s kind reads, from a checkpoint's record (a setting added after it was
    written at its default; other kinds' settings, which older runs recorded too, left out) and from ``cfg``; the
    stopping rule's settings left out of both when the checkpoint predates the rule (:func:`resumed_config`)."""
    defaults = {f.name: f.default for f in flat_train_fields() if f.default is not MISSING}
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


def restore(ck: dict, model: SparseCoder, opt: torch.optim.Optimizer, cfg: TrainConfig, source: str) -> TrainState:
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
                      StopState(**ck.get("stop", {})))

