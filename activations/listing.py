"""Every hookpoint of a model with its activation shape, from one small probe forward (``conceptdict hookpoints``).

Each family's handle lists its own (``handle.hookpoint_rows()``). Text models (``models.ModelHandle``): every
name of the bridge's ``hook_dict`` (aliases included) plus the sentence hookpoints, measured on one context of
:data:`PROBE_TOKENS` tokens; image models (``vision.ImageModelHandle``): the pooled, block and text hookpoints,
measured on one blank image (and one text). The shape is one row's,
without the batch axis: ``T`` stands for the token axis. ``d`` is the width a store row gets (the trailing axes
flattened) where the hookpoint can be cached, else None and ``note`` says why.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

PROBE_TOKENS = 7


class HookpointInfo(NamedTuple):
    """One hookpoint: its name, the shape of one input's activation, the width of a stored row and its level."""

    name: str
    shape: str
    d: int | None
    rows: str
    note: str = ""


@dataclass(frozen=True)
class HookpointTable:
    """Every hookpoint of ``model`` (:class:`HookpointInfo` rows, in the model's order)."""

    model: str
    hookpoints: list[HookpointInfo]

    def __iter__(self) -> Iterator[HookpointInfo]:
        return iter(self.hookpoints)

    def __len__(self) -> int:
        return len(self.hookpoints)

    def names(self) -> list[str]:
        return [h.name for h in self.hookpoints]

    def get(self, name: str) -> HookpointInfo:
        """The row of ``name``; KeyError naming the closest hookpoints when there is none."""
        for h in self.hookpoints:
            if h.name == name:
                return h
        close = difflib.get_close_matches(name, self.names(), n=5, cutoff=0.4)
        raise KeyError(f"model {self.model} has no hookpoint {name!r}; closest: {', '.join(close) or 'none'}")

    def format(self) -> str:
        """A fixed-width table: hookpoint, shape, d, rows, note."""
        width = max([len("hookpoint")] + [len(h.name) for h in self.hookpoints])
        shape_w = max([len("shape")] + [len(h.shape) for h in self.hookpoints])
        lines = [f"{len(self.hookpoints)} hookpoints of {self.model} (shape of one input; T: its tokens)",
                 f"{'hookpoint':<{width}}  {'shape':<{shape_w}}  {'d':>6}  {'rows':<11}  note"]
        for h in self.hookpoints:
            d = "-" if h.d is None else str(h.d)
            lines.append(f"{h.name:<{width}}  {h.shape:<{shape_w}}  {d:>6}  {h.rows:<11}  {h.note}".rstrip())
        return "\n".join(lines)


def _shape(shape: tuple[int, ...], tokens: int, per_token: bool) -> str:
    """``[T, 2, 16]``: the token axis named (a per-token activation's first; any axis of the probe's length else)."""
    return "[" + ", ".join("T" if n == tokens and (i == 0 or not per_token) else str(n)
                           for i, n in enumerate(shape)) + "]"


def list_hookpoints(handle) -> HookpointTable:
    """Every hookpoint of a loaded model of any family with its shape (``handle.hookpoint_rows()``)."""
    from conceptdict.activations.models import model_label

    return HookpointTable(model_label(handle.name), handle.hookpoint_rows())


def text_rows(handle) -> list[HookpointInfo]:
    """The rows of a text model (``models.ModelHandle``): the bridge's hooks, then the sentence hookpoints."""
    from conceptdict.activations.models import SENTENCE_HOOKPOINTS

    bridge = handle.bridge
    vocab = int(getattr(bridge.cfg, "d_vocab", 0) or 0) or PROBE_TOKENS + 1
    ids = (torch.arange(1, PROBE_TOKENS + 1) % vocab).unsqueeze(0).to(handle.device)
    seen: dict[str, torch.Tensor] = {}
    refused: dict[str, str] = {}

    def record(name: str):
        def hook(tensor, hook):
            seen[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

        return hook

    with contextlib.ExitStack() as stack:
        for name in bridge.hook_dict:
            try:
                stack.enter_context(bridge.hooks(fwd_hooks=[(name, record(name))]))
            except ValueError as e:  # hooks the bridge keeps switched off (use_attn_result, ...)
                refused[name] = str(e).split(" because ")[-1].split(".")[0]
        with torch.inference_mode():
            bridge(ids, attention_mask=torch.ones_like(ids))
    out = []
    for name in bridge.hook_dict:
        if name in refused:
            out.append(HookpointInfo(name, "?", None, "-", f"off in this model ({refused[name]}): cannot be cached"))
            continue
        if name not in seen:
            out.append(HookpointInfo(name, "?", None, "-", "does not fire in a forward: cannot be cached"))
            continue
        t = seen[name]
        shape = tuple(t.shape[1:])
        per_token = len(shape) >= 1 and shape[0] == PROBE_TOKENS
        if per_token and t.dtype.is_floating_point:
            out.append(HookpointInfo(name, _shape(shape, PROBE_TOKENS, True), math.prod(shape[1:]), "token"))
        else:
            why = "token ids" if per_token else "not one row per token"
            out.append(HookpointInfo(name, _shape(shape, PROBE_TOKENS, per_token), None, "-",
                                     f"{why}: cannot be cached"))
    d_model = int(bridge.cfg.d_model)
    for name in SENTENCE_HOOKPOINTS:
        out.append(HookpointInfo(name, f"[{d_model}]", d_model, "sequence",
                                 f"mean over tokens of {handle.sentence_source}"))
    return out


def image_rows(handle) -> list[HookpointInfo]:
    """The rows of an image model (``vision.ImageModelHandle``): pooled, block and text hookpoints."""
    from PIL import Image

    from conceptdict.activations.vision import POOLED_HOOKPOINTS, TEXT_HOOKPOINTS, capture_images, preprocess

    images = [h for h in handle.hookpoints if h not in TEXT_HOOKPOINTS]
    got = capture_images(handle, preprocess(handle, [Image.new("RGB", (32, 32))]), images)
    out = []
    for name in images:
        shape = tuple(got[name].shape[1:])
        if name in POOLED_HOOKPOINTS:
            out.append(HookpointInfo(name, f"[{shape[0]}]", shape[0], "image"))
            continue
        tokens = shape[0]
        patches = tokens - handle.prefix_tokens - handle.registers
        kept = f"CLS + {patches} patches" if handle.prefix_tokens else f"{patches} patches"
        extra = f", {handle.registers} registers not stored" if handle.registers else ""
        out.append(HookpointInfo(name, f"[{tokens}, {shape[1]}]", shape[1], "image token",
                                 f"stored per image: {kept}{extra}"))
    for name in (h for h in handle.hookpoints if h in TEXT_HOOKPOINTS):
        d = handle.d_model(name)
        out.append(HookpointInfo(name, f"[{d}]", d, "text", "embeds texts (vocabulary namer); not cached over images"))
    return out


MLP_IN, MLP_OUT = "blocks.{}.mlp.hook_in", "blocks.{}.mlp.hook_out"
"""A layer's MLP input and output hookpoints (what a transcoder of that MLP reads and predicts)."""


def mlp_layers(layers: list[str] | str, available: list[str], where: str) -> list[tuple[int, str, str]]:
    """[(layer, MLP input hookpoint, MLP output hookpoint)] of ``layers`` ("all", or layer numbers) among the
    ``available`` hookpoints (a store's, or a model's); ``where`` names them in the error."""
    names = set(available)
    have = sorted(int(h.split(".")[1]) for h in names if h.startswith("blocks.") and h.endswith(".mlp.hook_in")
                  and h.split(".")[1].isdigit() and MLP_OUT.format(h.split(".")[1]) in names)
    wanted = [layers] if isinstance(layers, str) else [str(x) for x in layers]
    if wanted == ["all"]:
        if not have:
            raise ValueError(f"{where} holds no MLP input/output pair ({MLP_IN.format('N')}, {MLP_OUT.format('N')}): "
                             f"cache both of each layer for --layers")
        return [(l, MLP_IN.format(l), MLP_OUT.format(l)) for l in have]
    bad = [x for x in wanted if not x.isdigit()]
    if bad:
        raise ValueError(f"--layers {' '.join(wanted)}: give 'all' or layer numbers (e.g. --layers 0 --layers 3)")
    missing = [int(x) for x in wanted if int(x) not in have]
    if missing:
        raise ValueError(f"--layers: {where} lacks the MLP input/output of layer(s) {missing} (it has layers "
                         f"{have}); cache {MLP_IN.format(missing[0])} and {MLP_OUT.format(missing[0])}")
    return [(int(x), MLP_IN.format(x), MLP_OUT.format(x)) for x in dict.fromkeys(wanted)]
