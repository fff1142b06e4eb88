"""The dictionary kinds: one module each under this folder, listed in :data:`MODULES` (nothing registers itself on
import). A module defines ``KINDS``, a tuple of :class:`KindSpec` (a family's variants: batchtopk and
batchtopk-absolute), each with its name, settings dataclass, defaults, sources and hooks (saes/kinds/spec.py).

Adding a kind: its module, one line in :data:`MODULES`, its tests and its golden entry. Extensions and tests add
one at run time with :func:`register` (and take it out with :func:`unregister`). Other code asks the registry
(:func:`kind_spec`, :func:`reads_several_sources`, :func:`is_crosscoder`), never a list of kind names.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module

from .spec import SHARED_DEFAULTS, KindSpec, TrainOutput

MODULES: tuple[str, ...] = (
    "topk",
    "batchtopk",
    "relu",
    "jumprelu",
    "matryoshka",
    "spade",
    "crosscoder",
    "transcoder",
    "clt",
    "gated",
)
"""The modules of the built-in kinds, in the order ``--help`` and the flat settings list them."""

KINDS: dict[str, KindSpec] = {}
"""kind name -> KindSpec: the built-in kinds, then any :func:`register` added."""

THRESHOLD_FIELDS = ("threshold_start_step", "threshold_momentum")
"""The settings a kind that estimates one threshold while training must have (``KindSpec.estimates_threshold``)."""


def register(spec: KindSpec) -> KindSpec:
    """Add ``spec`` to :data:`KINDS` under ``spec.name``; raises ValueError when the name is taken or the
    declaration is inconsistent (what is missing is named)."""
    if not spec.name:
        raise ValueError("a kind needs a name: KindSpec(..., name='my-kind')")
    if spec.name in KINDS:
        raise ValueError(f"kind {spec.name!r} is already registered")
    if spec.sources not in ("one", "several", "pair"):
        raise ValueError(f"kind {spec.name!r}: sources={spec.sources!r} must be 'one', 'several' or 'pair'")
    if spec.layered and (spec.sources != "pair" or spec.skip):
        raise ValueError(f"kind {spec.name!r} is layered: it needs sources='pair' (the layers' inputs then outputs) "
                         f"and no skip path")
    if spec.calibrated and spec.scores is None:
        raise ValueError(f"kind {spec.name!r} calibrates a threshold but has no scores to calibrate it on")
    unknown = sorted(set(spec.defaults) - set(SHARED_DEFAULTS))
    if unknown:
        raise ValueError(f"kind {spec.name!r}: defaults {unknown} are not shared fields ({sorted(SHARED_DEFAULTS)})")
    if spec.settings is not None and not dataclasses.is_dataclass(spec.settings):
        raise ValueError(f"kind {spec.name!r}: settings must be a dataclass, got {spec.settings!r}")
    names = {f.name for f in dataclasses.fields(spec.settings)} if spec.settings is not None else set()
    if spec.estimates_threshold and not set(THRESHOLD_FIELDS) <= names:
        raise ValueError(f"kind {spec.name!r} estimates a threshold: its settings need {list(THRESHOLD_FIELDS)} "
                         f"(saes.kinds.batchtopk.ThresholdSettings)")
    KINDS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a kind :func:`register` added (a built-in kind stays)."""
    if name in BUILT_IN:
        raise ValueError(f"kind {name!r} is built in; only kinds added with register() can be removed")
    KINDS.pop(name, None)


BUILT_IN: dict[str, KindSpec] = {spec.name: spec for module in MODULES
                                 for spec in import_module(f"{__name__}.{module}").KINDS}
for _spec in BUILT_IN.values():
    register(_spec)
del _spec


def kind_spec(kind: str) -> KindSpec:
    """The spec of ``kind``; the error lists the valid kinds."""
    if kind not in KINDS:
        raise ValueError(f"unknown dictionary kind {kind!r}; choose one of {sorted(KINDS)}")
    return KINDS[kind]


def trainable_kinds() -> list[str]:
    """The names of the kinds that train, sorted."""
    return sorted(name for name, spec in KINDS.items() if spec.trainable)


def kinds_help() -> str:
    """``TrainConfig.kind``'s help: the registered kinds in the registry's order, a kind's variants after it
    (``batchtopk(-absolute)``: batchtopk and batchtopk-absolute), and apart the ones that are only read."""
    families: dict[str, list[str]] = {}
    for name in (n for n, spec in KINDS.items() if spec.trainable):
        base = next((b for b in families if name.startswith(f"{b}-")), None)
        families.setdefault(base or name, []).extend([name[len(base):]] if base else [])
    listed = ", ".join(b + (f"({', '.join(v)})" if v else "") for b, v in families.items())
    read_only = [name for name, spec in KINDS.items() if not spec.trainable]
    return (f"Dictionary kind (which to use: docs/guide/train.md): {listed}"
            + (f"; read only: {', '.join(read_only)}" if read_only else "") + ".")


def reads_several_sources(kind: str) -> bool:
    """Whether one dictionary of ``kind`` reads every source (hookpoint) of the data at once: crosscoders
    ("several") and transcoders ("pair"); other kinds train a dictionary per hookpoint."""
    return kind_spec(kind).sources != "one"


def check_shards(kind: str, latents: int, k: int, shards: int, layers: int = 1) -> None:
    """ValueError unless a ``kind`` dictionary of ``latents`` latents, ``k`` per row, trains over ``shards`` latent
    shards (``TrainConfig.latent_shards``): a shardable kind, whole shards of more than k latents; a layered kind
    (``layers`` > 1: a CLT, whose shards split each layer's latents) of more than k latents per layer."""
    if shards > 1 and not kind_spec(kind).shardable:
        can = ", ".join(sorted(name for name, spec in KINDS.items() if spec.shardable))
        raise ValueError(f"kind {kind!r} cannot be trained with latent_shards={shards}; the kinds that can: {can} "
                         f"(or latent_shards 1)")
    if shards < 1 or latents % shards or k >= latents // shards:
        raise ValueError(f"latent_shards={shards} must be at least 1 and divide latents={latents} into shards of "
                         f"more than k={k} latents; pick latents a multiple of it above {shards * k}")
    if shards > 1 and layers > 1 and (latents % (layers * shards) or k >= latents // (layers * shards)):
        raise ValueError(f"latent_shards={shards} must divide the {latents / layers:g} latents per layer of this "
                         f"{layers}-layer {kind} into shards of more than k={k} latents each; pick latents a "
                         f"multiple of {layers * shards} above {layers * shards * k}")


def is_crosscoder(kind: str) -> bool:
    """Whether ``kind`` is a crosscoder: one code over several sources."""
    return kind_spec(kind).sources == "several"


__all__ = ["BUILT_IN", "KINDS", "MODULES", "SHARED_DEFAULTS", "KindSpec", "TrainOutput", "check_shards",
           "is_crosscoder",
           "kind_spec", "kinds_help", "reads_several_sources", "register", "trainable_kinds", "unregister"]
