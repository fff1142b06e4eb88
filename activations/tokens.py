"""Tokens outside the forward pass: whether two models read the same tokens, and rebuilding token contexts
from an activation store (which keeps every row's context index, position and token id)."""

from __future__ import annotations

from pathlib import Path

import torch

from conceptdict.activations.models import load_model, load_tokenizer_dir


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


def rebuild_contexts(store, n_contexts: int, bos_id: int | None, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token contexts [N, T] (right-padded) and attention mask from the first store rows.

    Rows carry (context index, position, token); a context whose first stored position is 1 gets ``bos_id``
    prepended (the store excludes BOS rows); contexts with other gaps are skipped."""
    stop = min(store.num_rows, 200_000)
    ctx, pos, tok = store.context_index(0, stop), store.position(0, stop), store.tokens(0, stop)
    seqs: list[list[int]] = []
    for c in torch.unique_consecutive(ctx).tolist():
        sel = ctx == c
        p, t = pos[sel], tok[sel]
        order = torch.argsort(p)
        p, t = p[order].tolist(), t[order].tolist()
        if p and p[0] == 1 and bos_id is not None:
            p, t = [0] + p, [bos_id] + t
        if not p or p[0] != 0 or p != list(range(len(p))) or len(p) < 2:
            continue
        seqs.append(t)
        if len(seqs) == n_contexts:
            break
    if not seqs:
        raise ValueError(f"no complete token contexts could be rebuilt from {store.path}")
    return pad_sequences(seqs, pad_id)


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [N, T] right-padded with ``pad_id``, attention mask [N, T]), T the longest."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(seqs), T, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask
