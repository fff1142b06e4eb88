"""The spliced scores of ``conceptdict eval``: CE loss recovered and the KL score of a dictionary spliced into its
causal language model (a replacement model's: every MLP replaced at once)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from conceptdict.activations import load_model, spliced_losses
from conceptdict.activations.live import LiveSource
from conceptdict.activations.replacement import replacement_losses
from conceptdict.activations.tokens import (
    causal_lm_source,
    rebuild_contexts,
    separator_id,
)
from conceptdict.saes import EvalResult, SparseCoder, with_splice_scores
from conceptdict.saes.replacement import clt_replacement, transcoder_replacement

if TYPE_CHECKING:
    from conceptdict.eval_api import EvalConfig


def set_splice_scores(result: EvalResult, models: list[SparseCoder], store, hookpoints: list[str],
                      cfg: EvalConfig) -> EvalResult:
    """:func:`splice_scores` of per-layer transcoders: every MLP replaced at once by its layer's transcoder."""
    lm_ids = lm_contexts(store, cfg)
    if lm_ids is None:
        return result
    S = len(models)
    return replacement_scores(result, *lm_ids[:1], transcoder_replacement(models),
                              list(zip(hookpoints[:S], hookpoints[S:])), *lm_ids[1:])


def splice_model(store, cfg: EvalConfig) -> str | None:
    """The causal LM a store's dictionary is spliced into (``--model``, else the store's), None when it is not:
    no contexts, no causal LM, or sequence-level rows (a model's forward: its own model, not named here)."""
    if isinstance(store, LiveSource) or cfg.contexts == 0 or isinstance(store, list) or store.level != "token":
        return None
    return cfg.model or causal_lm_source(store)


def lm_contexts(store, cfg: EvalConfig):
    """(causal LM, token ids, mask) for the spliced losses, or None when there is no causal LM or no contexts."""
    if isinstance(store, LiveSource):
        ids = store.contexts(cfg.contexts) if cfg.contexts else None
        return None if ids is None else (store.model, *ids)
    name = splice_model(store, cfg)
    if name is None:
        return None
    lm = load_model(name, device=cfg.device)
    bos, pad = lm.bos_pad_ids()  # from the config when the model was saved without a tokenizer
    return (lm, *rebuild_contexts(store, cfg.contexts, bos, pad, separator_id(lm)))


def spliceable(sae: SparseCoder) -> bool:
    """Whether one splice replaces what ``sae`` reads: not a crosscoder, which spans several models or layers."""
    return sae.n_sources == 1 or sae.spec.layered


def splice_scores(result: EvalResult, sae: SparseCoder, store, hookpoints: list[str], cfg: EvalConfig,
                  lm_ids: tuple | None = None) -> EvalResult:
    """``result`` with CE loss recovered / KL score when a causal LM is at hand: the last hookpoint is replaced by
    the dictionary's output on the first (the same one for an SAE; a transcoder's input, then output). ``lm_ids``:
    :func:`lm_contexts`' answer when the caller keeps it (evaluations during training), else it is made here."""
    if not spliceable(sae):
        return result
    lm_ids = lm_ids or lm_contexts(store, cfg)
    if lm_ids is None:
        return result
    lm, ids, mask = lm_ids
    if sae.spec.layered:  # a cross-layer transcoder replaces every MLP it covers at once
        S = sae.n_sources
        return replacement_scores(result, lm, clt_replacement(sae), list(zip(hookpoints[:S], hookpoints[S:])), ids,
                                  mask)

    def swap(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return sae(x.to(sae.device)).to(x.device)

    losses = spliced_losses(lm, hookpoints[-1], ids, swap, attention_mask=mask,
                            source=hookpoints[0] if len(hookpoints) > 1 else None)
    return with_splice_scores(result, losses.ce_clean, losses.ce_zero, losses.ce_replaced, losses.kl_zero,
                              losses.kl_replaced)


def replacement_scores(result: EvalResult, lm, replacement, layers: list[tuple[str, str]], ids, mask) -> EvalResult:
    """``result`` with the replacement model's CE loss recovered / KL score (every MLP in ``layers`` replaced at once,
    errors not kept) and, in ``splice``, the error-kept forward's CE, KL and largest logit difference from clean."""
    losses = replacement_losses(lm, layers, ids, replacement.encode, replacement.decode, attention_mask=mask)
    return with_splice_scores(result, losses.ce_clean, losses.ce_zero, losses.ce_replaced, losses.kl_zero,
                              losses.kl_replaced, ce_with_errors=losses.ce_with_errors,
                              kl_with_errors=losses.kl_with_errors,
                              max_logit_diff_with_errors=losses.max_logit_diff_with_errors)


__all__ = ["lm_contexts", "replacement_scores", "set_splice_scores", "splice_model", "splice_scores", "spliceable"]
