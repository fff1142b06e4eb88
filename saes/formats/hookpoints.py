"""Hookpoint names of other libraries -> this project's names (transformer-lens 4 ``TransformerBridge``).

conceptdict captures activations at bridge hook names (``blocks.3.hook_out``, ``blocks.3.mlp.hook_out``, ...);
the bridge also answers to the legacy TransformerLens aliases (``blocks.3.hook_resid_post``), so a store may
hold either spelling. SAELens uses TransformerLens names, sparsify uses the HF module path (``layers.3``,
``gpt_neox.layers.3.mlp``), dictionary_learning a submodule name (``resid_post_layer_3``) and Gemma Scope a
directory (``gemma-scope-2b-pt-res/layer_3/...``). :func:`to_project` maps each to the bridge name, and
:func:`match_hookpoint` finds a name's equivalent among the hookpoints a store holds.
"""

from __future__ import annotations

import re

# legacy TransformerLens suffix -> bridge suffix (same tensor)
_TL_TO_BRIDGE = {
    "hook_resid_pre": "hook_in",
    "hook_resid_post": "hook_out",
    "hook_mlp_out": "mlp.hook_out",
    "hook_attn_out": "attn.hook_out",
    "hook_resid_mid": "ln2.hook_in",
    "mlp.hook_post": "mlp.out.hook_in",
}
# sparsify / HF module suffix after ``layers.N`` -> bridge suffix (a module's output)
_MODULE_TO_BRIDGE = {"": "hook_out", "mlp": "mlp.hook_out", "self_attn": "attn.hook_out", "attn": "attn.hook_out",
                     "attention": "attn.hook_out"}
# dictionary_learning submodule prefix -> bridge suffix
_DL_TO_BRIDGE = {"resid_post": "hook_out", "resid_pre": "hook_in", "mlp_out": "mlp.hook_out",
                 "attn_out": "attn.hook_out"}
# Gemma Scope repo suffix -> bridge suffix
_GEMMA_SCOPE = {"res": "hook_out", "mlp": "mlp.hook_out", "att": "attn.hook_z"}


def from_transformer_lens(name: str) -> str:
    """``blocks.3.hook_resid_post`` -> ``blocks.3.hook_out``; names without an alias are returned unchanged."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m and m.group(2) in _TL_TO_BRIDGE:
        return f"blocks.{m.group(1)}.{_TL_TO_BRIDGE[m.group(2)]}"
    return name


def from_module_path(name: str) -> str:
    """A sparsify hookpoint (HF module path) ``[model.|gpt_neox.|transformer.]layers|h.N[.mlp]`` -> bridge name."""
    m = re.fullmatch(r"(?:[\w]+\.)*?(?:layers|h|layer|blocks)\.(\d+)(?:\.(\w+))?", name)
    if m and (m.group(2) or "") in _MODULE_TO_BRIDGE:
        return f"blocks.{m.group(1)}.{_MODULE_TO_BRIDGE[m.group(2) or '']}"
    return from_transformer_lens(name)


def from_dictionary_learning(submodule: str | None, layer: int | None) -> str | None:
    """``resid_post_layer_3`` (or a module path, or just ``layer``) -> bridge name; None when unknown."""
    if submodule:
        m = re.fullmatch(r"(resid_post|resid_pre|mlp_out|attn_out)_layer_(\d+)", submodule)
        if m:
            return f"blocks.{m.group(2)}.{_DL_TO_BRIDGE[m.group(1)]}"
        mapped = from_module_path(submodule)
        if mapped != submodule:
            return mapped
    return f"blocks.{layer}.hook_out" if layer is not None else None


def from_gemma_scope(parts: tuple[str, ...]) -> str | None:
    """Path components like ``gemma-scope-2b-pt-res``, ``layer_12`` -> ``blocks.12.hook_out``; None if unknown."""
    layer = next((m.group(1) for p in parts if (m := re.fullmatch(r"layer_(\d+)", p))), None)
    site = next((m.group(1) for p in parts if (m := re.search(r"gemma-scope.*-(res|mlp|att)(?:-|$)", p))), None)
    if layer is None or site is None:
        return None
    return f"blocks.{layer}.{_GEMMA_SCOPE[site]}"


def equivalents(name: str) -> list[str]:
    """``name`` and every other spelling of the same tensor (bridge name and TransformerLens alias)."""
    bridge = from_transformer_lens(name)
    out = [name, bridge]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", bridge)
    if m:
        out += [f"blocks.{m.group(1)}.{tl}" for tl, br in _TL_TO_BRIDGE.items() if br == m.group(2)]
    return list(dict.fromkeys(out))


def match_hookpoint(name: str, available: list[str]) -> str | None:
    """The hookpoint of ``available`` that holds the same tensor as ``name`` (``name`` itself first), else None."""
    return next((n for n in equivalents(name) if n in available), None)


def to_transformer_lens(name: str) -> str:
    """``blocks.3.hook_out`` -> ``blocks.3.hook_resid_post`` (the spelling SAELens and Neuronpedia use)."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    back = {br: tl for tl, br in _TL_TO_BRIDGE.items()}
    if m and m.group(2) in back:
        return f"blocks.{m.group(1)}.{back[m.group(2)]}"
    return name
