"""Dictionary artifacts on disk: the native layout (DESIGN.md "Dictionary artifact").

Native: ``config.json`` + ``weights.safetensors`` with ``W_enc [D, L]``, ``b_enc [L]``, ``W_dec [L, D]``,
``b_dec [D]`` (+ ``threshold [L]`` for kinds with a JumpReLU inference rule, ``W_skip [D, D]`` for skip
transcoders, whose config.json also names ``input_hookpoint`` and ``output_hookpoint``); with S > 1 sources the encoder
and decoder carry a leading sources axis: ``W_enc [S, D, L]``, ``W_dec [S, L, D]``, ``b_dec [S, D]`` (a cross-layer
transcoder over S layers: ``W_enc [S, D, L/S]``, one encoder per layer; ``W_dec [S, L, D]`` per target layer, zero
from a latent to the layers before its own).
Weights are always in raw activation units (any training normalisation is folded in; its constants are
recorded in config.json). Configuration is read from config.json, never inferred from tensor names.

Other libraries' layouts (SAELens, sparsify, dictionary_learning, Gemma Scope) are read and written by
``saes.formats``, whose ``load_dictionary`` is the loader every command uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .model import SparseCoder

FORMAT = "conceptdict-dictionary"
FORMAT_VERSION = 2
"""2: kinds ``batchtopk`` and ``crosscoder`` are row-relative and save ``norm_scale [S]``; version 1's
``batchtopk`` / ``crosscoder`` (the published rules) read as ``batchtopk-absolute`` / ``crosscoder-absolute``."""
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
CORE_KEYS = ("format", "format_version", "kind", "d_in", "n_latents", "k", "n_sources")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def disk_tensors(model: SparseCoder) -> dict[str, torch.Tensor]:
    """The model's weights in the on-disk layout (leading sources axis when S > 1)."""
    S, D, L = model.n_sources, model.d_in, model.n_latents
    out = {"W_enc": model.W_enc, "b_enc": model.b_enc, "W_dec": model.W_dec, "b_dec": model.b_dec}
    if S > 1:
        out["W_enc"] = (model.W_enc.view(D, S, L // S).transpose(0, 1) if model.spec.layered  # [S, D, L/S]
                        else model.W_enc.reshape(S, D, L))
        out["W_dec"] = model.W_dec.view(L, S, D).permute(1, 0, 2)
        out["b_dec"] = model.b_dec.view(S, D)
    if model.spec.uses_threshold:
        out["threshold"] = model.threshold
    if model.spec.relative:
        out["norm_scale"] = model.norm_scale
    if model.spec.skip:
        out["W_skip"] = model.W_skip
    out.update({name: getattr(model, name) for name in model.spec.buffers})
    return {k: v.detach() for k, v in out.items()}


def save_dictionary(model: SparseCoder, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + weights.safetensors to ``directory``; ``extra`` adds keys to config.json
    (e.g. ``hookpoints``, ``stores``, ``model``). Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(CORE_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite the dictionary's own config; rename them")
    summary = getattr(model, "training_summary", None)
    config: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": model.kind, "d_in": model.d_in,
        "n_latents": model.n_latents, "k": model.k, "n_sources": model.n_sources,
        "normalisation": (summary or {}).get("normalisation", {"scale_per_source": [1.0] * model.n_sources,
                                                               "folded_into_weights": True}),
    }
    if summary is not None:
        config["training"] = summary
    config.update(extra)
    if model.spec.transcodes and len(config.get("hookpoints") or []) == 2:
        config["input_hookpoint"], config["output_hookpoint"] = config["hookpoints"]
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": model.kind}
    save_tensors(directory / WEIGHTS_FILE, disk_tensors(model), meta)
    write_json(directory / CONFIG_FILE, config)
    return directory


def load_native_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a saved dictionary (kind, shapes, hookpoints, stores, training summary, ...)."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}: not a saved dictionary "
                                f"(train one with `conceptdict train --out DIR`)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} has format {config.get('format')!r}, expected {FORMAT!r}; other libraries' "
                         f"dictionaries are read by conceptdict.saes.load_dictionary")
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {config['format_version']} but this conceptdict reads up "
                         f"to {FORMAT_VERSION}; upgrade conceptdict")
    return config


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], where: Path) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"{where}: tensor {name} has shape {list(t.shape)} but config.json implies "
                         f"{list(shape)}; the artifact is inconsistent, re-save it")
    return t


def load_native(directory: str | Path, device: str | torch.device = "cpu") -> SparseCoder:
    """A dictionary saved by :func:`save_dictionary` (config.json decides kind and shapes)."""
    from .formats.files import read_safetensors

    directory = Path(directory)
    cfg = load_native_config(directory)
    S, D, L, k = int(cfg["n_sources"]), int(cfg["d_in"]), int(cfg["n_latents"]), int(cfg["k"])
    kind = cfg["kind"]
    if int(cfg.get("format_version", 1)) < 2:  # version 1 ran the absolute rules under these names
        kind = {"batchtopk": "batchtopk-absolute", "crosscoder": "crosscoder-absolute"}.get(kind, kind)
    model = SparseCoder(D, L, k, kind, n_sources=S)
    path = directory / WEIGHTS_FILE
    t = read_safetensors(path)
    missing = sorted({"W_enc", "b_enc", "W_dec", "b_dec", *model.spec.buffers,
                      *(("W_skip",) if model.spec.skip else ())} - set(t))
    if missing:
        raise ValueError(f"{path} lacks tensors {missing} that a {cfg['kind']} dictionary needs; re-save it")
    lead = (S,) if S > 1 else ()
    if model.spec.layered:  # one encoder [D, L/S] per layer
        W_enc = _expect("W_enc", t["W_enc"], (S, D, L // S), path).transpose(0, 1).reshape(D, L)
    else:
        W_enc = _expect("W_enc", t["W_enc"], (*lead, D, L), path).reshape(S * D, L)
    W_dec = _expect("W_dec", t["W_dec"], (*lead, L, D), path)
    W_dec = W_dec.permute(1, 0, 2).reshape(L, S * D) if S > 1 else W_dec
    mask = model.decoder_mask()
    if mask is not None and W_dec.masked_select(~mask).any():
        raise ValueError(f"{path}: W_dec has non-zero entries from a {kind} latent to a layer before its own, which "
                         f"it never writes to; the artifact is inconsistent, re-save it")
    b_dec = _expect("b_dec", t["b_dec"], (*lead, D), path).reshape(S * D)
    state = {"W_enc": W_enc, "b_enc": _expect("b_enc", t["b_enc"], (L,), path), "W_dec": W_dec, "b_dec": b_dec,
             "threshold": t["threshold"] if "threshold" in t else model.threshold,
             "norm_scale": t["norm_scale"] if "norm_scale" in t else model.norm_scale}
    if model.spec.uses_threshold:
        _expect("threshold", state["threshold"], (L,), path)
    if model.spec.relative:
        if "norm_scale" not in t:
            raise ValueError(f"{path}: kind {kind!r} needs the tensor norm_scale, which is missing; re-save the "
                             f"dictionary with this conceptdict")
        _expect("norm_scale", state["norm_scale"], (S,), path)
    state.update({name: _expect(name, t[name], (L,), path) for name in model.spec.buffers})
    if model.spec.skip:
        state["W_skip"] = _expect("W_skip", t["W_skip"], (D, D), path)
    model.load_state_dict(state)
    model.training_summary = cfg.get("training")
    return model.to(device).eval()

