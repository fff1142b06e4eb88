"""Namers: latent -> (name, score, runner-up names), behind one small protocol.

- ``vocab``: Discover-then-Name (Rao et al. 2024). Unit text embeddings ``E [V, D]`` of a vocabulary and unit
  decoder directions ``d_j``; ``name(j) = argmax_v cos(e_v, d_j)``, score = that cosine. No threshold,
  duplicates allowed.
- ``context``: the tokens / bigrams most over-represented in a latent's top contexts against their base rate in
  random rows; score = (fraction of top contexts holding the term) - (fraction of random rows holding it).
- ``logit-lens``: the token whose unembedding the direction promotes most (``d_j . W_U``);
  score = cosine between ``d_j`` and that token's unembedding column.
- ``llm`` (``conceptdict.naming.llm``): an OpenAI-compatible endpoint writes the name; score = detection
  balanced accuracy.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

from torch import Tensor

from .concepts import Example


class NameResult(NamedTuple):
    name: str
    score: float
    runner_ups: tuple[str, ...] = ()
    runner_up_scores: tuple[float, ...] = ()
    extra: dict | None = None  # namer-specific details, kept in the concept's ``extra``


@dataclass(frozen=True)
class NamingInputs:
    """Everything a namer may look at, per latent (L latents)."""

    directions: Tensor
    """[L, D] decoder rows in raw activation units (one source of a crosscoder)."""
    top_examples: Sequence[tuple[Example, ...]] = ()
    """Per latent: top-activating contexts, highest first."""
    heldout_examples: Sequence[tuple[Example, ...]] = ()
    """Per latent: activating contexts not among those shown to a namer (quantile examples)."""
    negative_examples: Sequence[tuple[Example, ...]] = ()
    """Per latent: contexts where it does not fire."""
    base_examples: tuple[Example, ...] = field(default_factory=tuple)
    """Random store rows, shaped like the top contexts, for base rates."""
    first: int = 0
    """The id of the first latent: these are latents ``[first, first + L)`` of the dictionary (named a block at a
    time when it is read lazily); a namer that draws per latent seeds latent j's draws with ``first + j``."""


class Namer(Protocol):
    kind: str

    def __call__(self, inputs: NamingInputs) -> list[NameResult]: ...


def unit_rows(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows of ``x [n, D]`` scaled to unit L2 norm (zero rows stay zero)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def vocab_names(
    directions: Tensor, embeddings: Tensor, words: Sequence[str], n_runner_ups: int = 4, chunk: int = 1024
) -> list[NameResult]:
    """Discover-then-Name naming: argmax over the vocabulary of cos(e_v, d_j) for each latent j.

    directions [L, D], embeddings [V, D] (any scale: both are unit-normalised), words [V]."""
    if embeddings.shape[0] != len(words):
        raise ValueError(f"{embeddings.shape[0]} embeddings for {len(words)} words; pass one embedding per word")
    if directions.shape[-1] != embeddings.shape[-1]:
        raise ValueError(
            f"decoder directions have D={directions.shape[-1]} but the vocabulary embeddings have "
            f"D={embeddings.shape[-1]}; embed the vocabulary with the dictionary's model and hookpoint"
        )
    E = unit_rows(embeddings)
    k = min(1 + n_runner_ups, len(words))
    out: list[NameResult] = []
    for i in range(0, directions.shape[0], chunk):
        cos = unit_rows(directions[i : i + chunk]) @ E.T  # [l, V]
        top = cos.topk(k, dim=1)
        for vals, idx in zip(top.values.tolist(), top.indices.tolist()):
            out.append(NameResult(words[idx[0]], vals[0], tuple(words[j] for j in idx[1:]), tuple(vals[1:])))
    return out


@dataclass(frozen=True)
class VocabNamer:
    """Discover-then-Name vocabulary namer over precomputed word embeddings [V, D]."""

    words: tuple[str, ...]
    embeddings: Tensor
    n_runner_ups: int = 4
    kind: str = "vocab"

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        return vocab_names(inputs.directions, self.embeddings, self.words, self.n_runner_ups)


_WORD = re.compile(r"[A-Za-z0-9_]+")
_MARKERS = ("##", "\u0120", "\u2581", "\u010a")  # WordPiece continuation, GPT-2 space/newline, SentencePiece space


def _norm_token(tok: str) -> str:
    for m in _MARKERS:
        tok = tok.replace(m, "")
    tok = tok.strip().lower()
    return tok if any(ch.isalnum() for ch in tok) else ""


def _merge_pieces(toks: Sequence[str]) -> list[str]:
    """Join WordPiece continuations (``##x``) onto the token before them."""
    out: list[str] = []
    for t in toks:
        if t.startswith("##") and out:
            out[-1] += t[2:]
        else:
            out.append(t)
    return out


def context_terms(example: Example, window: int | None = None, max_n: int = 2) -> set[str]:
    """The set of normalised n-grams (n <= max_n) of an example's tokens (all of them for a sequence row);
    a token-level row keeps ``window`` tokens each side of the marked one when given."""
    toks = list(example.tokens) or _WORD.findall(example.text)
    if example.marked >= 0 and window is not None:
        toks = toks[max(0, example.marked - window) : example.marked + window + 1]
    norm = [_norm_token(t) for t in _merge_pieces(toks)]
    terms: set[str] = set()
    for n in range(1, max_n + 1):
        for i in range(len(norm) - n + 1):
            gram = norm[i : i + n]
            if all(gram):
                terms.add(" ".join(gram))
    return terms


def context_names(
    top_examples: Sequence[tuple[Example, ...]],
    base_examples: Sequence[Example],
    n_runner_ups: int = 4,
    window: int | None = 3,
    max_n: int = 2,
) -> list[NameResult]:
    """Per latent: the terms most over-represented in its top contexts against random rows."""
    base = Counter()
    for e in base_examples:
        base.update(context_terms(e, window, max_n))
    n_base = max(len(base_examples), 1)
    out = []
    for examples in top_examples:
        if not examples:
            out.append(NameResult("", 0.0))
            continue
        top = Counter()
        for e in examples:
            top.update(context_terms(e, window, max_n))
        n_top = len(examples)
        scored = sorted(
            ((c / n_top - base[t] / n_base, c, -len(t.split()), t) for t, c in top.items()), reverse=True
        )[: 1 + n_runner_ups]
        if not scored:
            out.append(NameResult("", 0.0))
            continue
        out.append(
            NameResult(scored[0][3], scored[0][0], tuple(s[3] for s in scored[1:]), tuple(s[0] for s in scored[1:]))
        )
    return out


@dataclass(frozen=True)
class ContextNamer:
    """Names from over-represented tokens / bigrams in the top contexts (no model, no LLM)."""

    n_runner_ups: int = 4
    window: int | None = 3
    max_n: int = 2
    kind: str = "context"

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        return context_names(inputs.top_examples, inputs.base_examples, self.n_runner_ups, self.window, self.max_n)


def logit_lens_names(
    directions: Tensor, unembed: Tensor, decode: Callable[[list[int]], list[str]], n_runner_ups: int = 4
) -> list[NameResult]:
    """Per latent: the token most promoted by ``d_j . W_U``; score = cos(d_j, W_U[:, v]).

    directions [L, D], unembed [D, V]; ``decode`` maps token ids to strings."""
    from .evidence import logit_lens

    lens = logit_lens(directions, unembed, k=1 + n_runner_ups)
    col_norm = unembed.float().norm(dim=0)  # [V]
    d_norm = directions.float().norm(dim=1, keepdim=True).clamp_min(1e-12)  # [L, 1]
    cos = lens.top_values / (d_norm * col_norm[lens.top_ids].clamp_min(1e-12))
    out = []
    for ids, scores in zip(lens.top_ids.tolist(), cos.tolist()):
        toks = [t.strip() or t for t in decode(ids)]
        out.append(NameResult(toks[0], scores[0], tuple(toks[1:]), tuple(scores[1:])))
    return out


@dataclass(frozen=True)
class LogitLensNamer:
    """Names from the logit lens, for dictionaries on a language model's residual stream."""

    unembed: Tensor
    decode: Callable[[list[int]], list[str]]
    n_runner_ups: int = 4
    kind: str = "logit-lens"

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        return logit_lens_names(inputs.directions, self.unembed, self.decode, self.n_runner_ups)


def check_results(results: list[NameResult], n_latents: int, kind: str) -> list[NameResult]:
    if len(results) != n_latents:
        raise ValueError(f"namer {kind!r} returned {len(results)} names for {n_latents} latents")
    return results


__all__ = [
    "NameResult",
    "NamingInputs",
    "Namer",
    "VocabNamer",
    "ContextNamer",
    "LogitLensNamer",
    "vocab_names",
    "context_names",
    "logit_lens_names",
    "context_terms",
    "unit_rows",
    "check_results",
]
