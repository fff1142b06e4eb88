"""Tokens outside the forward pass: whether two models read the same tokens, and rebuilding token contexts
from an activation store (which keeps every row's context index, position and token id)."""

from __future__ import annotations

from pathlib import Path

import torch

from conceptdict.activations.data import special_wrapping
from conceptdict.activations.families import load_model
from conceptdict.activations.models import load_tokenizer_dir


def tokenizer_of(name: str):
    """The tokenizer of a model given by hub name or directory (a directory's own tokenizer files first)."""
    tok = load_tokenizer_dir(name) if Path(name).expanduser().is_dir() else None
    return tok if tok is not None else load_model(name).tokenizer


PROBE = "The quick brown fox jumps over the lazy dog. 1234 print('hello, world') \u00e9t\u00e9 \u4e2d\u6587"


def tokenizer_difference(tok_a, tok_b) -> str | None:
    """Why two tokenizers would not give the same tokens (None when they agree): vocabulary, special
    tokens, or the ids of a probe text."""
    if tok_a is None or tok_b is None:
        missing = "A" if tok_a is None else "B"
        return f"model {missing} has no tokenizer, so the two cannot be checked to read the same tokens"
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    if len(vocab_a) != len(vocab_b):
        return f"vocabulary sizes differ (A: {len(vocab_a)}, B: {len(vocab_b)})"
    for token, idx in sorted(vocab_a.items(), key=lambda kv: kv[1]):
        if vocab_b.get(token) != idx:
            return f"token {token!r} has id {idx} in A but {vocab_b.get(token)} in B"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(tok_a, attr, None), getattr(tok_b, attr, None)
        if a != b:
            return f"{attr} differs (A: {a}, B: {b})"
    ids_a, ids_b = tok_a(PROBE)["input_ids"], tok_b(PROBE)["input_ids"]
    if list(ids_a) != list(ids_b):
        return f"they tokenise the probe text differently (A: {list(ids_a)[:12]}..., B: {list(ids_b)[:12]}...)"
    return None


def check_same_tokenizer(models: list[str]) -> None:
    """Refuse two models whose tokenizers differ: a crosscoder needs both models' activations on the same tokens."""
    reason = tokenizer_difference(tokenizer_of(models[0]), tokenizer_of(models[1]))
    if reason is not None:
        raise ValueError(f"models {models[0]!r} and {models[1]!r} have different tokenizers: {reason}. A crosscoder "
                         f"pairs the two models' activations token by token, so both must read the same tokens; "
                         f"diff two models that share a tokenizer (e.g. a base model and its fine-tune)")


def causal_lm_source(store) -> str | None:
    """The causal LM a token-level store was cached with (its local directory when it still exists, else its
    hub id), for splicing a dictionary or an eraser back into it; None when the store is sequence-level or its
    model is not a causal LM."""
    info = store.manifest.get("model") or {}
    archs = info.get("architectures") or []
    if store.level != "token" or not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return None
    source = info.get("source")
    return source if source and Path(source).is_dir() else info.get("id")


def separator_id(lm) -> int | None:
    """The token id ``cache`` puts between packed documents for the model handle ``lm``: its tokenizer's (EOS, else
    SEP: ``data.special_wrapping``), else its config's EOS."""
    if lm.tokenizer is not None:
        return special_wrapping(lm.tokenizer)[2]
    eos = getattr(getattr(lm.bridge.original_model, "config", None), "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    return int(eos) if eos is not None else None


def packed_separator(store, sep_id: int | None) -> int | None:
    """The token a packed store left out between its documents: ``sep_id`` (the tokenizer's end-of-text, as
    ``data.special_wrapping`` picks it) when the store was cached with packing from text and left that token's rows
    out; None for a store whose gaps it cannot account for (unpacked, pre-tokenised, imported, or sep kept)."""
    config = store.manifest.get("config")
    if sep_id is None or not isinstance(config, dict) or config.get("tokens_column"):
        return None
    packing = config.get("packing")
    packed = packing if packing is not None else store.level == "token"
    excluded = (store.manifest.get("excluded_tokens") or {}).get("ids") or []
    return sep_id if packed and sep_id in excluded else None


def rebuild_contexts(store, n_contexts: int, bos_id: int | None, pad_id: int,
                     sep_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token contexts [N, T] (right-padded) and attention mask from the first store rows: the contexts the cache
    ran the model on, up to their last stored row.

    Rows carry (context index, position, token); special tokens have no rows. A context whose first stored
    position is 1 gets ``bos_id`` prepended; in a packed store (:func:`packed_separator` of ``sep_id``) each
    one-position gap is the end-of-text separator between two documents and gets ``sep_id`` back. Contexts with
    other gaps are skipped."""
    sep = packed_separator(store, sep_id)
    stop = min(store.num_rows, 200_000)
    ctx, pos, tok = store.context_index(0, stop), store.position(0, stop), store.tokens(0, stop)
    seqs: list[list[int]] = []
    for c in torch.unique_consecutive(ctx).tolist():
        sel = ctx == c
        p, t = pos[sel], tok[sel]
        order = torch.argsort(p)
        seq = _filled(p[order].tolist(), t[order].tolist(), bos_id, sep)
        if seq is None or len(seq) < 2:
            continue
        seqs.append(seq)
        if len(seqs) == n_contexts:
            break
    if not seqs:
        how = ("its contexts have gaps other than one separator between documents" if sep is not None else
               "its contexts have gaps where special tokens were left out, and it records no packing from text "
               "whose separator could fill them")
        raise ValueError(f"no complete token contexts could be rebuilt from {store.path}: {how}; pass --contexts 0 "
                         f"to skip CE loss recovered / KL, or cache the store with --packing false")
    return pad_sequences(seqs, pad_id)


def _filled(positions: list[int], tokens: list[int], bos_id: int | None, sep_id: int | None) -> list[int] | None:
    """The context's tokens from position 0 to its last stored one, BOS at a missing position 0 and ``sep_id`` in
    each one-position gap after it; None when a gap cannot be filled."""
    if not positions:
        return None
    by_pos = dict(zip(positions, tokens))
    if 0 not in by_pos:
        if bos_id is None:
            return None
        by_pos[0] = bos_id
    seq = []
    for i in range(positions[-1] + 1):
        if i in by_pos:
            seq.append(by_pos[i])
        elif sep_id is not None and i - 1 in by_pos and i + 1 in by_pos:
            seq.append(sep_id)
        else:
            return None
    return seq


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [N, T] right-padded with ``pad_id``, attention mask [N, T]), T the longest."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask
