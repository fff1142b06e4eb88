"""dictionary_learning (Marks et al.) checkpoints: ``ae.pt`` (a state dict) + ``config.json`` (``trainer`` block).

``ae.pt`` is read with ``torch.load(weights_only=True)``: tensors only, never arbitrary pickles. The class comes
from ``trainer.dict_class`` (checked against dictionary-learning 0.1.0's ``encode``/``decode``):

- ``AutoEncoder``: ``relu(encoder(x - bias))``, ``decoder(f) + bias`` -> relu;
- ``AutoEncoderNew``: ``relu(encoder(x))``, ``decoder(f)`` (with bias) -> relu, ``b_dec`` folded into ``b_enc``;
- ``AutoEncoderTopK``: TopK of ``relu(encoder(x - b_dec))`` -> topk with the stored ``k``;
- ``BatchTopKSAE`` / ``MatryoshkaBatchTopKSAE``: inference ``relu(pre) * (relu(pre) > threshold)`` with one scalar
  threshold -> batchtopk-absolute (threshold per latent, all equal) with the stored ``k``;
- ``JumpReluAutoEncoder``: ``x @ W_enc + b_enc`` (``b_dec`` not subtracted) -> jumprelu, ``b_dec`` folded;
- ``GatedAutoEncoder`` -> gated.

The state dict is read as the module holds it (``load_state_dict``), as ``encode``/``decode`` then run;
``AutoEncoder.from_pretrained``'s optional decoder renormalisation is not applied.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..model import SparseCoder
from .common import Loaded, build, foreign_config
from .files import FormatError, expect_shapes, read_json, read_torch_state
from .hookpoints import from_dictionary_learning

WEIGHTS = "ae.pt"
CONFIG = "config.json"
NEEDS = f"{WEIGHTS} (a torch state dict) + {CONFIG} with a 'trainer' block"


def matches(directory: Path) -> bool:
    return (directory / WEIGHTS).exists()


def _guess_class(state: dict[str, torch.Tensor]) -> str | None:
    if "gate_bias" in state:
        return "GatedAutoEncoder"
    if "W_enc" in state:
        return "MatryoshkaBatchTopKSAE" if "group_sizes" in state else "JumpReluAutoEncoder"
    if "b_dec" in state and "k" in state:
        return "AutoEncoderTopK"  # BatchTopKSAE has the same keys: config.json must say which
    if "bias" in state:
        return "AutoEncoder"
    if "decoder.bias" in state:
        return "AutoEncoderNew"
    return None


def _linear(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """encoder.weight [L, D] / decoder.weight [D, L] -> W_enc [D, L], W_dec [L, D]."""
    return {"W_enc": state["encoder.weight"].float().T, "W_dec": state["decoder.weight"].float().T}


def _scalar_threshold(state: dict[str, torch.Tensor], L: int, path: Path) -> torch.Tensor:
    thr = float(state["threshold"].reshape(-1)[0])
    if thr < 0:
        raise FormatError(f"{path}: threshold={thr} was never estimated (training stopped before "
                          f"threshold_start_step), so the BatchTopK inference rule is undefined")
    return torch.full((L,), thr)


def _convert(cls: str, state: dict[str, torch.Tensor], D: int, L: int, path: Path, cfg_path: Path
             ) -> tuple[str, int | None, dict[str, torch.Tensor]]:
    """(kind, k, tensors in our layout) for one dictionary_learning class."""
    lin = {"encoder.weight": (L, D), "decoder.weight": (D, L)}
    if cls in ("AutoEncoder", "AutoEncoderNew"):
        bias = "bias" if cls == "AutoEncoder" else "decoder.bias"
        expect_shapes(path, state, {**lin, "encoder.bias": (L,), bias: (D,)}, cfg_path)
        t = {**_linear(state), "b_enc": state["encoder.bias"].float(), "b_dec": state[bias].float()}
        if cls == "AutoEncoderNew":  # relu(x W + e) = relu((x - b) W + (e + b W))
            t["b_enc"] = t["b_enc"] + t["b_dec"] @ t["W_enc"]
        return "relu", None, t
    if cls in ("AutoEncoderTopK", "BatchTopKSAE"):
        expect_shapes(path, state, {**lin, "encoder.bias": (L,), "b_dec": (D,)}, cfg_path)
        t = {**_linear(state), "b_enc": state["encoder.bias"].float(), "b_dec": state["b_dec"].float()}
        if cls == "BatchTopKSAE":
            t["threshold"] = _scalar_threshold(state, L, path)
            return "batchtopk-absolute", int(state["k"]), t
        return "topk", int(state["k"]), t
    if cls in ("JumpReluAutoEncoder", "MatryoshkaBatchTopKSAE"):
        expect_shapes(path, state, {"W_enc": (D, L), "b_enc": (L,), "W_dec": (L, D), "b_dec": (D,)}, cfg_path)
        t = {n: state[n].float() for n in ("W_enc", "b_enc", "W_dec", "b_dec")}
        if cls == "MatryoshkaBatchTopKSAE":
            t["threshold"] = _scalar_threshold(state, L, path)
            return "batchtopk-absolute", int(state["k"]), t
        expect_shapes(path, state, {"threshold": (L,)}, cfg_path)
        t["threshold"] = state["threshold"].float()
        t["b_enc"] = t["b_enc"] + t["b_dec"] @ t["W_enc"]  # apply_b_dec_to_input is False
        return "jumprelu", None, t
    if cls == "GatedAutoEncoder":
        expect_shapes(path, state, {**lin, "decoder_bias": (D,), "gate_bias": (L,), "mag_bias": (L,),
                                    "r_mag": (L,)}, cfg_path)
        return "gated", None, {**_linear(state), "b_enc": state["gate_bias"].float(),
                               "b_dec": state["decoder_bias"].float(), "r_mag": state["r_mag"].float(),
                               "b_mag": state["mag_bias"].float()}
    raise FormatError(f"{cfg_path}: dict_class {cls!r} is not supported; supported: AutoEncoder, AutoEncoderNew, "
                      f"AutoEncoderTopK, BatchTopKSAE, MatryoshkaBatchTopKSAE, JumpReluAutoEncoder, GatedAutoEncoder")


def read(directory: Path) -> Loaded:
    path, cfg_path = directory / WEIGHTS, directory / CONFIG
    trainer: dict[str, Any] = read_json(cfg_path).get("trainer", {}) if cfg_path.exists() else {}
    state = read_torch_state(path)
    cls = trainer.get("dict_class") or _guess_class(state)
    if cls is None:
        raise FormatError(f"{path}: cannot tell the dictionary class from its tensors {sorted(state)} and there is "
                          f"no {cfg_path} naming trainer.dict_class")
    D = int(trainer.get("activation_dim") or 0)
    L = int(trainer.get("dict_size") or 0)
    if not (D and L):
        w = state.get("W_enc", state.get("encoder.weight"))
        if w is None:
            raise FormatError(f"{path}: no W_enc or encoder.weight to read the shapes from")
        D, L = (int(w.shape[0]), int(w.shape[1])) if "W_enc" in state else (int(w.shape[1]), int(w.shape[0]))
    kind, k, tensors = _convert(cls, state, D, L, path, cfg_path)
    model = build(kind, D, L, k if k is not None else trainer.get("k"), tensors)  # k is a record only there
    sub, layer = trainer.get("submodule_name"), trainer.get("layer")
    mapped = from_dictionary_learning(sub, int(layer) if layer is not None else None)
    return Loaded(model, foreign_config("dictionary-learning", directory, model, hookpoint=sub or f"layer {layer}",
                                        mapped=mapped, model_name=trainer.get("lm_name"),
                                        extra={"dictionary_learning": {"dict_class": cls}}))


def write(model: SparseCoder, directory: Path, hookpoint: str | None = None, model_name: str | None = None) -> Path:
    """``ae.pt`` + ``config.json`` that dictionary_learning's classes load with ``load_state_dict``: topk ->
    AutoEncoderTopK, batchtopk-absolute -> BatchTopKSAE (its threshold is one scalar), relu -> AutoEncoder,
    gated -> GatedAutoEncoder. A dictionary read lazily (``saes.lazy.LazyDictionary``) is written a block of latents
    at a time (``saes.lazy_io.TorchArchiveWriter``: the archive ``torch.save`` writes, its storages filled block by
    block), so that one larger than memory is exported without being whole."""
    from ..artifact import write_json
    from ..lazy_io import TorchArchiveWriter, write_blocks

    if model.n_sources != 1:
        raise ValueError(f"dictionary_learning's SAE classes are single-source; n_sources={model.n_sources}")
    classes = {"topk": "AutoEncoderTopK", "batchtopk-absolute": "BatchTopKSAE", "relu": "AutoEncoder",
               "gated": "GatedAutoEncoder"}
    if model.kind not in classes:
        raise ValueError(f"kind {model.kind!r} has no exact dictionary_learning class (JumpReluAutoEncoder does not "
                         f"subtract b_dec); export it as saelens instead")
    cls, first = classes[model.kind], []  # first: BatchTopKSAE's one threshold, from the first latent

    def state(block: SparseCoder) -> dict[str, torch.Tensor]:
        W_enc, W_dec = block.W_enc.detach().float(), block.W_dec.detach().float()
        lin = {"encoder.weight": W_enc.T.contiguous(), "decoder.weight": W_dec.T.contiguous()}
        b_enc, b_dec = block.b_enc.detach().float(), block.b_dec.detach().float()
        if cls == "AutoEncoder":
            return {**lin, "encoder.bias": b_enc, "bias": b_dec}
        if cls == "GatedAutoEncoder":
            return {"encoder.weight": lin["encoder.weight"], "decoder.weight": lin["decoder.weight"],
                    "decoder_bias": b_dec, "gate_bias": b_enc, "mag_bias": block.b_mag.detach().float(),
                    "r_mag": block.r_mag.detach().float()}
        thr = block.threshold.detach().float()
        if cls == "BatchTopKSAE" and not thr.is_meta:
            first.extend([] if first else [thr[0].clone()])
            if not torch.all(thr == first[0]):
                raise ValueError("dictionary_learning's BatchTopKSAE has one scalar threshold but this dictionary "
                                 "has one per latent; export it as saelens (jumprelu) instead")
        return {**lin, "encoder.bias": b_enc, "b_dec": b_dec, "k": torch.tensor(model.k, dtype=torch.int),
                "threshold": thr[0].clone() if cls == "BatchTopKSAE" else torch.tensor(-1.0)}

    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(model, SparseCoder):
        tmp = directory / (WEIGHTS + ".tmp")
        torch.save({k: v.contiguous() for k, v in state(model).items()}, tmp)
        tmp.replace(directory / WEIGHTS)
    else:  # read lazily: block by block
        write_blocks(model, state, lambda shapes: TorchArchiveWriter(directory / WEIGHTS, shapes))
    layer = re.match(r"blocks\.(\d+)\.", hookpoint or "")
    write_json(directory / CONFIG, {"trainer": {
        "dict_class": cls, "activation_dim": model.d_in, "dict_size": model.n_latents, "k": model.k,
        "layer": int(layer.group(1)) if layer else None, "lm_name": model_name, "submodule_name": hookpoint,
        "exported_by": "conceptdict"}})
    return directory


def export(model: SparseCoder, out: Path, *, config: dict[str, Any], model_name: str | None,
           hookpoint: str | None) -> Path:
    """``conceptdict export --format dictionary-learning`` (``saes.formats.export.WRITERS``): :func:`write`."""
    return write(model, out, hookpoint, model_name)
