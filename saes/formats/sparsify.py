"""sparsify (EleutherAI) directories: ``cfg.json`` + ``sae.safetensors``, one subfolder per hookpoint.

sparsify's ``SparseCoder`` encodes ``topk(relu((x - b_dec) encoder.weight^T + encoder.bias))`` and decodes
``codes W_dec + b_dec`` (checked against eai-sparsify 1.3): exactly our ``topk`` kind with ``W_enc =
encoder.weight^T``. ``multi_topk`` only changes the training loss, so it is read as plain TopK. A transcoder
(``transcode: true``) encodes ``x`` without subtracting ``b_dec``, exactly our ``transcoder`` kind; with
``skip_connection: true`` it adds ``x W_skip^T`` (sparsify's ``W_skip`` [D_out, D_in] is our ``W_skip`` [D_in,
D_out] transposed): our ``skip-transcoder``. The config records ``transcoder: true``; the two hookpoints
(input, output) are known only when conceptdict wrote the folder (``conceptdict_hookpoints`` in the run's
config.json). Refused: ``skip_connection`` on an SAE (no such kind here) and activations other than ``topk``
(``groupmax``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model import SparseCoder
from .common import Loaded, build, foreign_config
from .files import FormatError, expect_shapes, read_json, read_safetensors
from .hookpoints import from_module_path

CONFIG = "cfg.json"
WEIGHTS = "sae.safetensors"
NEEDS = f"{CONFIG} with 'num_latents' or 'expansion_factor' + {WEIGHTS} (a subfolder per hookpoint)"


def matches(directory: Path) -> bool:
    return (directory / CONFIG).exists() and (directory / WEIGHTS).exists()


def _run_config(directory: Path) -> dict[str, Any]:
    """The run's config.json one level up (sparsify's trainer records the model there), or {}."""
    run = directory.parent / "config.json"
    return read_json(run) if run.exists() else {}


def _run_model_name(directory: Path) -> str | None:
    """The model sparsify's trainer recorded in the run's config.json, one level up."""
    model = _run_config(directory).get("model")
    return model if isinstance(model, str) else None


def read(directory: Path) -> Loaded:
    path, wpath = directory / CONFIG, directory / WEIGHTS
    cfg = read_json(path)
    if "d_in" not in cfg:
        raise FormatError(f"{path} has no 'd_in' (sparsify writes it next to the SparseCoderConfig fields)")
    if cfg.get("activation", "topk") != "topk":
        raise FormatError(f"{path}: activation={cfg['activation']!r} is not supported; only sparsify's topk")
    transcoder, skip = bool(cfg.get("transcode")), bool(cfg.get("skip_connection"))
    if skip and not transcoder:
        raise FormatError(f"{path}: skip_connection=true on an SAE adds a dense W_skip path conceptdict holds only "
                          f"for transcoders (transcode=true)")
    D = int(cfg["d_in"])
    L = int(cfg.get("num_latents") or 0) or D * int(cfg["expansion_factor"])
    t = read_safetensors(wpath)
    shapes = {"encoder.weight": (L, D), "encoder.bias": (L,), "W_dec": (L, D), "b_dec": (D,)}
    expect_shapes(wpath, t, shapes | ({"W_skip": (D, D)} if skip else {}), path)
    tensors = {"W_enc": t["encoder.weight"].float().T, "b_enc": t["encoder.bias"].float(),
               "W_dec": t["W_dec"].float(), "b_dec": t["b_dec"].float()}
    if skip:
        tensors["W_skip"] = t["W_skip"].float().T
    kind = ("skip-transcoder" if skip else "transcoder") if transcoder else "topk"
    model = build(kind, D, L, int(cfg["k"]), tensors)
    hook = directory.name
    extra: dict[str, Any] = {"sparsify": {"multi_topk": bool(cfg.get("multi_topk")), "transcode": transcoder}}
    pair = _run_config(directory).get("conceptdict_hookpoints", {}).get(hook)
    if transcoder:
        extra["transcoder"] = True
        if pair:
            extra.update(hookpoints=list(pair), input_hookpoint=pair[0], output_hookpoint=pair[1])
    return Loaded(model, foreign_config("sparsify", directory, model, hookpoint=hook, mapped=from_module_path(hook),
                                        model_name=_run_model_name(directory), extra=extra))


WRITES = ("topk", "transcoder", "skip-transcoder")


def _tensors(model: SparseCoder) -> dict[str, torch.Tensor]:
    """sparsify's tensors of ``model``."""
    tensors = {"encoder.weight": model.W_enc.T.float(), "encoder.bias": model.b_enc.float(),
               "W_dec": model.W_dec.float(), "b_dec": model.b_dec.float()}
    if model.spec.skip:
        tensors["W_skip"] = model.W_skip.T.float()
    return tensors


def write(model: SparseCoder, directory: Path, hookpoint: str, model_name: str | None = None,
          transcoder_hookpoints: list[str] | None = None) -> Path:
    """sparsify's layout: ``directory/<hookpoint>/{cfg.json, sae.safetensors}`` (+ the run's config.json with
    the model name). TopK SAEs and (skip) transcoders are sparsify's kinds; ``transcoder_hookpoints`` [input,
    output] go into the run's config.json so that reading it back knows both. Returns the hookpoint folder."""
    from ..artifact import write_json
    from ..lazy import save_tensors_of

    if model.kind not in WRITES or model.n_sources != 1:
        raise ValueError(f"sparsify holds single-source TopK SAEs and transcoders ({', '.join(WRITES)}); a "
                         f"{model.kind} dictionary (n_sources={model.n_sources}) would encode differently there; "
                         f"export it as saelens or dictionary-learning instead")
    sub = directory / hookpoint
    sub.mkdir(parents=True, exist_ok=True)
    save_tensors_of(model, sub / WEIGHTS, _tensors, {})  # a lazy dictionary: block by block
    write_json(sub / CONFIG, {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True,
                              "num_latents": model.n_latents, "k": model.k, "multi_topk": False,
                              "skip_connection": model.spec.skip, "transcode": model.spec.transcodes,
                              "d_in": model.d_in})
    run: dict[str, Any] = {"hookpoints": [hookpoint], "exported_by": "conceptdict"}
    if model_name:
        run["model"] = model_name
    if model.spec.transcodes and transcoder_hookpoints:
        run["conceptdict_hookpoints"] = {hookpoint: list(transcoder_hookpoints)}
    if model_name or "conceptdict_hookpoints" in run:
        write_json(directory / "config.json", run)
    return sub


def export(model: SparseCoder, out: Path, *, config: dict[str, Any], model_name: str | None,
           hookpoint: str | None) -> Path:
    """``conceptdict export --format sparsify`` (``saes.formats.export.WRITERS``): :func:`write` under the hookpoint's
    folder; a transcoder's [input, output] hookpoints come from ``config``."""
    if not hookpoint:
        raise ValueError("sparsify names each SAE's folder after its hookpoint; the dictionary records none")
    pair = config.get("hookpoints") if model.spec.transcodes else None
    return write(model, out, hookpoint, model_name, transcoder_hookpoints=pair)
