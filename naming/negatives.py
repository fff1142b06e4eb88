"""Positive and negative contexts per latent, for scoring names (docs/scores.md).

Positives are a latent's top and quantile examples, as the concept dictionary holds them. Negatives are
store rows where the latent is 0, each tagged with how it was found:

- ``random``: drawn uniformly from a pool of store rows;
- ``similar`` (hard): top contexts of the latents whose decoder directions are most similar to this one's;
- ``token`` (hard): rows that share one of the latent's top tokens (token-level stores: the activating
  token of its top examples; sequence-level stores: the words most over-represented in its top inputs).

Random negatives alone make a name look better than it is: any topical word separates a latent's contexts
from random text. Hard negatives are close to the positives, so only a name that says what *distinguishes*
them scores high (delphi's "neighbour" negatives, and contexts with the same surface token).

Every candidate is checked by encoding its row: a negative is a row where the latent's activation is 0.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .concepts import ConceptDictionary, Example
from .evidence import ContextCache, iter_inputs
from .protocols import Dictionary, Store

NEGATIVE_KINDS = ("random", "similar", "token")
_WORD = re.compile(r"[a-z][a-z0-9_]{2,}")


@dataclass(frozen=True)
class NegativeConfig:
    """Which negatives a score uses and how many of each kind."""

    kinds: str = field(default="random+hard", metadata={
        "help": "random, hard (similar-direction and shared-token contexts) or random+hard."})
    n_random: int = field(default=10, metadata={"help": "Random non-activating contexts per latent."})
    n_similar: int = field(default=5, metadata={
        "help": "Hard negatives from the top contexts of the latents with the most similar decoder directions."})
    similar_latents: int = field(default=5, metadata={
        "help": "How many most-similar latents those contexts come from."})
    n_token: int = field(default=5, metadata={
        "help": "Hard negatives sharing one of the latent's top tokens (or top words) without activating it."})
    pool_rows: int = field(default=50_000, metadata={
        "help": "Store rows sampled as the pool every negative is drawn from (plus every latent's top rows)."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed for the pool and the draws."})

    def __post_init__(self) -> None:
        if self.kinds not in ("random", "hard", "random+hard"):
            raise ValueError(f"negatives {self.kinds!r} must be random, hard or random+hard")
        if min(self.n_random, self.n_similar, self.similar_latents, self.n_token, self.pool_rows) < 0:
            raise ValueError("negative counts must be >= 0")

    def wants(self, kind: str) -> bool:
        return kind == "random" and "random" in self.kinds or kind != "random" and "hard" in self.kinds


class Sample(NamedTuple):
    """One latent's contexts: positives, and negatives with the kind of each."""

    positives: tuple[Example, ...]
    negatives: tuple[Example, ...]
    kinds: tuple[str, ...]


class Pool(NamedTuple):
    """Store rows with the latents firing on each and a key per row for shared-token negatives."""

    rows: Tensor  # [P] int64 store rows, ascending
    fires: Tensor  # [P, L] bool
    keys: list  # [P]: token id (token stores) or frozenset of words (sequence stores)
    index: dict[int, int]  # store row -> pool position


def positives(cd: ConceptDictionary, j: int) -> tuple[Example, ...]:
    """Top then quantile examples of latent ``j``, each row once."""
    seen, out = set(), []
    for e in cd.concepts[j].top_examples + cd.concepts[j].quantile_examples:
        if e.row not in seen:
            seen.add(e.row)
            out.append(e)
    return tuple(out)


def build_pool(cd: ConceptDictionary, model: Dictionary, store: Store, hookpoint: str | Sequence[str],
               cfg: NegativeConfig, chunk: int = 4096) -> Pool:  # fmt: skip
    """Encode a uniform sample of rows plus every latent's top rows; record which latents fire on each.
    ``hookpoint``: what the dictionary encodes (several: a cross-layer transcoder's MLP inputs, stacked per row)."""
    n = store.num_rows
    keep = torch.zeros(n, dtype=torch.bool)
    gen = torch.Generator().manual_seed(cfg.seed)
    keep[torch.randperm(n, generator=gen)[: cfg.pool_rows]] = True
    for c in cd.concepts:
        for e in c.top_examples:
            keep[e.row] = True
    rows, fires = [], []
    for start, x in iter_inputs(store, [hookpoint] if isinstance(hookpoint, str) else list(hookpoint), chunk):
        mask = keep[start : start + x.shape[0]]
        if not mask.any():
            continue
        with torch.no_grad():
            f = model.encode(x[mask]).float().cpu()
        rows.append(torch.nonzero(mask).flatten() + start)
        fires.append(f > 0)
    all_rows = torch.cat(rows)
    keys = row_keys(store, all_rows.tolist())
    return Pool(all_rows, torch.cat(fires), keys, {r: i for i, r in enumerate(all_rows.tolist())})


def row_keys(store: Store, rows: list[int]) -> list:
    """Per row: its token id (token-level; the token string for stores without ``tokens``) or the set of
    words of its text (sequence-level)."""
    if getattr(store, "level", "token") == "sequence":
        texts = store.texts() if hasattr(store, "texts") else None
        text = (lambda r: texts[r]) if texts else (lambda r: store.row_context(r).text)
        return [frozenset(_WORD.findall(text(r).lower())) for r in rows]
    if hasattr(store, "tokens"):
        out, at = [], torch.tensor(rows, dtype=torch.int64)
        for start in range(0, store.num_rows, 1 << 20):  # a million token ids at a time
            part = at[(at >= start) & (at < start + (1 << 20))]
            if part.numel():
                out.extend(store.tokens(start, min(store.num_rows, start + (1 << 20)))[part - start].tolist())
        return out
    out = []
    for r in rows:
        ctx = store.row_context(r, 0, 0)
        out.append(ctx.tokens[ctx.marked] if ctx.marked >= 0 else "")
    return out


def similar_latents(directions: Tensor, k: int, chunk: int = 1024) -> Tensor:
    """[L, k] the latents with the highest decoder cosine to each latent (itself excluded)."""
    d = directions.float().reshape(directions.shape[0], -1)
    d = d / d.norm(dim=1, keepdim=True).clamp_min(1e-12)
    k = min(k, d.shape[0] - 1)
    out = []
    for i in range(0, d.shape[0], chunk):
        cos = d[i : i + chunk] @ d.T
        cos[torch.arange(cos.shape[0]), torch.arange(i, i + cos.shape[0])] = -2.0
        out.append(cos.topk(k, dim=1).indices)
    return torch.cat(out)


def top_keys(pool: Pool, cd: ConceptDictionary, j: int, base: Counter, n: int = 3) -> list:
    """Latent ``j``'s top tokens (ids of its activating tokens) or, for sequence rows, its most
    over-represented words against the pool (``base``: how many pool rows hold each word)."""
    top = [pool.keys[pool.index[e.row]] for e in cd.concepts[j].top_examples if e.row in pool.index]
    if not top:
        return []
    if not isinstance(top[0], frozenset):
        return [t for t, _ in Counter(top).most_common(n)]
    in_top = Counter(w for words in top for w in words)
    lift = sorted(in_top, key=lambda w: (in_top[w] / len(top) - base[w] / len(pool.keys), w), reverse=True)
    return lift[:n]


def _key_index(pool: Pool) -> dict:
    """key (token id or word) -> pool positions holding it."""
    index: dict = {}
    for i, key in enumerate(pool.keys):
        for k in key if isinstance(key, frozenset) else (key,):
            index.setdefault(k, []).append(i)
    return index


def draw_negatives(cd: ConceptDictionary, pool: Pool, cfg: NegativeConfig, cache: ContextCache,
                   ids: Sequence[int]) -> dict[int, Sample]:  # fmt: skip
    """Per latent in ``ids``: its positives and up to n_random + n_similar + n_token negatives."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    similar = similar_latents(cd.directions, cfg.similar_latents) if cfg.wants("similar") else None
    key_index = _key_index(pool) if cfg.wants("token") else {}
    base = Counter({k: len(v) for k, v in key_index.items()})
    out = {}
    for j in ids:
        quiet = ~pool.fires[:, j]
        picked: list[tuple[int, str]] = []
        taken: set[int] = set()

        def add(positions, kind, limit):
            for p in positions:
                if len([k for _, k in picked if k == kind]) >= limit:
                    break
                if quiet[p] and p not in taken:
                    taken.add(p)
                    picked.append((p, kind))

        if similar is not None:
            tops = [pool.index[e.row] for m in similar[j].tolist() for e in cd.concepts[m].top_examples]
            add(_shuffled(tops, gen), "similar", cfg.n_similar)
        if cfg.wants("token"):
            cands = {p for key in top_keys(pool, cd, j, base) for p in key_index.get(key, ())}
            add(_shuffled(sorted(cands), gen), "token", cfg.n_token)
        if cfg.wants("random"):
            add(torch.randperm(len(pool.keys), generator=gen)[: 8 * cfg.n_random + 64].tolist(), "random", cfg.n_random)
        rows = [int(pool.rows[p]) for p, _ in picked]
        out[j] = Sample(positives(cd, j), tuple(cache.example(r, 0.0) for r in rows), tuple(k for _, k in picked))
    return out


def _shuffled(items: list[int], gen: torch.Generator) -> list[int]:
    return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]
