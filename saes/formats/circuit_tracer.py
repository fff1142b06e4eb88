"""circuit-tracer's layout (safety-research/circuit-tracer: attribution graphs over replacement models), both ways.

A folder with ``config.yaml`` naming ``model_kind`` and the hooks every layer's features read and write, relative to
``blocks.{layer}.`` (``feature_input_hook``, ``feature_output_hook``; e.g. ``mlp.hook_in`` / ``mlp.hook_out``):

- ``cross_layer_transcoder``: per layer l, ``W_enc_{l}.safetensors`` holding ``W_enc_{l}`` [P, D] (feature-major),
  ``b_enc_{l}`` [P], ``b_dec_{l}`` [D] and, for JumpReLU, ``threshold_{l}`` [P]; ``W_dec_{l}.safetensors`` holding
  ``W_dec_{l}`` [P, S - l, D], the decoders to layers l..S-1. Features are JumpReLU (``x * (x > threshold)`` of the
  pre-activation) or ReLU: read as a ``clt-batchtopk`` (its inference rule is JumpReLU with a threshold per
  latent, equal to circuit-tracer's for thresholds >= 0). A ``clt`` (TopK per layer) has no such rule there.
- ``transcoder_set``: ``layer_{l}.safetensors`` per layer with ``W_enc`` [P, D], ``W_dec`` [P, D], ``b_enc``,
  ``b_dec``, optional ``W_skip`` (applied as ``x @ W_skip.T``) and ``activation: topk`` + ``k`` in config.yaml (newer
  circuit-tracer also writes a ``k`` tensor, which it reads; 0.5, on PyPI, refuses that tensor and has no TopK)
  (TopK of the pre-activations: equal to ours, TopK of their ReLU, on rows with at least k positive ones). A set is
  many dictionaries: ``DIR/layer_{l}.safetensors`` names one (every command reads that path); ``DIR`` itself only
  when it holds one layer.

Layers must run 0..S-1 (circuit-tracer indexes them so); weights are written in float32.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import torch

from ..kinds.clt import block_name, decoder_blocks
from ..model import SparseCoder
from .common import Loaded, foreign_config
from .files import FormatError, read_safetensors

CONFIG = "config.yaml"
NEEDS = ("config.yaml with model_kind cross_layer_transcoder (W_enc_N / W_dec_N.safetensors) or transcoder_set "
         "(layer_N.safetensors)")
WEIGHTS = "W_enc_0.safetensors"
_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _yaml(path: Path) -> dict[str, Any] | None:
    import yaml

    file = path / CONFIG
    if not file.is_file():
        return None
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise FormatError(f"{file} is not valid YAML ({str(e).splitlines()[0]}); fix or re-export it") from None
    return data if isinstance(data, dict) and "model_kind" in data else None


def matches(path: Path) -> bool:
    if path.is_file():
        return bool(re.fullmatch(r"layer_\d+\.safetensors", path.name)) and \
            (_yaml(path.parent) or {}).get("model_kind") == "transcoder_set"
    return path.is_dir() and (_yaml(path) or {}).get("model_kind") in ("cross_layer_transcoder", "transcoder_set")


def read(path: Path) -> Loaded:
    if path.is_file():
        return _read_layer(path, _yaml(path.parent) or {})
    config = _yaml(path) or {}
    if config["model_kind"] == "cross_layer_transcoder":
        return _read_clt(path, config)
    layers = sorted(path.glob("layer_*.safetensors"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if len(layers) != 1:
        raise FormatError(f"{path} is a circuit-tracer transcoder set of {len(layers)} layers, one dictionary each: "
                          f"pass one, e.g. {path / 'layer_0.safetensors'}")
    return _read_layer(layers[0], config)


def _hooks(config: dict[str, Any], layer: int) -> list[str]:
    return [f"blocks.{layer}.{config.get('feature_input_hook', 'mlp.hook_in')}",
            f"blocks.{layer}.{config.get('feature_output_hook', 'mlp.hook_out')}"]


def _read_clt(path: Path, config: dict[str, Any]) -> Loaded:
    S = len(list(path.glob("W_enc_*.safetensors")))
    enc = [read_safetensors(path / f"W_enc_{l}.safetensors") for l in range(S)]
    dec = [read_safetensors(path / f"W_dec_{l}.safetensors") for l in range(S)]
    if any(f"threshold_{l}" not in e for l, e in enumerate(enc)):
        raise FormatError(f"{path} is a ReLU cross-layer transcoder (no threshold_N); conceptdict reads JumpReLU ones "
                          f"(as clt-batchtopk)")
    P, D = enc[0]["W_enc_0"].shape
    model = SparseCoder(D, S * P, int(config.get("k") or 1), "clt-batchtopk", n_sources=S)  # k: what it was trained at
    blocks = {}  # the model holds its decoder as these blocks (saes/kinds/clt.py): no whole [L, S*D] is made
    for l in range(S):
        got = dec[l][f"W_dec_{l}"]
        if tuple(got.shape) != (P, S - l, D):
            raise FormatError(f"{path}/W_dec_{l}.safetensors: W_dec_{l} has shape {list(got.shape)}, expected "
                              f"{[P, S - l, D]}; the folder is inconsistent")
        blocks[block_name(l)] = got.float().reshape(P, -1)
    state = {"W_enc": torch.cat([e[f"W_enc_{l}"].float().T for l, e in enumerate(enc)], 1),
             "b_enc": torch.cat([e[f"b_enc_{l}"].float() for l, e in enumerate(enc)]), **blocks,
             "b_dec": torch.cat([e[f"b_dec_{l}"].float() for l, e in enumerate(enc)]),
             "threshold": torch.cat([e[f"threshold_{l}"].float().reshape(-1) for l, e in enumerate(enc)]),
             "norm_scale": model.norm_scale}
    with torch.no_grad():
        model.load_state_dict(state)
    hooks = [_hooks(config, l) for l in range(S)]
    hookpoints = [h[0] for h in hooks] + [h[1] for h in hooks]
    return Loaded(model.eval(), _config(path, model, hookpoints, config))


def _read_layer(file: Path, config: dict[str, Any]) -> Loaded:
    t = read_safetensors(file)
    layer = int(re.sub(r"\D", "", file.name))
    activation = config.get("activation") or ("topk" if "k" in t else None)
    if activation != "topk":
        raise FormatError(f"{file}: a {activation or 'JumpReLU'} per-layer transcoder; conceptdict reads circuit-tracer's "
                          f"TopK ones (activation: topk, k in config.yaml)")
    k = int(config.get("k") or int(t["k"]))
    P, D = t["W_enc"].shape
    kind = "skip-transcoder" if "W_skip" in t else "transcoder"
    model = SparseCoder(D, P, k, kind)
    state = {"W_enc": t["W_enc"].float().T, "b_enc": t["b_enc"].float(), "W_dec": t["W_dec"].float(),
             "b_dec": t["b_dec"].float(), "threshold": model.threshold, "norm_scale": model.norm_scale}
    if "W_skip" in t:
        state["W_skip"] = t["W_skip"].float().T
    with torch.no_grad():
        model.load_state_dict(state)
    return Loaded(model.eval(), _config(file, model, _hooks(config, layer), config))


def _config(path: Path, model: SparseCoder, hookpoints: list[str], config: dict[str, Any]) -> dict[str, Any]:
    out = foreign_config("circuit-tracer", path, model, hookpoint=None, mapped=None,
                         model_name=config.get("model_name"),
                         extra={"hookpoints": hookpoints, "n_sources": model.n_sources})
    if len(hookpoints) == 2:
        out["input_hookpoint"], out["output_hookpoint"] = hookpoints
    return out


# --------------------------------------------------------------------------- writing


def _layer_hooks(hookpoints: Sequence[str], where: str) -> tuple[list[int], str]:
    """(layers, the hook name after ``blocks.{layer}.``) of hookpoints like blocks.3.mlp.hook_in, all alike."""
    parsed = [_LAYER.match(h) for h in hookpoints]
    if not all(parsed) or len({m.group(2) for m in parsed}) != 1:
        raise ValueError(f"circuit-tracer names one hook per layer (blocks.LAYER.HOOK); {where} reads {list(hookpoints)}")
    return [int(m.group(1)) for m in parsed], parsed[0].group(2)


def _check_layers(layers: list[int], where: str) -> None:
    if layers != list(range(len(layers))):
        raise ValueError(f"circuit-tracer indexes layers 0..N-1; {where} covers layers {layers}: train on --layers all "
                         f"(or 0..N-1)")


def _write_yaml(out: Path, data: dict[str, Any]) -> None:
    import yaml

    (out / CONFIG).write_text(yaml.safe_dump(data, sort_keys=False))


def write_clt(model: SparseCoder, out: Path, hookpoints: Sequence[str], model_name: str | None) -> Path:
    """A ``clt-batchtopk`` (its S inputs then S outputs in ``hookpoints``) in circuit-tracer's CLT layout."""
    if model.kind != "clt-batchtopk":
        raise ValueError(f"circuit-tracer's cross-layer transcoders are JumpReLU (or ReLU); a {model.kind} has no such "
                         f"rule: train --kind clt-batchtopk (BatchTopK per layer, a JumpReLU threshold per layer)")
    S, D, P = model.n_sources, model.d_in, model.n_latents // model.n_sources
    layers, in_hook = _layer_hooks(hookpoints[:S], "its input")
    layers_out, out_hook = _layer_hooks(hookpoints[S:], "its output")
    _check_layers(layers, "this cross-layer transcoder")
    if layers_out != layers:
        raise ValueError(f"the CLT's outputs cover layers {layers_out}, its inputs {layers}; they must match")
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if not isinstance(model, SparseCoder):  # a CLT read lazily (saes.lazy_clt): written a range of latents at a time
        _write_clt_blocks(model, out)
        return _write_clt_yaml(model, out, in_hook, out_hook, model_name)
    W_enc, blocks = model.W_enc.detach().float(), decoder_blocks(model)
    for l in range(S):
        lat = slice(l * P, (l + 1) * P)
        save_file({f"W_enc_{l}": W_enc[:, lat].T.contiguous(), f"b_enc_{l}": model.b_enc.detach()[lat].float().clone(),
                   f"b_dec_{l}": model.b_dec.detach()[l * D:(l + 1) * D].float().clone(),
                   f"threshold_{l}": model.threshold.detach()[lat].float().clone()}, str(out / f"W_enc_{l}.safetensors"))
        save_file({f"W_dec_{l}": blocks[l].detach().float().reshape(P, S - l, D).contiguous()},
                  str(out / f"W_dec_{l}.safetensors"))
    return _write_clt_yaml(model, out, in_hook, out_hook, model_name)


def _write_clt_yaml(model: Any, out: Path, in_hook: str, out_hook: str, model_name: str | None) -> Path:
    _write_yaml(out, {"model_kind": "cross_layer_transcoder", "feature_input_hook": in_hook,
                      "feature_output_hook": out_hook, "k": model.k, **({"model_name": model_name} if model_name else {})})
    return out


def _write_clt_blocks(model: Any, out: Path) -> None:
    """:func:`write_clt`'s files of a ``saes.lazy_clt.LazyCLT``, each written at the offsets its header names
    (``saes.lazy_io.TensorsWriter``) a block at a time: the same tensors, one block of every layer in memory."""
    from contextlib import ExitStack

    from ..lazy_io import TensorsWriter

    S, D, P, f32 = model.n_sources, model.d_in, model.n_latents // model.n_sources, torch.float32
    with ExitStack() as stack:
        enc = [stack.enter_context(TensorsWriter(out / f"W_enc_{l}.safetensors", {
            f"W_enc_{l}": (f32, (P, D)), f"b_enc_{l}": (f32, (P,)), f"b_dec_{l}": (f32, (D,)),
            f"threshold_{l}": (f32, (P,))})) for l in range(S)]
        dec = [stack.enter_context(TensorsWriter(out / f"W_dec_{l}.safetensors", {f"W_dec_{l}": (f32, (P, S - l, D))}))
               for l in range(S)]
        b_dec = model.shared_tensor("b_dec")
        for l in range(S):
            enc[l].write(f"b_dec_{l}", b_dec[l * D:(l + 1) * D])
        for a, b in model.blocks:
            block, n = model.latents(a, b), b - a
            for l, w in enumerate(decoder_blocks(block)):
                lat = slice(l * n, (l + 1) * n)
                enc[l].write(f"W_enc_{l}", block.W_enc[:, lat].T, 0, a)
                enc[l].write(f"b_enc_{l}", block.b_enc[lat], 0, a)
                enc[l].write(f"threshold_{l}", block.threshold[lat], 0, a)
                dec[l].write(f"W_dec_{l}", w.reshape(n, S - l, D), 0, a)
            del block


def write_set(models: Sequence[SparseCoder], hookpoints: Sequence[Sequence[str]], out: Path,
              model_name: str | None) -> Path:
    """Per-layer transcoders (layer l's [input, output] hookpoints in ``hookpoints[l]``) as a circuit-tracer
    transcoder set: ``layer_{l}.safetensors`` each, TopK with their common k (in config.yaml)."""
    layers, in_hook = _layer_hooks([h[0] for h in hookpoints], "the set's inputs")
    _, out_hook = _layer_hooks([h[1] for h in hookpoints], "the set's outputs")
    _check_layers(layers, "this transcoder set")
    ks = {m.k for m in models}
    bad = [m.kind for m in models if m.kind not in ("transcoder", "skip-transcoder")]
    if bad or len(ks) != 1:
        raise ValueError(f"a circuit-tracer transcoder set is TopK transcoders of one k; got kinds {sorted({m.kind for m in models})}"
                         f" and k {sorted(ks)}")
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for l, m in enumerate(models):
        t = {"W_enc": m.W_enc.detach().float().T.contiguous(), "W_dec": m.W_dec.detach().float().contiguous(),
             "b_enc": m.b_enc.detach().float().clone(), "b_dec": m.b_dec.detach().float().clone()}
        # k lives in config.yaml only: circuit-tracer 0.5 (PyPI) refuses a "k" tensor in a layer file
        if m.spec.skip:
            t["W_skip"] = m.W_skip.detach().float().T.contiguous()
        save_file(t, str(out / f"layer_{l}.safetensors"))
    _write_yaml(out, {"model_kind": "transcoder_set", "feature_input_hook": in_hook, "feature_output_hook": out_hook,
                      "activation": "topk", "k": ks.pop(), **({"model_name": model_name} if model_name else {})})
    return out


def export(model: SparseCoder, out: Path, *, config: dict[str, Any], model_name: str | None,
           hookpoint: str | None) -> Path:
    """``conceptdict export --format circuit-tracer`` (``saes.formats.export.WRITERS``): a cross-layer transcoder
    (:func:`write_clt`) or one transcoder as a set of one layer (:func:`write_set`), over ``config``'s hookpoints."""
    hookpoints = config.get("hookpoints") or []
    if not isinstance(model, SparseCoder) and not model.spec.layered:  # read lazily: only a CLT is written in blocks
        model = model.whole()
    if model.spec.layered:
        return write_clt(model, out, hookpoints, model_name)
    if model.spec.transcodes:
        return write_set([model], [hookpoints], out, model_name)
    raise ValueError(f"circuit-tracer holds transcoders (per layer, or cross-layer); a {model.kind} is neither")
