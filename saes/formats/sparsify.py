"""sparsify (EleutherAI) directories: ``cfg.json`` + ``sae.safetensors``, one subfolder per hookpoint.

sparsify's ``SparseCoder`` encodes ``topk(relu((x - b_dec) encoder.weight^T + encoder.bias))`` and decodes
``codes W_dec + b_dec`` (checked against eai-sparsify 1.3): exactly our ``topk`` kind with ``W_enc =
encoder.weight^T``. ``multi_topk`` only changes the training loss, so it is read as plain TopK. A transcoder
(``transcode: true``) encodes ``x`` without subtracting ``b_dec``; that is folded into ``b_enc`` exactly, and
the config records ``transcoder: true`` because its decoder predicts a different hookpoint's output. Refused:
``skip_connection`` (an extra dense ``W_skip`` path) and activations other than ``topk`` (``groupmax``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..model import SparseCoder
from .common import Loaded, build, foreign_config
from .files import FormatError, expect_shapes, read_json, read_safetensors
from .hookpoints import from_module_path

CONFIG = "cfg.json"
WEIGHTS = "sae.safetensors"
NEEDS = f"{CONFIG} with 'num_latents' or 'expansion_factor' + {WEIGHTS} (a subfolder per hookpoint)"


def matches(directory: Path) -> bool:
    return (directory / CONFIG).exists() and (directory / WEIGHTS).exists()


def _run_model_name(directory: Path) -> str | None:
    """The model sparsify's trainer recorded in the run's config.json, one level up."""
    run = directory.parent / "config.json"
    if not run.exists():
        return None
    model = read_json(run).get("model")
    return model if isinstance(model, str) else None


def read(directory: Path) -> Loaded:
    path, wpath = directory / CONFIG, directory / WEIGHTS
    cfg = read_json(path)
    if "d_in" not in cfg:
        raise FormatError(f"{path} has no 'd_in' (sparsify writes it next to the SparseCoderConfig fields)")
    if cfg.get("activation", "topk") != "topk":
        raise FormatError(f"{path}: activation={cfg['activation']!r} is not supported; only sparsify's topk")
    if cfg.get("skip_connection"):
        raise FormatError(f"{path}: skip_connection=true adds a dense W_skip path conceptdict cannot hold")
    D = int(cfg["d_in"])
    L = int(cfg.get("num_latents") or 0) or D * int(cfg["expansion_factor"])
    t = read_safetensors(wpath)
    expect_shapes(wpath, t, {"encoder.weight": (L, D), "encoder.bias": (L,), "W_dec": (L, D), "b_dec": (D,)}, path)
    tensors = {"W_enc": t["encoder.weight"].float().T, "b_enc": t["encoder.bias"].float(),
               "W_dec": t["W_dec"].float(), "b_dec": t["b_dec"].float()}
    transcoder = bool(cfg.get("transcode"))
    if transcoder:  # pre = x W + e = (x - b_dec) W + (e + b_dec W)
        tensors["b_enc"] = tensors["b_enc"] + tensors["b_dec"] @ tensors["W_enc"]
    model = build("topk", D, L, int(cfg["k"]), tensors)
    hook = directory.name
    extra: dict[str, Any] = {"sparsify": {"multi_topk": bool(cfg.get("multi_topk")), "transcode": transcoder}}
    if transcoder:
        extra["transcoder"] = True
    return Loaded(model, foreign_config("sparsify", directory, model, hookpoint=hook, mapped=from_module_path(hook),
                                        model_name=_run_model_name(directory), extra=extra))


def write(model: SparseCoder, directory: Path, hookpoint: str, model_name: str | None = None) -> Path:
    """sparsify's layout: ``directory/<hookpoint>/{cfg.json, sae.safetensors}`` (+ the run's config.json with
    the model name). Only TopK dictionaries are sparsify's kind of SAE. Returns the hookpoint folder."""
    from ..artifact import save_tensors, write_json

    if model.kind != "topk" or model.n_sources != 1:
        raise ValueError(f"sparsify SAEs are single-source TopK; a {model.kind} dictionary (n_sources="
                         f"{model.n_sources}) would encode differently there; export it as saelens or "
                         f"dictionary-learning instead")
    sub = directory / hookpoint
    sub.mkdir(parents=True, exist_ok=True)
    save_tensors(sub / WEIGHTS, {"encoder.weight": model.W_enc.T.float(), "encoder.bias": model.b_enc.float(),
                                 "W_dec": model.W_dec.float(), "b_dec": model.b_dec.float()}, {})
    write_json(sub / CONFIG, {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True,
                              "num_latents": model.n_latents, "k": model.k, "multi_topk": False,
                              "skip_connection": False, "transcode": False, "d_in": model.d_in})
    if model_name:
        write_json(directory / "config.json", {"model": model_name, "hookpoints": [hookpoint],
                                               "exported_by": "conceptdict"})
    return sub
