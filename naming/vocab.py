"""Vocabularies for the vocabulary namer, and their embeddings cached on disk.

A vocabulary SPEC is one of

- ``wordfreq`` / ``wordfreq:LANG`` / ``wordfreq:LANG:N`` — the N most frequent words of LANG from the
  ``wordfreq`` package (default ``wordfreq:en:20000``, the Discover-then-Name vocabulary size);
- a path to a text file with one word (or phrase) per line; blank lines and lines starting with ``#`` are skipped.

Duplicates are dropped, first occurrence kept. Embeddings are computed with the dictionary's own model and
hookpoint (``conceptdict.activations.embed_texts``) so they live in the activations' space, and cached as
``<cache_dir>/vocab-<hash>.safetensors`` keyed by model, hookpoint and the exact word list.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger(__name__)

DEFAULT_VOCAB = "wordfreq:en:20000"


def default_cache_dir() -> Path:
    """``$CONCEPTDICT_CACHE`` or ``$XDG_CACHE_HOME/conceptdict`` (``~/.cache/conceptdict``)."""
    if os.environ.get("CONCEPTDICT_CACHE"):
        return Path(os.environ["CONCEPTDICT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "conceptdict"


def load_vocabulary(spec: str) -> list[str]:
    """The word list named by ``spec`` (see the module docstring)."""
    if spec == "wordfreq" or spec.startswith("wordfreq:"):
        parts = spec.split(":")
        lang = parts[1] if len(parts) > 1 and parts[1] else "en"
        try:
            n = int(parts[2]) if len(parts) > 2 else 20000
        except ValueError:
            raise ValueError(f"vocabulary spec {spec!r}: N must be an integer, e.g. wordfreq:en:20000") from None
        if n < 1:
            raise ValueError(f"vocabulary spec {spec!r}: N={n} must be at least 1, e.g. wordfreq:en:20000")
        from wordfreq import available_languages, top_n_list

        try:
            words = top_n_list(lang, n)
        except LookupError:
            langs = ", ".join(sorted(available_languages()))
            raise ValueError(f"vocabulary spec {spec!r}: wordfreq has no language {lang!r}; use one of {langs} "
                             "(e.g. wordfreq:en:20000), or a word-list file") from None
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(
                f"vocabulary {spec!r} is neither a word-list file nor a wordfreq spec (e.g. wordfreq:en:20000)"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            from conceptdict.activations.data import first_undecodable_line

            line, column, byte = first_undecodable_line(path, "utf-8")
            raise ValueError(f"vocabulary file {path} is not valid UTF-8 at line {line}, column {column} (byte "
                             f"0x{byte:02x}); re-save it as UTF-8") from None
        words = [w.strip() for w in text.splitlines()]
        words = [w for w in words if w and not w.startswith("#")]
    words = list(dict.fromkeys(words))
    if not words:
        raise ValueError(f"vocabulary {spec!r} is empty; give a file with one word per line")
    return words


class VocabEmbeddings(NamedTuple):
    words: list[str]
    embeddings: Tensor  # [V, D] float32
    path: Path | None  # the cache file, None when not cached


def vocab_key(model_id: str, hookpoint: str, words: list[str]) -> str:
    """Hex digest identifying (model, hookpoint, word list)."""
    h = hashlib.sha256()
    for part in (model_id, hookpoint, "\n".join(words)):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:24]


def embed_vocabulary(
    words: list[str],
    model_id: str,
    hookpoint: str,
    embed: Callable[[list[str]], Tensor],
    cache_dir: Path | None,
) -> VocabEmbeddings:
    """Embeddings [V, D] of ``words`` via ``embed``, read from / written to ``cache_dir`` when given."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"vocab-{vocab_key(model_id, hookpoint, words)}.safetensors"
        if path.exists():
            emb = load_file(str(path))["embeddings"]
            if emb.shape[0] == len(words):
                log.info("vocabulary embeddings from cache %s", path)
                return VocabEmbeddings(words, emb, path)
            log.warning("ignoring cache %s: %d rows for %d words", path, emb.shape[0], len(words))
    log.info("embedding %d vocabulary words with %s at %s", len(words), model_id, hookpoint)
    emb = embed(words).float().contiguous()
    if emb.shape[0] != len(words):
        raise ValueError(f"embedding returned {emb.shape[0]} rows for {len(words)} words")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        save_file({"embeddings": emb}, str(tmp), metadata={"model": model_id, "hookpoint": hookpoint})
        os.replace(tmp, path)
    return VocabEmbeddings(words, emb, path)


def model_embedder(model_name: str, hookpoint: str, device: str = "cpu") -> Callable[[list[str]], Tensor]:
    """A function texts -> [N, D] that loads the model on first use (``conceptdict.activations``)."""
    state: dict[str, object] = {}

    def embed(texts: list[str]) -> Tensor:
        from conceptdict.activations import embed_texts, load_model

        if "model" not in state:
            state["model"] = load_model(model_name, device=device)
        with torch.no_grad():
            return embed_texts(state["model"], texts, hookpoint)

    return embed
