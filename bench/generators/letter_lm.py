"""A tiny causal LM whose hookpoint carries each word's first letter, for the absorption yardstick.

:func:`build_letter_lm` writes a 1-layer GPT-2 (random init) with a word-level tokenizer over made-up words
(:data:`PER_LETTER` a letter, plus the words of SAEBench's prompt) whose input embedding of each word is 4 x its
first letter's unit direction plus 0.2 x noise of its own, so the residual stream at the word
(``blocks.0.hook_out``) holds the letter linearly, as large LMs are found to; :func:`letter_store` caches a token
store of it over sentences of its words. Used by tests/test_yardstick_absorption.py and bench/yardsticks_table.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PER_LETTER = 16
SPECIALS = ["<|endoftext|>", "<pad>", "<unk>"]
HOOKPOINT = "blocks.0.hook_out"


class LetterLM(NamedTuple):
    """The model folder, the letters' unit directions [26, D] and each word's own part of its embedding."""

    path: Path
    letters: torch.Tensor
    own: dict[str, torch.Tensor]


def letter_words(seed: int = 0, per_letter: int = PER_LETTER) -> list[str]:
    """``per_letter`` made-up lowercase words for each letter (3 to 6 letters long), and "has the first letter"."""
    rng = random.Random(seed)
    words: set[str] = set()
    for letter in LETTERS:
        while sum(w[0] == letter for w in words) < per_letter:
            words.add(letter + "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 5))))
    return sorted(words | {"has", "the", "first", "letter"})


def build_letter_lm(directory: Path, d_model: int = 64, seed: int = 0, per_letter: int = PER_LETTER) -> LetterLM:
    """Write the model and its tokenizer (``save_pretrained``) into ``directory``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = letter_words(seed, per_letter)
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=d_model, n_head=2, n_positions=128, vocab_size=len(tok),
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id))
    g = torch.Generator().manual_seed(seed)
    letters = torch.nn.functional.normalize(torch.randn(26, d_model, generator=g), dim=1)
    own = {}
    with torch.no_grad():
        for w in words:
            own[w] = 0.2 * torch.randn(d_model, generator=g)
            model.transformer.wte.weight[tok.convert_tokens_to_ids(w)] = 4 * letters[LETTERS.index(w[0])] + own[w]
    directory = Path(directory)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return LetterLM(directory, letters, own)


def letter_store(out: Path, lm: LetterLM, documents: int = 40, seed: int = 1):
    """A token store of the model at :data:`HOOKPOINT` over ``documents`` sentences of 20 of its words, drawn with
    Zipf frequencies (the word of rank r, in a seeded order, with weight 1 / r): a few words are frequent enough
    for a dictionary to give them latents of their own, which is where absorption comes from."""
    from conceptdict.activations.cache import CacheConfig, cache_activations

    rng = random.Random(seed)
    words = rng.sample(sorted(lm.own), len(lm.own))
    weights = [1 / r for r in range(1, len(words) + 1)]
    records = [{"text": " ".join(rng.choices(words, weights, k=20))} for _ in range(documents)]
    cfg = CacheConfig(model=str(lm.path), hookpoints=[HOOKPOINT], dataset="", out=Path(out), context_length=32,
                      batch_size=8, progress=False)
    return cache_activations(cfg, records=records)
