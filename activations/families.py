"""Model families: what a loaded model offers (:class:`Model`), what a family of models offers (:class:`ModelFamily`:
how to recognise one of its models and how to load and cache it) and the registry :data:`FAMILIES` that
:func:`load_model` dispatches through.

A family lives in its own module: a handle class that follows :class:`Model` and a family object that follows
:class:`ModelFamily` (``models.FAMILY``: text models through the TransformerLens bridge, causal LMs and sentence
encoders alike; ``vision.FAMILY``: CLIP-like image models). Adding one is that module, one line in
:data:`FAMILIES` and its tests; the stages ask the handle (``model.level(hp)``, ``model.hookpoint_rows()``,
``model.capture(...)``, ``model.embed_texts(...)``) or the family (``family_of(name).cache(...)``), never a class.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, overload, runtime_checkable

from torch import Tensor

from conceptdict.activations import models, vision
from conceptdict.activations.listing import HookpointInfo
from conceptdict.activations.wrapper import Cached, Spliced, Tokens


@runtime_checkable
class Model(Protocol):
    """A loaded model of any family: what the stages and a user's code may ask of it."""

    name: str
    """The name or directory it was loaded from."""
    family: str
    """Its family's key in :data:`FAMILIES`."""
    device: str
    dtype: str
    load_info: dict
    """How it was loaded (a store's manifest records it as ``model``)."""
    hookpoints: list[str]
    """Every name activations can be read at."""
    tokenizer: Any
    """Its Hugging Face tokenizer, or None."""

    def d_model(self, hookpoint: str) -> int:
        """The width of one row at ``hookpoint``."""

    def level(self, hookpoint: str) -> str:
        """``"sequence"`` for a hookpoint with one row per input (a pooled embedding), else ``"token"``."""

    def special_ids(self) -> list[int]:
        """Token ids a store never holds rows of ([] for a family without a vocabulary)."""

    def decode(self, ids: Sequence[int]) -> list[str]:
        """One string per token id."""

    def unembed(self) -> Tensor | None:
        """W_U [D, V] for the logit lens, or None."""

    def hookpoint_rows(self) -> list[HookpointInfo]:
        """Every hookpoint with the shape of one input's activation (``cd.hookpoints``)."""

    def run_with_cache(self, inputs: Any, names: str | Sequence[str] | None = None) -> Cached:
        """``Cached(output, {hookpoint: activations [batch, seq, d] or [batch, d]})`` of one forward."""

    @overload
    def to_tokens(self, texts: str | Sequence[str], return_mask: Literal[False] = False,
                  max_length: int | None = None) -> Tensor: ...

    @overload
    def to_tokens(self, texts: str | Sequence[str], return_mask: Literal[True],
                  max_length: int | None = None) -> Tokens: ...

    def to_tokens(self, texts: str | Sequence[str], return_mask: bool = False,
                  max_length: int | None = None) -> Tensor | Tokens:
        """Token ids [batch, seq] of texts (``Tokens(ids, mask)`` with ``return_mask``); a family without a
        tokenizer says so."""

    def to_string(self, ids: Tensor | Sequence[int]) -> str | list[str]:
        """The text of token ids ([seq]: a string; [batch, seq]: one per row)."""

    @overload
    def run_with_saes(self, inputs: Any, saes: Any, return_codes: Literal[False] = False) -> Tensor: ...

    @overload
    def run_with_saes(self, inputs: Any, saes: Any, return_codes: Literal[True]) -> Spliced: ...

    def run_with_saes(self, inputs: Any, saes: Any, return_codes: bool = False) -> Tensor | Spliced:
        """The output with dictionaries spliced in (``Spliced(output, codes)`` with ``return_codes``); a family
        whose forward cannot be spliced says what to do instead."""

    def embed_images(self, images: Any, hookpoint: str | None = None, batch_size: int = 64) -> Tensor:
        """[N, D] float32: one row per image at ``hookpoint``; a family without images says so."""

    def embed_texts(self, texts: Sequence[str], hookpoint: str | None = None, batch_size: int = 64) -> Tensor:
        """[N, D] float32: one row per text at ``hookpoint``."""


class ModelFamily(Protocol):
    """A family of models: how to recognise, load and cache one."""

    name: str
    """Its key in :data:`FAMILIES`."""
    modality: str
    """What its models read: ``"text"`` or ``"image"`` (which namer embeds a vocabulary for its dictionaries)."""
    pooled_hookpoints: tuple[str, ...]
    """Hookpoints with one row per input (store level ``"sequence"``); every other one has a row per token."""

    def recognises(self, name_or_dir: str) -> bool:
        """Whether ``name_or_dir`` (a hub name or local directory) is one of this family's models."""

    def load(self, name_or_dir: str, device: str, dtype: str, tokenizer: str | None = None) -> Model:
        """The loaded model (``device`` and ``dtype`` already checked)."""

    def cache(self, cfg: Any, records: Any, part: tuple[int, int]) -> Path:
        """Cache ``cfg.hookpoints`` of ``cfg.model`` over its dataset into the store ``cfg.out`` (the caller holds
        the store's writer lock): ``activations.cache.cache_activations``' work for this family."""


FAMILIES: dict[str, ModelFamily] = {
    "image": vision.FAMILY,
    "text": models.FAMILY,
}
"""Every model family, by name. :func:`family_of` asks them in this order; :data:`DEFAULT_FAMILY` last."""

DEFAULT_FAMILY = "text"
"""The family of a model no other family recognises (any model the TransformerLens bridge loads)."""


def family_of(name_or_dir: str | Path | None) -> ModelFamily:
    """The family whose ``recognises`` claims ``name_or_dir`` first; :data:`DEFAULT_FAMILY` when none does."""
    name = str(name_or_dir or "")
    for key, family in FAMILIES.items():
        if key != DEFAULT_FAMILY and name and family.recognises(name):
            return family
    return FAMILIES[DEFAULT_FAMILY]


def hookpoint_level(hookpoint: str) -> str:
    """``"sequence"`` when a family pools ``hookpoint`` (one row per input), else ``"token"`` (decided by the name,
    before any model is loaded)."""
    pooled = any(hookpoint in family.pooled_hookpoints for family in FAMILIES.values())
    return "sequence" if pooled else "token"


def load_model(name_or_dir: str = models.DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
               tokenizer: str | None = None) -> Model:
    """Load a hub name or local directory through its family (:func:`family_of`); ``"default"`` is the bundled
    all-MiniLM-L6-v2. ``tokenizer``: a tokenizer directory or hub name for a text model saved without one."""
    from conceptdict.activations.data import check_local_path

    name_or_dir = str(name_or_dir)
    check_local_path(name_or_dir, "--model")
    if dtype not in models.DTYPES:
        raise ValueError(f"dtype must be one of {sorted(models.DTYPES)}, got {dtype!r}")
    models.check_device(device)
    return family_of(name_or_dir).load(name_or_dir, device=device, dtype=dtype, tokenizer=tokenizer)
