"""Training checkpoints: the mutable state of a run besides the model and optimizer, and its atomic file."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import Resolved, TrainConfig
from .files import read_checkpoint, write_atomic
from .model import SparseCoder

def config_key(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the checkpoint (everything except logging/IO cadence)."""
    skip = {"checkpoint_every", "log_every", "device", "kernel_impl"}
    return {k: v for k, v in asdict(cfg).items() if k not in skip}


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


def checkpoint_state(model: SparseCoder, opt: torch.optim.Optimizer, st: TrainState, cfg: TrainConfig,
                      gen: torch.Generator, resolved: Resolved) -> dict:
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "step": st.step, "position": st.position, "rows": st.rows, "threshold_updates": st.threshold_updates,
        "scale": st.scale, "since_fired": st.since_fired, "rng": gen.get_state(),
        "config": config_key(cfg), "shape": [model.n_sources, model.d_in], "resolved": resolved.to_dict(),
    }


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's settings with the fields added to TrainConfig after it was written at their defaults."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    return {**{k: v for k, v in defaults.items() if k in config_key(TrainConfig(latents=2, k=1))}, **saved}


def restore(ck: dict, model: SparseCoder, opt: torch.optim.Optimizer, cfg: TrainConfig, source: str) -> TrainState:
    saved = _with_defaults(ck["config"])
    if saved != config_key(cfg):
        diff = {k: (saved.get(k), v) for k, v in config_key(cfg).items() if saved.get(k) != v}
        raise ValueError(f"--resume with settings that differ from the checkpoint (checkpoint, now): {diff}; "
                         f"use the original settings or start a new run without --resume")
    if list(ck["shape"]) != [model.n_sources, model.d_in]:
        raise ValueError(f"checkpoint has (sources, d_in)={tuple(ck['shape'])} but {source} has "
                         f"{(model.n_sources, model.d_in)}; resume on the same store and hookpoint(s)")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    return TrainState(ck["step"], ck["position"], ck["rows"], ck["threshold_updates"], ck["scale"], ck["since_fired"])

