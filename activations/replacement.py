"""Replacement models: every MLP of a causal LM replaced at once, in one forward, by what a dictionary predicts from
that forward's own MLP inputs (a cross-layer transcoder, or one transcoder per layer), and the losses that measure it.

The dictionary side is two functions this stage knows nothing about: ``encode(l, x_l)`` turns layer l's MLP input
[n, D] into whatever the dictionary keeps of it (its code), and ``decode(l, codes)`` predicts layer l's MLP output
[n, D] from the codes of layers 0..l of the same forward. Four forwards over the same tokens:

- clean: nothing replaced (its MLP inputs and outputs are recorded);
- zero: every MLP output zeroed (the baseline of CE loss recovered);
- replaced: every MLP output is ``decode`` of that forward's codes (no error terms): the replacement model;
- with error nodes: the replaced output plus layer l's error of the clean forward, y_l - decode(l, clean codes):
  this reproduces the clean logits exactly (up to float rounding) when the splice reads each layer's input and
  writes its output where the clean model does, which is the correctness check circuit tracing relies on.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from .losses import loss_mask, next_token_ce, next_token_kl
from .models import ModelHandle, check_hookpoints

Encode = Callable[[int, Tensor], Any]
Decode = Callable[[int, list], Tensor]


class ReplacementLosses(NamedTuple):
    """Mean next-token CE of the clean, all-MLPs-zeroed, replaced and error-kept forwards; KL of each to the clean
    next-token distribution; the largest |logit| difference of the error-kept forward from the clean one."""

    ce_clean: float
    ce_zero: float
    ce_replaced: float
    kl_zero: float
    kl_replaced: float
    ce_with_errors: float
    kl_with_errors: float
    max_logit_diff_with_errors: float


def replacement_losses(model: ModelHandle, layers: Sequence[tuple[str, str]], tokens: Tensor, encode: Encode,
                       decode: Decode, attention_mask: Tensor | None = None) -> ReplacementLosses:
    """The losses of the replacement model whose layer l reads hookpoint ``layers[l][0]`` (its MLP input) and replaces
    ``layers[l][1]`` (its MLP output). tokens [N, T] int64; positions whose input or target is BOS/pad/special are
    left out, as in ``spliced_losses``."""
    check_hookpoints(model, [h for pair in layers for h in pair])
    if not model.is_causal:
        raise ValueError(f"a replacement model's losses need a causal LM; {model.name} is not one")
    tokens = tokens.to(model.device)
    mask = attention_mask.to(model.device) if attention_mask is not None else torch.ones_like(tokens)
    keep = loss_mask(model, tokens, mask)
    if not bool(keep.any()):
        raise ValueError("no scoreable positions: every next-token target is BOS/pad/special")

    def flat(t: Tensor) -> Tensor:
        return t.reshape(-1, t.shape[-1]).float()

    def run(out_edit: Callable[[int, Tensor], Tensor] | None, on_input: Callable[[int, Tensor], None] | None):
        hooks = []
        for l, (src, dst) in enumerate(layers):
            if on_input is not None:
                hooks.append((src, lambda t, hook, l=l: on_input(l, t)))
            if out_edit is not None:
                hooks.append((dst, lambda t, hook, l=l: out_edit(l, t)))
        with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
            return model.bridge(tokens, attention_mask=mask).float()[:, :-1]

    codes: list = []

    def read(l: int, t: Tensor) -> None:
        if l == 0:
            codes.clear()
        codes.append(encode(l, flat(t)))

    errors: list[Tensor] = []

    def record(l: int, t: Tensor) -> Tensor:  # the clean forward: its outputs unchanged, their errors kept
        errors.append(flat(t) - decode(l, codes[: l + 1]))
        return t

    def replaced(l: int, t: Tensor) -> Tensor:
        return decode(l, codes[: l + 1]).to(t.dtype).reshape(t.shape)

    def with_errors(l: int, t: Tensor) -> Tensor:
        return (decode(l, codes[: l + 1]) + errors[l]).to(t.dtype).reshape(t.shape)

    logits_clean = run(record, read)
    targets = tokens[:, 1:]
    logp_clean = logits_clean.log_softmax(-1)
    ce, kl = [next_token_ce(logp_clean, targets, keep)], []
    logits = {}
    for name, edit, reads in (("zero", lambda l, t: torch.zeros_like(t), None), ("replaced", replaced, read),
                              ("errors", with_errors, read)):
        logits[name] = run(edit, reads)
        ce.append(next_token_ce(logits[name].log_softmax(-1), targets, keep))
        kl.append(next_token_kl(logits_clean, logits[name], keep))
    diff = float((logits["errors"] - logits_clean)[keep].abs().max())
    return ReplacementLosses(ce[0], ce[1], ce[2], kl[0], kl[1], ce[3], kl[2], diff)
