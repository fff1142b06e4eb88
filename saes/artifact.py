"""Dictionary artifacts on disk: the native layout (DESIGN.md "Dictionary artifact").

Native: ``config.json`` + ``weights.safetensors`` with ``W_enc [D, L]``, ``b_enc [L]``, ``W_dec [L, D]``,
``b_dec [D]`` (+ ``threshold [L]`` for kinds with a JumpReLU inference rule, ``W_skip [D, D]`` for skip
transcoders, whose config.json also names ``input_hookpoint`` and ``output_hookpoint``); with S > 1 sources the encoder
and decoder carry a leading sources axis: ``W_enc [S, D, L]``, ``W_dec [S, L, D]``, ``b_dec [S, D]`` (a cross-layer
transcoder over S layers: ``W_enc [S, D, L/S]``, one encoder per layer; ``W_dec [S, L, D]`` per target layer, zero
from a latent to the layers before its own).
A dictionary too large to gather onto one process (a latent-sharded run above ``TrainConfig.single_file_gib``) is
saved as one file per latent shard instead of ``weights.safetensors``: ``weights-00001-of-0000N.safetensors`` ..
(file i: the i-th block of latents of every per-latent tensor; the tensors every latent shares, ``b_dec``,
``norm_scale``, ``W_skip``, in the first file only) and ``weights.index.json`` naming the files in latent order, the
latents each holds, the axis along which each tensor is split (null: whole, in the first file) and the groups along
that axis (``latent_groups``: a cross-layer transcoder's file i holds the i-th slice of every layer's latents, so its
per-latent tensors other than ``W_enc`` run over S groups; saes.latents). The index is written after every file, then
config.json; :func:`load_native` joins the files into one dictionary.
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

from .latents import latent_groups, place
from .model import SparseCoder

FORMAT = "conceptdict-dictionary"
FORMAT_VERSION = 2
"""2: kinds ``batchtopk`` and ``crosscoder`` are row-relative and save ``norm_scale [S]``; version 1's
``batchtopk`` / ``crosscoder`` (the published rules) read as ``batchtopk-absolute`` / ``crosscoder-absolute``."""
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
INDEX_FILE = "weights.index.json"
"""The index of a dictionary saved as several files (one per latent shard)."""
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


def part_file(part: int, parts: int) -> str:
    """The weights file of latent block ``part`` (0-based) of ``parts``: ``weights-00001-of-00004.safetensors``."""
    return f"weights-{part + 1:05d}-of-{parts:05d}.safetensors"


def disk_latent_axes(model: SparseCoder) -> dict[str, int | None]:
    """The axis of each on-disk tensor (:func:`disk_tensors`) that runs over the latents; None for the tensors every
    latent shares."""
    lead = 1 if model.n_sources > 1 else 0
    return {name: (lead + 1 if name == "W_enc" else lead if name == "W_dec" else
                   None if model.latent_axis(name) is None else 0) for name in disk_tensors(model)}


def disk_latent_groups(model: SparseCoder) -> dict[str, int]:
    """The groups along each on-disk tensor's latent axis (saes.latents): a CLT's layers, except for its encoder
    ``[S, D, L/S]``, whose latent axis runs over one layer's latents; 1 for every other kind."""
    return {name: 1 if name == "W_enc" else latent_groups(model, "b_enc") for name in disk_tensors(model)}


def save_dictionary(model: SparseCoder, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + weights.safetensors to ``directory``; ``extra`` adds keys to config.json
    (e.g. ``hookpoints``, ``stores``, ``model``). Returns the directory. The files of a dictionary saved as
    several files there before are removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = _config(model, extra, model.n_latents)
    save_tensors(directory / WEIGHTS_FILE, disk_tensors(model), _file_meta(model))
    _remove(directory, [INDEX_FILE, *(p.name for p in directory.glob("weights-*-of-*.safetensors"))])
    write_json(directory / CONFIG_FILE, config)
    return directory


def save_dictionary_part(model: SparseCoder, directory: str | Path, part: int, parts: int) -> Path:
    """Write ``model``, latent block ``part`` of ``parts`` of a dictionary (a latent shard), as its weights file
    (:func:`part_file`) in ``directory``; the tensors every latent shares go into the first file only. The
    dictionary is readable once :func:`finish_parts` has written the index and config.json. Returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    axes = disk_latent_axes(model)
    tensors = {k: v for k, v in disk_tensors(model).items() if axes[k] is not None or part == 0}
    path = directory / part_file(part, parts)
    save_tensors(path, tensors, {**_file_meta(model), "part": f"{part + 1} of {parts}"})
    return path


def finish_parts(model: SparseCoder, directory: str | Path, parts: int, extra: dict[str, Any] | None = None) -> Path:
    """After every latent block's :func:`save_dictionary_part` (``model``: the first block, each of ``parts``
    equal), write weights.index.json and config.json (the whole dictionary's) and remove a weights.safetensors
    left there before. Returns the directory."""
    directory = Path(directory)
    config = _config(model, extra, model.n_latents * parts)
    files, axes = [part_file(i, parts) for i in range(parts)], disk_latent_axes(model)
    missing = [f for f in files if not (directory / f).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} lacks {missing}: every latent block is saved (save_dictionary_part) "
                                f"before the index is written")
    write_json(directory / INDEX_FILE, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "n_latents": model.n_latents * parts, "files": files,
        "latents_per_file": [model.n_latents] * parts, "latent_axis": axes, "latent_groups": disk_latent_groups(model),
        "latent_extent": {k: t.shape[axes[k]] * parts for k, t in disk_tensors(model).items() if axes[k] is not None}})
    _remove(directory, [WEIGHTS_FILE, *(p.name for p in directory.glob("weights-*-of-*.safetensors")
                                        if p.name not in files)])
    write_json(directory / CONFIG_FILE, config)
    return directory


def _file_meta(model: SparseCoder) -> dict[str, str]:
    """The safetensors header metadata of every weights file of ``model``."""
    return {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": model.kind}


def _remove(directory: Path, names: list[str]) -> None:
    for name in names:
        (directory / name).unlink(missing_ok=True)


def _config(model: SparseCoder, extra: dict[str, Any] | None, n_latents: int) -> dict[str, Any]:
    """config.json of ``model`` (``n_latents``: the whole dictionary's, when ``model`` is one latent block)."""
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(CORE_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite the dictionary's own config; rename them")
    summary = getattr(model, "training_summary", None)
    config: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": model.kind, "d_in": model.d_in,
        "n_latents": n_latents, "k": model.k, "n_sources": model.n_sources,
        "normalisation": (summary or {}).get("normalisation", {"scale_per_source": [1.0] * model.n_sources,
                                                               "folded_into_weights": True}),
    }
    if summary is not None:
        config["training"] = summary
    config.update(extra)
    if model.spec.transcodes and len(config.get("hookpoints") or []) == 2:
        config["input_hookpoint"], config["output_hookpoint"] = config["hookpoints"]
    return config


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


def native_kind(cfg: dict[str, Any]) -> str:
    """The kind a config.json's dictionary runs as (version 1 ran the absolute rules under the names ``batchtopk`` and
    ``crosscoder``)."""
    kind = cfg["kind"]
    if int(cfg.get("format_version", 1)) < 2:
        kind = {"batchtopk": "batchtopk-absolute", "crosscoder": "crosscoder-absolute"}.get(kind, kind)
    return kind


def native_state(model: SparseCoder, t: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` (its shapes: kind, D, L, S; it may be on the meta device) out of the on-disk
    tensors ``t`` (:func:`disk_tensors`' layout) read from ``path``; every shape checked, the error names the tensor."""
    S, D, L, kind = model.n_sources, model.d_in, model.n_latents, model.kind
    missing = sorted({"W_enc", "b_enc", "W_dec", "b_dec", *model.spec.buffers,
                      *(("W_skip",) if model.spec.skip else ())} - set(t))
    if missing:
        raise ValueError(f"{path} lacks tensors {missing} that a {kind} dictionary needs; re-save it")
    lead = (S,) if S > 1 else ()
    if model.spec.layered:  # one encoder [D, L/S] per layer
        W_enc = _expect("W_enc", t["W_enc"], (S, D, L // S), path).transpose(0, 1).reshape(D, L)
    else:
        W_enc = _expect("W_enc", t["W_enc"], (*lead, D, L), path).reshape(S * D, L)
    W_dec = _expect("W_dec", t["W_dec"], (*lead, L, D), path)
    W_dec = W_dec.permute(1, 0, 2).reshape(L, S * D) if S > 1 else W_dec
    per_layer = L // S  # a layered kind's latents of layer l write nothing to layers < l (checked block by block:
    # no [L, S*D] mask, and a model on the meta device, as saes.lazy_clt builds one, has none to give)
    if model.spec.layered and any(W_dec[l * per_layer:(l + 1) * per_layer, :l * D].any() for l in range(1, S)):
        raise ValueError(f"{path}: W_dec has non-zero entries from a {kind} latent to a layer before its own, which "
                         f"it never writes to; the artifact is inconsistent, re-save it")
    b_dec = _expect("b_dec", t["b_dec"], (*lead, D), path).reshape(S * D)
    state = {"W_enc": W_enc, "b_enc": _expect("b_enc", t["b_enc"], (L,), path), "W_dec": W_dec, "b_dec": b_dec,
             "threshold": t["threshold"] if "threshold" in t else torch.full((L,), -1.0),
             "norm_scale": t["norm_scale"] if "norm_scale" in t else torch.ones(S)}
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
    return state


def load_native(directory: str | Path, device: str | torch.device = "cpu") -> SparseCoder:
    """A dictionary saved by :func:`save_dictionary` (config.json decides kind and shapes)."""
    directory = Path(directory)
    cfg = load_native_config(directory)
    S, D, L, k = int(cfg["n_sources"]), int(cfg["d_in"]), int(cfg["n_latents"]), int(cfg["k"])
    model = SparseCoder(D, L, k, native_kind(cfg), n_sources=S, init=False)  # every tensor is read: no draw
    path, t = read_weights(directory)
    model.load_state_dict(native_state(model, t, path))  # strict: a tensor the file lacks is refused
    model.training_summary = cfg.get("training")
    return model.to(device).eval()


def read_index(directory: Path) -> dict[str, Any]:
    """weights.index.json of a dictionary saved in latent blocks, every file it names checked to be there."""
    from .formats.files import FormatError, read_json

    index = read_json(directory / INDEX_FILE)
    files = list(index["files"])
    missing = [f for f in files if not (directory / f).exists()]
    if missing:
        raise FormatError(f"{directory / missing[0]} is missing: {directory} holds a dictionary saved in {len(files)} "
                          f"files ({INDEX_FILE} names them), {len(missing)} of which are not there ({missing}); copy "
                          f"every file the index names into {directory}, or save the dictionary again")
    return index


def read_weights(directory: str | Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file that names them, every tensor) of a saved dictionary: weights.safetensors, or the files
    weights.index.json names joined along each tensor's latent axis (one block in memory at a time besides the
    joined tensors; safetensors maps each file)."""
    from .formats.files import FormatError, read_safetensors

    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if not index_path.exists():
        return directory / WEIGHTS_FILE, read_safetensors(directory / WEIGHTS_FILE)
    index = read_index(directory)
    files, axes = list(index["files"]), dict(index["latent_axis"])
    groups, extents = dict(index.get("latent_groups", {})), dict(index.get("latent_extent", {}))
    total = int(index["n_latents"])
    joined: dict[str, torch.Tensor] = {}
    offset = 0
    for i, name in enumerate(files):
        part = read_safetensors(directory / name)
        n = int(index["latents_per_file"][i])
        for key, t in part.items():
            axis = axes.get(key)
            if axis is None:
                joined.setdefault(key, t)
                continue
            extent = int(extents.get(key, total))  # a CLT's W_enc [S, D, L/S]: one layer's latents
            if key not in joined:
                shape = list(t.shape)
                shape[axis] = extent
                joined[key] = t.new_empty(shape)
            if t.shape[axis] != n * extent // total:
                raise FormatError(f"{directory / name}: tensor {key} holds {t.shape[axis]} entries along axis {axis} "
                                  f"but {INDEX_FILE} says {n * extent // total}; the files do not belong together, "
                                  f"save the dictionary again")
            place(joined[key], t, axis, int(groups.get(key, 1)), offset * extent // total)
        offset += n
        del part
    if offset != total:
        raise FormatError(f"{index_path}: its files hold {offset} latents but it says n_latents={index['n_latents']}; "
                          f"the index is damaged, save the dictionary again")
    return index_path, joined
