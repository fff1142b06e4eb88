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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .concepts import Concept, Example
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
    fire_ptr: Tensor  # [L + 1] int64: latent j fires on the pool positions fire_pos[fire_ptr[j]:fire_ptr[j + 1]]
    fire_pos: Tensor  # [nnz] int64 pool positions, grouped by latent (a sparse [P, L]: rows x L0 entries)
    keys: list  # [P]: token id (token stores) or frozenset of words (sequence stores)
    index: dict[int, int]  # store row -> pool position

    def quiet(self, j: int) -> Tensor:
        """[P] bool: the pool rows where latent ``j`` is 0."""
        out = torch.ones(len(self.rows), dtype=torch.bool)
        out[self.fire_pos[int(self.fire_ptr[j]): int(self.fire_ptr[j + 1])]] = False
        return out


def positives(concept: Concept) -> tuple[Example, ...]:
    """Top then quantile examples of a latent, each row once."""
    seen, out = set(), []
    for e in concept.top_examples + concept.quantile_examples:
        if e.row not in seen:
            seen.add(e.row)
            out.append(e)
    return tuple(out)


LAZY_ROWS = 512
"""Pool rows encoded at a time by a dictionary read lazily (``saes.lazy``): its codes are [rows, block latents]
(measured on the capped 65,536-latent artifact of tests/test_lazy_capped.py: +58 MiB resident at 512 rows, +111 MiB
at 4,096)."""


def _lazy(model: Dictionary) -> bool:
    from conceptdict.saes.lazy import LazyDictionary

    return isinstance(model, LazyDictionary)


def _firing(model: Dictionary, x: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """(row in ``x``, latent) of every code > 0 of rows ``x``: a dictionary read lazily (``saes.lazy``) a block of
    latents at a time, so that no [rows, L] codes are held."""
    with torch.no_grad():
        if _lazy(model):
            rows, _ = model.source_rows(x, "encode")
            for a, _, f in model.block_codes(rows):
                r, c = torch.nonzero(f.float().cpu() > 0, as_tuple=True)
                yield r, c + a
            return
        r, c = torch.nonzero(model.encode(x).float().cpu() > 0, as_tuple=True)
        yield r, c


def build_pool(top_rows: Iterable[int], model: Dictionary, store: Store, hookpoint: str | Sequence[str],
               cfg: NegativeConfig, n_latents: int, chunk: int = 4096) -> Pool:  # fmt: skip
    """Encode a uniform sample of rows plus every latent's top rows (``top_rows``); record which latents fire on
    each, as (row, latent) pairs. ``hookpoint``: what the dictionary encodes (several: a cross-layer transcoder's
    MLP inputs, stacked per row)."""
    n = store.num_rows
    keep = torch.zeros(n, dtype=torch.bool)
    gen = torch.Generator().manual_seed(cfg.seed)
    keep[torch.randperm(n, generator=gen)[: cfg.pool_rows]] = True
    for row in top_rows:
        keep[row] = True
    rows, pos, lat, at = [], [], [], 0
    chunk = min(chunk, LAZY_ROWS) if _lazy(model) else chunk
    for start, x in iter_inputs(store, [hookpoint] if isinstance(hookpoint, str) else list(hookpoint), chunk):
        mask = keep[start : start + x.shape[0]]
        if not mask.any():
            continue
        for r, c in _firing(model, x[mask]):
            pos.append(r + at)
            lat.append(c)
        rows.append(torch.nonzero(mask).flatten() + start)
        at += int(mask.sum())
    all_rows = torch.cat(rows)
    pos_t, lat_t = (torch.cat(pos), torch.cat(lat)) if pos else (torch.zeros(0, dtype=torch.int64),) * 2
    order = torch.sort(lat_t * at + pos_t).indices  # by latent, then pool position
    ptr = torch.zeros(n_latents + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(lat_t, minlength=n_latents).cumsum(0)
    keys = row_keys(store, all_rows.tolist())
    return Pool(all_rows, ptr, pos_t[order], keys, {r: i for i, r in enumerate(all_rows.tolist())})


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


def similar_latents(directions: Callable[[int, int], Tensor], n_latents: int, start: int, stop: int, k: int,
                    chunk: int = 1024, columns: int = 4096) -> Tensor:
    """[stop - start, k] the latents with the highest decoder cosine to each of latents ``[start, stop)`` (itself
    excluded), of ``directions(a, b)`` (latents ``[a, b)``' decoder rows): against ``columns`` latents at a time,
    each part's k best kept, so that a caller reading the directions from disk holds two parts."""
    def unit(a: int, b: int) -> Tensor:
        d = directions(a, b).float().reshape(b - a, -1)
        return d / d.norm(dim=1, keepdim=True).clamp_min(1e-12)

    k = min(k, n_latents - 1)
    out = []
    for i in range(start, stop, chunk):
        rows = unit(i, min(stop, i + chunk))
        values, indices = [], []
        for a in range(0, n_latents, columns):
            cos = rows @ unit(a, min(n_latents, a + columns)).T
            own = torch.arange(i, i + rows.shape[0])
            mine = (own >= a) & (own < a + cos.shape[1])
            cos[torch.nonzero(mine).flatten(), own[mine] - a] = -2.0
            top = cos.topk(min(k, cos.shape[1]), dim=1)
            values.append(top.values)
            indices.append(top.indices + a)
        best = torch.cat(values, 1).topk(k, dim=1).indices
        out.append(torch.cat(indices, 1).gather(1, best))
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.int64)


def top_keys(pool: Pool, concept: Concept, base: Counter, n: int = 3) -> list:
    """A latent's top tokens (ids of its activating tokens) or, for sequence rows, its most over-represented
    words against the pool (``base``: how many pool rows hold each word)."""
    top = [pool.keys[pool.index[e.row]] for e in concept.top_examples if e.row in pool.index]
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


class Negatives:
    """Draws each latent's negatives, in latent order, a block of concepts at a time (in memory, the whole
    dictionary is one block): the pool, every latent's top rows (``tops``, for the similar-direction negatives,
    which come from other latents) and ``directions(a, b)`` (latents ``[a, b)``' decoder rows) are the whole
    dictionary's; one generator runs over the blocks, so the draws do not depend on how the latents are cut."""

    def __init__(self, pool: Pool, cfg: NegativeConfig, cache: ContextCache, tops: Sequence[Sequence[int]],
                 directions: Callable[[int, int], Tensor]) -> None:
        self.pool, self.cfg, self.cache, self.tops, self.directions = pool, cfg, cache, tops, directions
        self.gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.key_index = _key_index(pool) if cfg.wants("token") else {}
        self.base = Counter({k: len(v) for k, v in self.key_index.items()})

    def draw(self, concepts: Sequence[Concept], ids: Sequence[int]) -> dict[int, Sample]:
        """Per latent in ``ids`` (ascending, each one of ``concepts``, consecutive latents): its positives and up
        to n_random + n_similar + n_token negatives."""
        if not concepts or not ids:
            return {}
        cfg, pool, gen, first = self.cfg, self.pool, self.gen, concepts[0].id
        similar = (similar_latents(self.directions, len(self.tops), first, first + len(concepts), cfg.similar_latents)
                   if cfg.wants("similar") else None)
        out = {}
        for j in ids:
            quiet = pool.quiet(j)
            picked: list[tuple[int, str]] = []
            taken: set[int] = set()

            def add(positions, kind, limit, picked=picked, taken=taken, quiet=quiet):
                for p in positions:
                    if len([k for _, k in picked if k == kind]) >= limit:
                        break
                    if quiet[p] and p not in taken:
                        taken.add(p)
                        picked.append((p, kind))

            if similar is not None:
                tops = [pool.index[r] for m in similar[j - first].tolist() for r in self.tops[m]]
                add(_shuffled(tops, gen), "similar", cfg.n_similar)
            if cfg.wants("token"):
                cands = {p for key in top_keys(pool, concepts[j - first], self.base) for p in self.key_index.get(key, ())}
                add(_shuffled(sorted(cands), gen), "token", cfg.n_token)
            if cfg.wants("random"):
                add(torch.randperm(len(pool.keys), generator=gen)[: 8 * cfg.n_random + 64].tolist(), "random",
                    cfg.n_random)
            rows = [int(pool.rows[p]) for p, _ in picked]
            out[j] = Sample(positives(concepts[j - first]), tuple(self.cache.example(r, 0.0) for r in rows),
                            tuple(k for _, k in picked))
        return out


def _shuffled(items: list[int], gen: torch.Generator) -> list[int]:
    return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]
