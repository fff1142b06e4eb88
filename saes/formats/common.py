"""What every format reader returns: the model and a config dict shaped like a native ``config.json``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..model import SparseCoder
from .files import FormatError

log = logging.getLogger("conceptdict.saes.formats")
_SHOWN: set[tuple[str, str]] = set()


class Loaded(NamedTuple):
    """A dictionary read from any format."""

    model: SparseCoder
    config: dict[str, Any]
    """Like a native config.json: kind, d_in, n_latents, k, n_sources, and where known ``hookpoints`` (this
    project's name), ``model``; foreign formats add ``source_format``, ``source`` and ``hookpoint_mapping``."""


def build(kind: str, d_in: int, n_latents: int, k: int | None, tensors: dict[str, torch.Tensor]) -> SparseCoder:
    """A SparseCoder of ``kind`` holding ``tensors`` (W_enc [D, L], b_enc, W_dec [L, D], b_dec, threshold, and the
    kind's extra buffers), converted to float32. ``k`` None (rules without a k) records 1."""
    k_ = k if k is not None else 1
    if not 1 <= k_ < n_latents:
        raise FormatError(f"k={k_} is not between 1 and d_sae - 1 = {n_latents - 1}")
    model = SparseCoder(d_in, n_latents, k_, kind)
    state = {name: t.float() for name, t in tensors.items()}
    state.setdefault("threshold", model.threshold)
    state.setdefault("norm_scale", model.norm_scale)
    with torch.no_grad():
        model.load_state_dict(state)
    return model.eval()


def foreign_config(fmt: str, path: Path, model: SparseCoder, *, hookpoint: str | None, mapped: str | None,
                   model_name: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config dict of a foreign dictionary; logs the hookpoint mapping so the user sees it."""
    config: dict[str, Any] = {"format": fmt, "source_format": fmt, "source": str(path), "kind": model.kind,
                              "d_in": model.d_in, "n_latents": model.n_latents, "k": model.k, "n_sources": 1}
    if mapped:
        config["hookpoints"] = [mapped]
        config["hookpoint_mapping"] = {hookpoint: mapped}
        if hookpoint != mapped and (str(path), hookpoint) not in _SHOWN:
            _SHOWN.add((str(path), hookpoint))  # once per dictionary, though commands read the config and weights
            log.info("%s hookpoint %r -> conceptdict hookpoint %r", fmt, hookpoint, mapped)
    if model_name:
        config["model"] = model_name
    config.update(extra or {})
    return config
