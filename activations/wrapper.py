"""The model wrapper of a text model: tokens in and out, a forward with its activations cached, a forward with
dictionaries spliced in (what ``cd.load_model(...)`` returns offers, next to what the stages use).

    model = cd.load_model("default")
    ids = model.to_tokens(["a cat", "the dog sat"])            # [2, T], right-padded
    logits, cache = model.run_with_cache("a cat", names=["blocks.3.hook_out", "sentence.mean"])
    cache["blocks.3.hook_out"]                                   # [1, T, 384]; cache["sentence.mean"]: [1, 384]
    logits, codes = model.run_with_saes("a cat", saes=[sae], return_codes=True)
    codes["blocks.3.hook_out"]                                   # [1, T, L]: the dictionary's codes per token

Inputs are a text, a list of texts (tokenised as the cache tokenises a document: the tokenizer's special tokens,
a BOS for a causal LM that has one), token ids ``[batch, seq]`` or ``[seq]`` with an optional attention mask, a
:class:`Tokens` or a Hugging Face encoding (``input_ids`` / ``attention_mask``). Activations are the ones a store
holds: a token hookpoint's ``[batch, seq, d]`` with the axes after seq flattened, a sentence hookpoint's pooled
``[batch, d]``. Forwards here run without gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor


class Tokens(NamedTuple):
    """Token ids [batch, seq] right-padded with the model's pad id, and the attention mask (1: a real token)."""

    ids: Tensor
    mask: Tensor


class Cached(NamedTuple):
    """What ``run_with_cache`` returns; unpacks as ``output, cache = model.run_with_cache(...)``."""

    output: Tensor
    """The model's output: a text model's logits [batch, seq, V], an image model's ``image.embed`` [batch, D]."""
    cache: dict[str, Tensor]
    """{hookpoint: activations [batch, seq, d] (token hookpoints) or [batch, d] (pooled ones)}."""


class Spliced(NamedTuple):
    """What ``run_with_saes(..., return_codes=True)`` returns; unpacks as ``logits, codes = ...``."""

    output: Tensor
    """The logits [batch, seq, V] of the spliced forward."""
    codes: dict[str, Tensor]
    """{hookpoint: the codes [batch, seq, L] of the dictionary spliced in there}."""


class TextWrapper:
    """What a text model's handle offers a user's code (mixed into ``models.ModelHandle``)."""

    @overload
    def to_tokens(self, texts: str | Sequence[str], return_mask: Literal[False] = False,
                  max_length: int | None = None) -> Tensor: ...

    @overload
    def to_tokens(self, texts: str | Sequence[str], return_mask: Literal[True],
                  max_length: int | None = None) -> Tokens: ...

    def to_tokens(self, texts: str | Sequence[str], return_mask: bool = False,
                  max_length: int | None = None) -> Tensor | Tokens:
        """Token ids [batch, seq] of a text or a list of texts, each wrapped in the special tokens the cache puts
        around a document and right-padded; ``return_mask=True``: ``Tokens(ids, mask)``, which every method here
        also takes. ``max_length`` cuts each text's own tokens (specials not counted); default: no cut."""
        return to_tokens(self, texts, return_mask, max_length)

    def to_string(self, ids: Tensor | Sequence[int]) -> str | list[str]:
        """The text of token ids: a string for [seq], a list of strings for [batch, seq] (pads decoded too)."""
        t = torch.as_tensor(ids)
        if t.dim() == 2:
            return [self.to_string(row) for row in t]
        if t.dim() > 2 or t.is_floating_point():
            raise ValueError(f"to_string takes token ids [seq] or [batch, seq], got {t.dtype} {list(t.shape)}")
        ids = [int(i) for i in t.reshape(-1)]
        tok = self.tokenizer
        return tok.decode(ids) if tok is not None else " ".join(f"<{i}>" for i in ids)

    def run_with_cache(self, inputs: Any, names: str | Sequence[str] | None = None,
                       mask: Tensor | None = None) -> Cached:
        """``Cached(logits [batch, seq, V], cache)`` of one whole forward; ``cache[hp]`` is [batch, seq, d] at a token
        hookpoint, [batch, d] at a sentence one. ``names``: the hookpoints to keep (one name or a list); None:
        every one a store can hold (found once with a probe forward; on a large model pass the ones you need,
        each costs batch x seq x d floats). Under ``cd.splice`` the spliced forward's."""
        from conceptdict.activations.models import record

        tokens = token_inputs(self, inputs, mask)
        names = self.cacheable_hookpoints() if names is None else [names] if isinstance(names, str) else list(names)
        with torch.no_grad():
            return Cached(*record(self, tokens.ids, tokens.mask, names))

    @overload
    def run_with_saes(self, inputs: Any, saes: Any, return_codes: Literal[False] = False,
                      mask: Tensor | None = None) -> Tensor: ...

    @overload
    def run_with_saes(self, inputs: Any, saes: Any, return_codes: Literal[True],
                      mask: Tensor | None = None) -> Spliced: ...

    def run_with_saes(self, inputs: Any, saes: Any, return_codes: bool = False,
                      mask: Tensor | None = None) -> Tensor | Spliced:
        """The logits with every dictionary spliced in at its hookpoint, its reconstruction replacing the activation:
        ``saes`` is a dictionary, a list of them (each at its own ``config["hookpoints"][0]``) or ``{hookpoint:
        dictionary}``. ``return_codes=True``: (logits, {hookpoint: codes [batch, seq, L]}), each dictionary's
        codes of the activation it read. ``cd.splice`` is the same splice as a context manager."""
        from conceptdict.activations.intervene import by_hookpoint, dictionary_edits, spliced

        tokens = token_inputs(self, inputs, mask)
        codes: dict[str, Tensor] | None = {} if return_codes else None
        with torch.no_grad(), spliced(self, dictionary_edits(by_hookpoint(saes), codes=codes)):
            logits = self(tokens)
        if codes is None:
            return logits
        batch, seq = tokens.ids.shape
        return Spliced(logits, {hp: c.reshape(batch, seq, -1) for hp, c in codes.items()})

    def embed_images(self, images: Any, hookpoint: str | None = None, batch_size: int = 64) -> Tensor:
        """A text model has no images: ValueError naming what to use."""
        raise ValueError(f"{self.name} is a text model: embed_images needs an image model (CLIP, SigLIP, ViT); "
                         f"new texts are model.embed_texts(texts, hookpoint=...)")

    def __call__(self, inputs: Any, mask: Tensor | None = None) -> Tensor:
        """The logits [batch, seq, V] of a text, texts or token ids (under ``cd.splice``: of the spliced forward)."""
        return self.run_with_cache(inputs, names=[], mask=mask)[0]

    def cacheable_hookpoints(self) -> list[str]:
        """Every hookpoint a store can hold (``cd.hookpoints(model)`` rows with a width), found once."""
        if self._cacheable is None:
            self._cacheable = [row.name for row in self.hookpoint_rows() if row.d is not None]
        return list(self._cacheable)


def to_tokens(model, texts: str | Sequence[str], return_mask: bool = False,
              max_length: int | None = None) -> Tensor | Tokens:
    """:meth:`TextWrapper.to_tokens` of ``model``."""
    from conceptdict.activations.data import special_wrapping
    from conceptdict.activations.models import model_label
    from conceptdict.activations.tokens import pad_sequences

    if model.tokenizer is None:
        raise ValueError(f"model {model_label(model.name)} has no tokenizer, so texts cannot be tokenised; load it "
                         "with tokenizer=DIR_OR_HUB_NAME (--tokenizer), or pass token ids")
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"to_tokens takes a text or a non-empty list of texts, got {texts!r:.80}")
    prefix, suffix, _ = special_wrapping(model.tokenizer, prepend_bos=model.is_causal)
    seqs = [prefix + model.tokenizer(t, add_special_tokens=False)["input_ids"][:max_length] + suffix for t in texts]
    if any(len(s) == 0 for s in seqs):
        raise ValueError("an empty text gives no tokens (this tokenizer adds no special ones); pass non-empty texts")
    ids, mask = pad_sequences(seqs, model.bos_pad_ids()[1])
    return Tokens(ids, mask) if return_mask else ids


def token_inputs(model, inputs: Any, mask: Tensor | None = None) -> Tokens:
    """``inputs`` (see the module docstring) as :class:`Tokens`; token ids without a mask get an all-ones one."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        if mask is not None:
            raise ValueError("mask= goes with token ids; texts get theirs from to_tokens")
        return to_tokens(model, inputs, return_mask=True)
    if isinstance(inputs, Tokens):
        inputs, mask = inputs.ids, inputs.mask if mask is None else mask
    elif isinstance(inputs, Mapping) and "input_ids" in inputs:
        inputs, mask = inputs["input_ids"], inputs.get("attention_mask", mask)
    ids = torch.as_tensor(inputs)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.is_floating_point() or ids.numel() == 0:
        raise ValueError(f"inputs must be a text, a list of texts or token ids [batch, seq] / [seq]; got "
                         f"{type(inputs).__name__} {ids.dtype} {list(ids.shape)} (activations? use a dictionary's "
                         "encode on them)")
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask).reshape(-1, ids.shape[1])
    if mask.shape != ids.shape:
        raise ValueError(f"mask {list(mask.shape)} does not match the token ids {list(ids.shape)}")
    return Tokens(ids.long(), mask.long())
