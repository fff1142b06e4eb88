"""Tiny random-init models and corpora built offline, for tests of every stage.

- :func:`build_tiny_lm` — a 2-layer GPT-2 causal LM (d_model 32, vocab ~300) with a word-level tokenizer.
- :func:`build_tiny_bert` — a 2-layer BERT encoder (d_model 32) with [CLS]/[SEP] wrapping.
- :func:`tiny_corpus` — deterministic sentences over the tokenizer's words, with a ``topic`` label.
- :func:`build_tiny_lm_store` — a token-level store of the tiny LM over the tiny corpus.

Each builder writes into the directory it is given and returns it; the pytest fixtures in
``tests/conftest.py`` (``tiny_lm_dir``, ``tiny_bert_dir``, ``tiny_lm_store``, ``tiny_sentence_store``)
build them once per session.
"""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<pad>", "<unk>", "[CLS]", "[SEP]"]
TOPICS = {
    "animals": ["cat", "dog", "bird", "fish", "horse", "cow", "lion", "bear", "wolf", "mouse"],
    "food": ["bread", "apple", "cheese", "rice", "soup", "milk", "egg", "meat", "cake", "salt"],
    "weather": ["rain", "snow", "wind", "sun", "cloud", "storm", "fog", "heat", "cold", "ice"],
}
N_LAYERS, D_MODEL = 2, 32


def _words() -> list[str]:
    import wordfreq

    words = [w for w in wordfreq.top_n_list("en", 400) if w.isalpha()][:250]
    for topic_words in TOPICS.values():
        words += [w for w in topic_words if w not in words]
    return words


def word_tokenizer(vocab: list[str], wrap_cls_sep: bool = False):
    """A lowercase word-level tokenizer (whitespace and punctuation split) over ``vocab``, whose entries include the
    specials it uses: ``<|endoftext|>`` (bos / eos), ``<pad>``, ``<unk>``, and ``[CLS]`` / ``[SEP]`` when
    ``wrap_cls_sep`` wraps every input in them (BERT)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if wrap_cls_sep:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                       cls_token="[CLS]", sep_token="[SEP]")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _tokenizer(wrap_cls_sep: bool):
    return word_tokenizer(SPECIALS + _words(), wrap_cls_sep)


def build_tiny_lm(directory: Path, seed: int = 0) -> Path:
    """A random-init 2-layer GPT-2 (causal LM) + word-level tokenizer saved with ``save_pretrained``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = Path(directory)
    tok = _tokenizer(wrap_cls_sep=False)
    cfg = GPT2Config(n_layer=N_LAYERS, n_embd=D_MODEL, n_head=2, n_positions=128, vocab_size=len(tok),
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


def build_tiny_bert(directory: Path, seed: int = 0) -> Path:
    """A random-init 2-layer BERT encoder + word-level tokenizer wrapping inputs in [CLS] ... [SEP]."""
    import torch
    from transformers import BertConfig, BertModel

    directory = Path(directory)
    tok = _tokenizer(wrap_cls_sep=True)
    cfg = BertConfig(num_hidden_layers=N_LAYERS, hidden_size=D_MODEL, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=128, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    BertModel(cfg).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


def tiny_corpus(n_docs: int = 60, seed: int = 0) -> list[dict]:
    """Deterministic documents mixing common words with one topic's words; ``topic`` is the label."""
    rng = random.Random(seed)
    common = _words()[:120]
    docs = []
    for i in range(n_docs):
        topic = sorted(TOPICS)[i % len(TOPICS)]
        words = [rng.choice(TOPICS[topic]) if rng.random() < 0.4 else rng.choice(common)
                 for _ in range(rng.randint(6, 30))]
        docs.append({"text": " ".join(words), "topic": topic})
    return docs


def build_tiny_lm_store(out: Path, model_dir: Path, n_docs: int = 60, hookpoints=("blocks.0.hook_out",
                                                                                   "blocks.1.hook_out")) -> Path:
    """A token-level store (packed contexts of 32 tokens) of the tiny LM over :func:`tiny_corpus`."""
    from conceptdict.activations.cache import CacheConfig, cache_activations

    cfg = CacheConfig(model=str(model_dir), hookpoints=list(hookpoints), dataset="", out=Path(out),
                      context_length=32, batch_size=8, shard_rows=256, progress=False)
    return cache_activations(cfg, records=tiny_corpus(n_docs))
