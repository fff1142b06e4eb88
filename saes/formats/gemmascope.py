"""Gemma Scope ``params.npz``: a JumpReLU SAE (``W_enc [D, L]``, ``b_enc``, ``W_dec [L, D]``, ``b_dec``,
``threshold``) that encodes ``x`` without subtracting ``b_dec``: ``f = relu(x W_enc + b_enc) * (pre > threshold)``.
That is folded into ``b_enc`` exactly (``b_enc + b_dec W_enc``). The hookpoint comes from the path
(``gemma-scope-2b-pt-res/layer_12/width_16k/average_l0_82`` -> ``blocks.12.hook_out``), when it has one.
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import Loaded, build, foreign_config
from .files import FormatError, read_npz
from .hookpoints import from_gemma_scope

WEIGHTS = "params.npz"
NEEDS = f"{WEIGHTS} with W_enc, b_enc, W_dec, b_dec, threshold"


def matches(directory: Path) -> bool:
    return (directory / WEIGHTS).exists()


def _model_name(parts: tuple[str, ...]) -> str | None:
    """``gemma-scope-2b-pt-res`` -> ``google/gemma-2-2b``; ``-it-`` repos name the instruction-tuned model."""
    for p in parts:
        m = re.search(r"gemma-scope-(\d+b)-(pt|it)", p)
        if m:
            return f"google/gemma-2-{m.group(1)}" + ("-it" if m.group(2) == "it" else "")
    return None


def read(directory: Path) -> Loaded:
    path = directory / WEIGHTS
    t = read_npz(path)
    need = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
    missing = [n for n in need if n not in t]
    if missing:
        raise FormatError(f"{path} lacks {missing} (it holds {sorted(t)}); a Gemma Scope params.npz has {list(need)}")
    D, L = t["W_enc"].shape
    for name, shape in {"b_enc": (L,), "W_dec": (L, D), "b_dec": (D,), "threshold": (L,)}.items():
        if tuple(t[name].shape) != shape:
            raise FormatError(f"{path}: {name} has shape {list(t[name].shape)} but W_enc {[D, L]} implies "
                              f"{list(shape)}; the arrays do not belong together")
    tensors = {n: t[n].float() for n in need}
    tensors["b_enc"] = tensors["b_enc"] + tensors["b_dec"] @ tensors["W_enc"]
    model = build("jumprelu", int(D), int(L), None, tensors)
    parts = directory.resolve().parts
    hook = from_gemma_scope(parts)
    return Loaded(model, foreign_config("gemma-scope", directory, model, hookpoint="/".join(parts[-4:]),
                                        mapped=hook, model_name=_model_name(parts)))
