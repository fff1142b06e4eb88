"""Dictionary artifacts on disk: the native layout (DESIGN.md "Dictionary artifact") and the SAELens layout.

Native: ``config.json`` + ``weights.safetensors`` with ``W_enc [D, L]``, ``b_enc [L]``, ``W_dec [L, D]``,
``b_dec [D]`` (+ ``threshold [L]`` for kinds with a JumpReLU inference rule); with S > 1 sources the encoder
and decoder carry a leading sources axis: ``W_enc [S, D, L]``, ``W_dec [S, L, D]``, ``b_dec [S, D]``.
Weights are always in raw activation units (any training normalisation is folded in; its constants are
recorded in config.json). Configuration is read from config.json, never inferred from tensor names.

SAELens: ``cfg.json`` + ``sae_weights.safetensors`` as SAELens 6.x reads them (checked against sae-lens
6.54's ``SAEConfig`` / ``TopKSAEConfig`` / ``JumpReLUSAE``): TopK -> ``architecture: topk`` with ``k``;
BatchTopK -> ``jumprelu`` with its inference ``threshold`` per latent; ReLU -> ``standard``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .files import read_safetensors
from .model import SparseCoder, kind_spec

FORMAT = "conceptdict-dictionary"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.safetensors"
SAELENS_CONFIG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
CORE_KEYS = ("format", "format_version", "kind", "d_in", "n_latents", "k", "n_sources")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def disk_tensors(model: SparseCoder) -> dict[str, torch.Tensor]:
    """The model's weights in the on-disk layout (leading sources axis when S > 1)."""
    S, D, L = model.n_sources, model.d_in, model.n_latents
    out = {"W_enc": model.W_enc, "b_enc": model.b_enc, "W_dec": model.W_dec, "b_dec": model.b_dec}
    if S > 1:
        out["W_enc"] = model.W_enc.reshape(S, D, L)
        out["W_dec"] = model.W_dec.view(L, S, D).permute(1, 0, 2)
        out["b_dec"] = model.b_dec.view(S, D)
    if model.spec.uses_threshold:
        out["threshold"] = model.threshold
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
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": model.kind}
    _save_tensors(directory / WEIGHTS_FILE, disk_tensors(model), meta)
    _write_json(directory / CONFIG_FILE, config)
    return directory


def load_dictionary_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a saved dictionary (kind, shapes, hookpoints, stores, training summary, ...)."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}: not a saved dictionary "
                                f"(train one with `conceptdict train --out DIR`)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} has format {config.get('format')!r}, expected {FORMAT!r}; "
                         f"for a SAELens directory use import_saelens")
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {config['format_version']} but this conceptdict reads up "
                         f"to {FORMAT_VERSION}; upgrade conceptdict")
    return config


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], where: Path) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"{where}: tensor {name} has shape {list(t.shape)} but config.json implies "
                         f"{list(shape)}; the artifact is inconsistent, re-save it")
    return t


def load_dictionary(directory: str | Path, device: str | torch.device = "cpu") -> SparseCoder:
    """A dictionary saved by :func:`save_dictionary` (config.json decides kind and shapes)."""
    directory = Path(directory)
    cfg = load_dictionary_config(directory)
    S, D, L, k = int(cfg["n_sources"]), int(cfg["d_in"]), int(cfg["n_latents"]), int(cfg["k"])
    model = SparseCoder(D, L, k, cfg["kind"], n_sources=S)
    path = directory / WEIGHTS_FILE
    t = read_safetensors(path)  # a truncated or foreign weights file is named, not a traceback
    lead = (S,) if S > 1 else ()
    W_enc = _expect("W_enc", t["W_enc"], (*lead, D, L), path).reshape(S * D, L)
    W_dec = _expect("W_dec", t["W_dec"], (*lead, L, D), path)
    W_dec = W_dec.permute(1, 0, 2).reshape(L, S * D) if S > 1 else W_dec
    b_dec = _expect("b_dec", t["b_dec"], (*lead, D), path).reshape(S * D)
    state = {"W_enc": W_enc, "b_enc": _expect("b_enc", t["b_enc"], (L,), path), "W_dec": W_dec, "b_dec": b_dec,
             "threshold": t["threshold"] if "threshold" in t else model.threshold}
    if model.spec.uses_threshold:
        _expect("threshold", state["threshold"], (L,), path)
    model.load_state_dict(state)
    model.training_summary = cfg.get("training")
    return model.to(device).eval()


# -- SAELens ----------------------------------------------------------------------------------

SAELENS_ARCH = {"topk": "topk", "batchtopk": "jumprelu", "relu": "standard"}
"""our kind -> SAELens architecture (BatchTopK is saved as the JumpReLU it runs as at inference)."""


def export_saelens(model: SparseCoder, directory: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``cfg.json`` + ``sae_weights.safetensors`` that ``sae_lens.SAE.load_from_disk`` reads.

    ``meta`` fills SAELens ``metadata`` (model_name, hook_name, context_size, prepend_bos, dataset_path, ...)."""
    if model.n_sources != 1:
        raise ValueError(f"SAELens has no crosscoder layout (n_sources={model.n_sources}); export the native "
                         f"artifact with save_dictionary instead")
    if model.kind not in SAELENS_ARCH:
        raise ValueError(f"kind {model.kind!r} has no SAELens equivalent; exportable kinds: {sorted(SAELENS_ARCH)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"model_name": None, "hook_name": None, "hook_head_index": None, "context_size": None,
                "prepend_bos": True, "dataset_path": None, "exported_by": "conceptdict",
                "conceptdict_kind": model.kind, "conceptdict_k": model.k}
    metadata.update(meta or {})
    cfg: dict[str, Any] = {
        "architecture": SAELENS_ARCH[model.kind], "d_in": model.d_in, "d_sae": model.n_latents,
        "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
        "reshape_activations": "none", "metadata": metadata,
    }
    if model.kind == "topk":
        cfg.update(k=model.k, rescale_acts_by_decoder_norm=False)
    tensors = {"W_enc": model.W_enc, "b_enc": model.b_enc, "W_dec": model.W_dec, "b_dec": model.b_dec}
    if model.kind == "batchtopk":
        tensors["threshold"] = model.threshold
    _save_tensors(directory / SAELENS_WEIGHTS, {k: v.float() for k, v in tensors.items()}, {})
    _write_json(directory / SAELENS_CONFIG, cfg)
    return directory


def import_saelens(directory: str | Path) -> SparseCoder:
    """Read a SAELens directory (topk, jumprelu, standard) into a SparseCoder.

    A ``jumprelu`` SAE becomes kind batchtopk (same inference rule; k from our export's metadata, else
    the rounded mean L0 is unknown and k = 1 is recorded). ``apply_b_dec_to_input: false`` is folded
    into b_enc exactly. Other normalisations are refused (their constants are not in the files)."""
    directory = Path(directory)
    path = directory / SAELENS_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {SAELENS_CONFIG}: not a SAELens directory")
    cfg = json.loads(path.read_text())
    arch = cfg.get("architecture", "standard")
    kinds = {v: k for k, v in SAELENS_ARCH.items()}
    if arch not in kinds:
        raise ValueError(f"{path}: SAELens architecture {arch!r} is not supported; supported: {sorted(kinds)}")
    if cfg.get("normalize_activations", "none") != "none":
        raise ValueError(f"{path}: normalize_activations={cfg['normalize_activations']!r} needs run-time "
                         f"constants SAELens does not save; only 'none' can be imported")
    D, L = int(cfg["d_in"]), int(cfg["d_sae"])
    meta = cfg.get("metadata") or {}
    k = int(cfg["k"]) if arch == "topk" else int(meta.get("conceptdict_k") or 1)
    model = SparseCoder(D, L, k, kinds[arch])
    with safe_open(str(directory / SAELENS_WEIGHTS), framework="pt") as fh:
        t = {name: fh.get_tensor(name).float() for name in fh.keys()}
    state = {"W_enc": t["W_enc"], "b_enc": t["b_enc"], "W_dec": t["W_dec"], "b_dec": t["b_dec"],
             "threshold": t.get("threshold", model.threshold)}
    if not cfg.get("apply_b_dec_to_input", True):
        state["b_enc"] = state["b_enc"] + state["b_dec"] @ state["W_enc"]
    model.load_state_dict(state)
    model.saelens_metadata = meta
    kind_spec(model.kind)
    return model.eval()
