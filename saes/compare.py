"""Several dictionaries side by side on the same rows: what ``conceptdict compare`` reports.

Every dictionary sees the same store rows (its own hookpoints of them: a transcoder its input and output) and
is measured by :func:`saes.evaluate` (so its numbers equal ``conceptdict eval``'s on those rows), plus:

- **weight metrics**: each latent's largest decoder cosine with another latent of the same dictionary (mean
  over latents, and the share above 0.9: near-duplicates), and the cosine between each latent's encoder and
  decoder vectors (mean);
- **split fraction** (a feature splitting / absorption proxy): the share of live latents that have a partner
  in the same dictionary whose decoder cosine is at least ``SPLIT_COSINE`` (0.5) while the two almost never
  fire together (Jaccard of their firing sets on the rows at most ``SPLIT_JACCARD``, 0.05). One direction
  divided among mutually exclusive latents is what splitting leaves behind, and what absorption does to a
  general latent whose cases a more specific one takes over (Chanin et al. 2024, "A is for Absorption"). It
  is a proxy: it cannot tell a split from two genuinely different concepts that point the same way;
- **what each one sees**: latents matched across dictionaries by decoder cosine (each live latent's best
  cosine with the live latents of another dictionary; matched at >= ``match_threshold``), the count of live
  latents no other dictionary matches, and, where dictionaries carry names (concepts.json), the names only
  one of them found. Decoders are compared only within one space: dictionaries whose reconstruction targets
  the same hookpoint (a transcoder's is its output) with the same width;
- a **set of per-layer transcoders** (``train --layers``, a replacement model) is one entry: its evaluation is the
  layers' combined (:func:`combine_layers`: FVU over every layer, L0 the sum, per-layer FVU / L0 / dead), its weight
  metrics are each layer's (every latent compared within its own layer) pooled over the layers, and each layer's
  latents are matched in that layer's space (its output hookpoint): with the same layer of another set, or a
  dictionary of that hookpoint;
- the **FVU-L0 frontier**: the dictionaries no other beats on both FVU and L0.

Shapes: N rows, D width, L latents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .evaluation import EvalResult, combine_layers, evaluate
from .lazy import LazyDictionary
from .model import SparseCoder

SPLIT_COSINE = 0.5
SPLIT_JACCARD = 0.05
NEAR_DUPLICATE = 0.9


@dataclass
class Entry:
    """One dictionary to compare."""

    name: str
    model: SparseCoder
    batches: list[Tensor]
    """The compared rows as the dictionary reads them ([B, D], or [B, 2, D] for a transcoder)."""
    space: str
    """Where its decoder lives (the hookpoint it reconstructs); decoders are matched only within one space."""
    names: list[str] | None = None
    """Concept name per latent when the dictionary has been named."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to carry into the report (path, hookpoints)."""
    layers: list["Entry"] = field(default_factory=list)
    """A set of per-layer transcoders: one entry per layer (its transcoder, rows and space), in layer order;
    ``model`` and ``batches`` are then layer 0's."""


def _unit_rows(w: Tensor) -> Tensor:
    return torch.nn.functional.normalize(w.detach().float(), dim=1)


def max_other_cosine(a: Tensor, b: Tensor | None = None, chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """For each row of a [La, D]: the largest cosine with a row of b [Lb, D] and its index; with b None,
    with another row of a (itself excluded). Chunked: never an [La, Lb] matrix in memory."""
    ua = _unit_rows(a)
    ub = ua if b is None else _unit_rows(b)
    best, where = [], []
    for start in range(0, ua.shape[0], chunk):
        sims = ua[start:start + chunk] @ ub.T
        if b is None:
            rows = torch.arange(sims.shape[0])
            sims[rows, rows + start] = -math.inf
        value, index = sims.max(dim=1) if sims.shape[1] else (torch.full((sims.shape[0],), -math.inf),
                                                               torch.zeros(sims.shape[0], dtype=torch.long))
        best.append(value)
        where.append(index)
    return torch.cat(best), torch.cat(where)


def encoder_decoder_cosine(model: SparseCoder) -> Tensor:
    """cos(W_enc[:, j], W_dec[j]) per latent [L] (both over the flattened width; a cross-layer transcoder's decoder
    to its latent's own layer)."""
    dec = model.W_dec.detach().float()
    if model.spec.layered:  # encoder [D, L]; layer l's latents decode to block l of [L, S * D]
        D, P = model.d_in, model.n_latents // model.n_sources
        dec = torch.cat([dec[l * P:(l + 1) * P, l * D:(l + 1) * D] for l in range(model.n_sources)])
    return torch.nn.functional.cosine_similarity(model.W_enc.detach().T.float(), dec, dim=1)


@torch.no_grad()
def firing(model: SparseCoder, batches: list[Tensor], max_rows: int) -> Tensor:
    """bool [N, L]: which latents fire on each of the first ``max_rows`` rows (the inference rule)."""
    out, n = [], 0
    for x in batches:
        inp, _ = model.split(model.flatten_batch(x.to(model.device, model.dtype)))
        inp = inp[: max_rows - n]
        out.append(model.spec.encode(model, inp) != 0)
        n += inp.shape[0]
        if n >= max_rows:
            break
    return torch.cat(out).cpu()


def split_fraction(W_dec: Tensor, fires: Tensor, chunk: int = 1024) -> float:
    """Share of live latents with a partner of decoder cosine >= SPLIT_COSINE that they (almost) never fire with
    (Jaccard <= SPLIT_JACCARD; module docstring). fires: bool [N, L]."""
    live = fires.any(dim=0)
    if int(live.sum()) < 2:
        return 0.0
    f = fires.float()
    count = f.sum(dim=0)
    u = _unit_rows(W_dec)
    split = torch.zeros(W_dec.shape[0], dtype=torch.bool)
    for start in range(0, u.shape[0], chunk):
        stop = min(start + chunk, u.shape[0])
        cos = u[start:stop] @ u.T
        both = f[:, start:stop].T @ f  # co-firing counts [c, L]
        jaccard = both / (count[start:stop, None] + count[None, :] - both).clamp_min(1)
        pair = (cos >= SPLIT_COSINE) & (jaccard <= SPLIT_JACCARD) & live[start:stop, None] & live[None, :]
        pair[torch.arange(stop - start), torch.arange(start, stop)] = False
        split[start:stop] = pair.any(dim=1)
    return float(split[live].float().mean())


def _weights(e: Entry, fires: Tensor) -> dict[str, float]:
    m = e.model
    dec = m.W_dec.detach()
    best, _ = max_other_cosine(dec) if m.n_latents > 1 else (torch.zeros(1), None)
    return {"decoder_max_cosine_mean": float(best.mean()), "decoder_max_cosine_max": float(best.max()),
            "near_duplicate_fraction": float((best > NEAR_DUPLICATE).float().mean()),
            "encoder_decoder_cosine_mean": float(encoder_decoder_cosine(m).mean()),
            "split_fraction": split_fraction(dec, fires)}


def _measure(e: Entry, cofire_rows: int) -> tuple[EvalResult, dict[str, float]]:
    """(evaluation, weight metrics) of an entry; a set's pooled over its layers (module
    docstring: live counts weight the split fraction, latent counts the other means). A dictionary read lazily is
    measured block by block (``saes.lazy_compare``)."""
    if isinstance(e.model, LazyDictionary):
        from .lazy_compare import lazy_firing, lazy_weights

        return evaluate(e.model, e.batches), lazy_weights(e.model, lazy_firing(e.model, e.batches, cofire_rows))
    if not e.layers:
        result = evaluate(e.model, e.batches)
        return result, _weights(e, firing(e.model, e.batches, cofire_rows))
    parts = [evaluate(sub.model, sub.batches) for sub in e.layers]
    result = combine_layers(parts, f"{e.model.kind} x {len(parts)} layers")
    each = [_weights(sub, firing(sub.model, sub.batches, cofire_rows)) for sub in e.layers]
    sizes = [sub.model.n_latents for sub in e.layers]
    live = [sum(d > 0 for d in r.density) for r in parts]

    def pooled(key: str, by: list[int]) -> float:
        return sum(w[key] * n for w, n in zip(each, by)) / max(sum(by), 1)

    weights = {key: pooled(key, sizes) for key in each[0]}
    weights["decoder_max_cosine_max"] = max(w["decoder_max_cosine_max"] for w in each)
    weights["split_fraction"] = pooled("split_fraction", live)
    return result, weights


def _blocks(e: Entry, live: Tensor) -> list[tuple[str, int, list, Tensor]]:
    """(space, width, parts, live) of an entry, in its latent order: one block, or one per layer of a set; parts
    (``saes.lazy_compare``): the whole decoder as one part, or a lazy dictionary's blocks, read when matched."""
    from .lazy_compare import parts_of

    subs = e.layers or [e]
    out, start = [], 0
    for sub in subs:
        m, n = sub.model, sub.model.n_latents
        parts = parts_of(m) if isinstance(m, LazyDictionary) else [(0, lambda m=m: m.W_dec.detach().float().cpu())]
        out.append((sub.space, m.n_sources * m.d_in, parts, live[start:start + n]))
        start += n
    return out


def _best_match(a: list[tuple[str, int, list, Tensor]], b: list[tuple[str, int, list, Tensor]]) -> Tensor | None:
    """Each live latent of a's blocks: its best decoder cosine with a live latent of b's blocks in the same space and
    width (-inf where b has none there); None when no block of a shares a space with one of b. Part against part
    (``saes.lazy_compare.best_live_match``): never an [L_a, L_b] matrix."""
    from .lazy_compare import best_live_match

    parts, shared = [], False
    for space, width, dirs, live in a:
        best = torch.full((int(live.sum()),), -math.inf)
        for space_b, width_b, dirs_b, live_b in b:
            if space == space_b and width == width_b:
                shared = True
                if best.numel() and live_b.any():
                    best = torch.maximum(best, best_live_match(dirs, live, dirs_b, live_b))
        parts.append(best)
    return torch.cat(parts) if shared else None


def frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """Names whose (L0, FVU) no other point beats on both (lower is better; ties do not beat)."""
    def beaten(p):
        return any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points.values())
    return [n for n, p in points.items() if all(math.isfinite(v) for v in p) and not beaten(p)]


def compare(entries: list[Entry], match_threshold: float = 0.7, cofire_rows: int = 4096) -> dict[str, Any]:
    """The comparison as a JSON-able dict (module docstring): per dictionary its evaluation (``metrics``, an
    EvalResult dict) and ``weights``; ``matches[a][b]``: the share of a's live latents that b matches;
    ``unique_latents`` / ``unique_names`` per dictionary; ``frontier``."""
    if len({e.name for e in entries}) != len(entries):
        raise ValueError(f"dictionaries need distinct names, got {[e.name for e in entries]}")
    rows: dict[str, Any] = {}
    blocks: dict[str, list[tuple[str, int, Tensor]]] = {}
    lives: dict[str, list[bool]] = {}
    for e in entries:
        result, weights = _measure(e, cofire_rows)
        live = torch.tensor(result.density) > 0
        lives[e.name] = live.tolist()
        blocks[e.name] = _blocks(e, live)
        rows[e.name] = {"name": e.name, "kind": result.kind if e.layers else e.model.kind,
                        "n_latents": result.n_latents, "k": e.model.k, "space": e.space, **e.info,
                        "metrics": result.to_dict(), "weights": weights, "live_latents": int(live.sum())}
        if e.model.n_sources == 2 and e.model.spec.sources == "several":  # a crosscoder's live latents per diff tag
            from .lazy_compare import tag_counts

            rows[e.name]["latent_tags"] = tag_counts(e.model, torch.tensor(result.density))
    matches: dict[str, dict[str, float]] = {}
    best_elsewhere = {e.name: torch.full((rows[e.name]["live_latents"],), -math.inf) for e in entries}
    for a in entries:
        matches[a.name] = {}
        for b in entries:
            best = None if a is b else _best_match(blocks[a.name], blocks[b.name])
            if best is None:
                continue
            matches[a.name][b.name] = float((best >= match_threshold).float().mean()) if best.numel() else 0.0
            best_elsewhere[a.name] = torch.maximum(best_elsewhere[a.name], best)
    for e in entries:
        has_peer = bool(matches[e.name])
        rows[e.name]["unique_latents"] = int((best_elsewhere[e.name] < match_threshold).sum()) if has_peer else None
    _unique_names(entries, rows, lives)
    points = {n: (r["metrics"]["l0"], r["metrics"]["fvu"]) for n, r in rows.items()}
    return {"match_threshold": match_threshold, "split_cosine": SPLIT_COSINE, "split_jaccard": SPLIT_JACCARD,
            "n_rows": next(iter(rows.values()))["metrics"]["n_tokens"] if rows else 0,
            "dictionaries": list(rows.values()), "matches": matches, "frontier": frontier(points)}


def _unique_names(entries: list[Entry], rows: dict[str, Any], lives: dict[str, list[bool]],
                  examples: int = 20) -> None:
    """Names (of live latents, case-folded) each named dictionary found that no other named one did."""
    named = {}
    for e in entries:
        if e.names is not None:
            named[e.name] = {n.strip().lower() for n, ok in zip(e.names, lives[e.name]) if ok and n and n.strip()}
    for e in entries:
        if e.name not in named or len(named) < 2:
            rows[e.name]["unique_names"] = None
            continue
        others = set().union(*(v for k, v in named.items() if k != e.name))
        only = sorted(named[e.name] - others)
        rows[e.name]["unique_names"] = {"count": len(only), "examples": only[:examples]}


def comparison_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per dictionary of a :func:`compare` result, what a table of them shows: name, kind, n_latents, k,
    space, where it came from, live_latents, unique_latents, on_frontier, every metric and weight metric as its own
    key, latent_tags, unique_names (the count) and matched (other dictionary -> the share of its live latents that
    one matches)."""
    rows = []
    for r in result["dictionaries"]:
        row = {k: v for k, v in r.items() if k not in ("metrics", "weights", "unique_names")}
        row["on_frontier"] = r["name"] in result["frontier"]
        row.update({k: v for k, v in r["metrics"].items() if k not in row})
        row.update(r["weights"])
        row["unique_names"] = (r.get("unique_names") or {}).get("count")
        row["matched"] = result["matches"].get(r["name"], {})
        rows.append(row)
    return rows
