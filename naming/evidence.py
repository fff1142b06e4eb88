"""Evidence per latent, streamed over an activation store and a dictionary (never all rows at once).

Two passes over the store's rows, each chunk encoded through the dictionary:

1. firing counts, activation sums, maxima and the top-k rows of every latent (a running ``topk`` merge);
2. a histogram of each latent's nonzero activations over ``[0, max]`` and, per histogram bin, one row drawn
   uniformly at random (the row with the largest random key, a hash of (seed, row, latent)), from which the quantile
   examples are taken.

Every record of a latent depends on that latent's codes alone (the random keys too), so evidence gathered over a
range of latents (``first``; a lazily read dictionary's block, with the whole TopK's per-row ``cutoff``) equals the
whole dictionary's for those latents.

Shapes: N store rows, n rows in a chunk, D d_in, L latents, K top examples, Q quantiles, M negatives.
"""

from __future__ import annotations

import logging
from typing import Iterator, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .concepts import Example
from .protocols import Store

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """What evidence needs from a dictionary (``conceptdict.saes.SparseCoder`` satisfies it)."""

    def encode(self, x: Tensor) -> Tensor: ...  # [n, D] or [n, S, D] -> [n, L]


class LatentEvidence(NamedTuple):
    """Streaming statistics of every latent over a store."""

    num_rows: int
    count: Tensor  # [L] int64, rows where the latent fires (> 0)
    frequency: Tensor  # [L] count / num_rows
    max: Tensor  # [L]
    mean: Tensor  # [L] mean activation over all rows
    mean_active: Tensor  # [L] mean over rows where it fires
    std_active: Tensor  # [L]
    top_values: Tensor  # [L, K] descending; 0 where fewer than K rows fire
    top_rows: Tensor  # [L, K] int64; -1 where fewer than K rows fire
    hist_edges: Tensor  # [L, n_bins + 1], linear over [0, max]
    hist_counts: Tensor  # [L, n_bins] int64
    quantile_levels: Tensor  # [Q]
    quantile_values: Tensor  # [L, Q] activation at each quantile of the nonzero activations (from the histogram)
    quantile_rows: Tensor  # [L, Q] int64, a row whose activation lies in the quantile's bin; -1 if none
    quantile_row_values: Tensor  # [L, Q] the activation of that row
    negative_rows: Tensor  # [L, M] int64, random rows where the latent is 0; -1 if too few


def iter_inputs(store: Store, hookpoints: Sequence[str], chunk: int) -> Iterator[tuple[int, Tensor]]:
    """(start row, [n, D]) for one hookpoint, (start row, [n, S, D]) for several, float32, in row order."""
    if len(hookpoints) == 1:
        for start, x in store.iter_rows(hookpoints[0], chunk):
            yield start, x.float()
        return
    iters = [store.iter_rows(h, chunk) for h in hookpoints]
    for parts in zip(*iters):
        starts = {p[0] for p in parts}
        if len(starts) != 1:
            raise ValueError(f"hookpoints {list(hookpoints)} are not row-aligned in {store.path}: starts {starts}")
        yield parts[0][0], torch.stack([p[1].float() for p in parts], dim=1)


MASK = 0xFFFFFFFF


def _mix(x: Tensor) -> Tensor:
    """A bijection of 32-bit integers (int64 [..] < 2^32) that scatters neighbours (products stay below 2^63)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK
    return (x >> 16) ^ x


def random_keys(rows: Tensor, latents: Tensor, seed: int) -> Tensor:
    """A number in [0, 1) per (row, latent) (broadcast; float64), uniform-looking and the same whichever chunk of
    rows or range of latents it is drawn in; distinct over the rows of one latent (rows below 2^32)."""
    base = _mix(torch.tensor(seed & MASK, dtype=torch.int64))
    return _mix(_mix(base ^ (rows & MASK)) ^ (latents & MASK)).double() / 2.0 ** 32


class Codes:
    """The codes evidence reads: ``encoder.encode(x)`` in float32, with entries below ``cutoff[row]`` zeroed
    (:meth:`conceptdict.saes.lazy.LazyDictionary.cutoffs`: a block's latents under the whole dictionary's TopK)."""

    def __init__(self, encoder: Encoder, device: torch.device, cutoff: Tensor | None = None) -> None:
        self.encoder, self.device, self.cutoff = encoder, device, cutoff

    def __call__(self, x: Tensor, rows: Tensor) -> Tensor:
        with torch.no_grad():
            f = self.encoder.encode(x.to(self.device)).float()
        if self.cutoff is None:
            return f
        return torch.where(f >= self.cutoff[rows].to(self.device)[:, None], f, 0.0)


def _merge_topk(vals: Tensor, rows: Tensor, f: Tensor, start: int, k: int) -> tuple[Tensor, Tensor]:
    """Merge chunk codes f [n, L] into the running top-k (vals, rows) [L, K]."""
    n = f.shape[0]
    chunk_rows = torch.arange(start, start + n, device=f.device).expand(f.shape[1], n)
    all_vals = torch.cat([vals, f.T], dim=1)
    all_rows = torch.cat([rows, chunk_rows], dim=1)
    top = torch.topk(all_vals, min(k, all_vals.shape[1]), dim=1)
    return top.values, torch.gather(all_rows, 1, top.indices)


def _first_pass(codes: Codes, store, hookpoints, top_k, chunk, device):
    count = total = total_sq = maxv = vals = rows = None
    n_rows = 0
    for start, x in tqdm(iter_inputs(store, hookpoints, chunk), desc="evidence 1/2", leave=False):
        f = codes(x, torch.arange(start, start + x.shape[0]))
        if count is None:
            L = f.shape[1]
            count = torch.zeros(L, dtype=torch.int64, device=device)
            total = torch.zeros(L, dtype=torch.float64, device=device)
            total_sq = torch.zeros(L, dtype=torch.float64, device=device)
            maxv = torch.zeros(L, device=device)
            vals = torch.zeros(L, 0, device=device)
            rows = torch.zeros(L, 0, dtype=torch.int64, device=device)
        count += (f > 0).sum(0)
        total += f.sum(0, dtype=torch.float64)
        total_sq += (f.double() ** 2).sum(0)
        maxv = torch.maximum(maxv, f.max(0).values)
        vals, rows = _merge_topk(vals, rows, f, start, top_k)
        n_rows += f.shape[0]
    if count is None:
        raise ValueError(f"store {store.path} has no rows for hookpoints {list(hookpoints)}; cache some data first")
    rows = torch.where(vals > 0, rows, torch.full_like(rows, -1))
    vals = vals.clamp_min(0)
    if vals.shape[1] < top_k:  # fewer rows than K
        pad = top_k - vals.shape[1]
        vals = torch.cat([vals, vals.new_zeros(vals.shape[0], pad)], 1)
        rows = torch.cat([rows, rows.new_full((rows.shape[0], pad), -1)], 1)
    return n_rows, count, total, total_sq, maxv, vals, rows


def _second_pass(codes: Codes, store, hookpoints, maxv, n_bins, chunk, device, first, seed):
    L = maxv.shape[0]
    counts = torch.zeros(L * n_bins, dtype=torch.int64, device=device)
    res_key = torch.full((L * n_bins,), -1.0, dtype=torch.float64, device=device)
    res_row = torch.full((L * n_bins,), -1, dtype=torch.int64, device=device)
    res_val = torch.zeros(L * n_bins, device=device)
    safe_max = torch.where(maxv > 0, maxv, torch.ones_like(maxv))
    for start, x in tqdm(iter_inputs(store, hookpoints, chunk), desc="evidence 2/2", leave=False):
        f = codes(x, torch.arange(start, start + x.shape[0]))
        r, j = torch.nonzero(f > 0, as_tuple=True)
        if r.numel() == 0:
            continue
        a = f[r, j]
        b = (a / safe_max[j] * n_bins).long().clamp_(0, n_bins - 1)
        flat = j * n_bins + b
        counts.index_add_(0, flat, torch.ones_like(flat))
        key = random_keys((r + start).cpu(), (j + first).cpu(), seed).to(device)
        best = res_key.new_full((L * n_bins,), -1.0).scatter_reduce(0, flat, key, "amax")
        win = key == best[flat]
        wflat, wrow, wval, wkey = flat[win], r[win] + start, a[win], key[win]
        better = wkey > res_key[wflat]
        wflat, wrow, wval, wkey = wflat[better], wrow[better], wval[better], wkey[better]
        res_key[wflat], res_row[wflat], res_val[wflat] = wkey, wrow, wval
    return counts.view(L, n_bins), res_row.view(L, n_bins), res_val.view(L, n_bins)


def _quantiles(hist: Tensor, edges: Tensor, levels: Tensor) -> tuple[Tensor, Tensor]:
    """Quantile values [L, Q] by linear interpolation of the histogram CDF, and the bin of each [L, Q]."""
    cdf = hist.cumsum(1).double()
    total = cdf[:, -1:].clamp_min(1)
    target = levels.double()[None, :] * total  # [L, Q]
    bins = torch.searchsorted(cdf.contiguous(), target.contiguous()).clamp_(0, hist.shape[1] - 1)
    prev = torch.where(bins > 0, torch.gather(cdf, 1, (bins - 1).clamp_min(0)), torch.zeros_like(target))
    inbin = torch.gather(hist, 1, bins).double().clamp_min(1)
    frac = ((target - prev) / inbin).clamp(0, 1)
    lo = torch.gather(edges, 1, bins).double()
    hi = torch.gather(edges, 1, bins + 1).double()
    return (lo + frac * (hi - lo)).float(), bins


def _negatives(codes: Codes, store, hookpoints, n_neg, L, first, seed) -> Tensor:
    """[L, M] random rows where each latent is zero (drawn from a random sample of rows, the same for every
    latent)."""
    out = torch.full((L, n_neg), -1, dtype=torch.int64)
    if n_neg == 0:
        return out
    n_cand = min(store.num_rows, 8 * n_neg + 64)
    cand = torch.randperm(store.num_rows, generator=torch.Generator().manual_seed(seed))[:n_cand].sort().values
    xs = [torch.stack([store.rows(h, int(r), int(r) + 1)[0].float() for h in hookpoints], 0) for r in cand]
    x = torch.stack(xs, 0)
    x = x[:, 0] if len(hookpoints) == 1 else x
    f = codes(x, cand).cpu()  # [C, L]
    zero = (f <= 0).T  # [L, C]
    keys = random_keys(cand[None, :], torch.arange(first, first + L)[:, None], seed)
    order = keys + zero.double() * 2  # zero rows first, random order
    pick = order.topk(min(n_neg, n_cand), dim=1).indices
    ok = torch.gather(zero, 1, pick)
    out[:, : pick.shape[1]] = torch.where(ok, cand[pick], torch.full_like(pick, -1))
    return out


def collect_evidence(
    encoder: Encoder,
    store: Store,
    hookpoints: Sequence[str] | str,
    *,
    top_k: int = 20,
    n_bins: int = 32,
    quantile_levels: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    n_negatives: int = 0,
    chunk: int = 4096,
    seed: int = 0,
    device: str | torch.device = "cpu",
    first: int = 0,
    cutoff: Tensor | None = None,
) -> LatentEvidence:
    """Stream ``store`` through ``encoder`` twice and gather per-latent statistics and example rows. ``first``: the
    id of the encoder's first latent in the whole dictionary (it seeds the latents' random draws); ``cutoff``: per
    store row, the least code kept (others are zeroed: module docstring)."""
    hookpoints = [hookpoints] if isinstance(hookpoints, str) else list(hookpoints)
    device = torch.device(device)
    codes = Codes(encoder, device, cutoff)
    n, count, total, total_sq, maxv, top_vals, top_rows = _first_pass(codes, store, hookpoints, top_k, chunk, device)
    hist, q_rows_bin, q_vals_bin = _second_pass(codes, store, hookpoints, maxv, n_bins, chunk, device, first, seed)
    steps = torch.linspace(0, 1, n_bins + 1, device=device)
    edges = maxv[:, None] * steps[None, :]
    levels = torch.tensor(list(quantile_levels), dtype=torch.float32, device=device)
    q_vals, q_bins = _quantiles(hist, edges, levels)
    active = count.clamp_min(1).double()
    mean_active = total / active
    var = (total_sq / active - mean_active**2).clamp_min(0)
    L = count.shape[0]
    ev = LatentEvidence(
        num_rows=n,
        count=count.cpu(),
        frequency=(count.double() / max(n, 1)).float().cpu(),
        max=maxv.cpu(),
        mean=(total / max(n, 1)).float().cpu(),
        mean_active=mean_active.float().cpu(),
        std_active=var.sqrt().float().cpu(),
        top_values=top_vals.cpu(),
        top_rows=top_rows.cpu(),
        hist_edges=edges.cpu(),
        hist_counts=hist.cpu(),
        quantile_levels=levels.cpu(),
        quantile_values=torch.where(count[:, None] > 0, q_vals, torch.zeros_like(q_vals)).cpu(),
        quantile_rows=torch.gather(q_rows_bin, 1, q_bins).cpu(),
        quantile_row_values=torch.gather(q_vals_bin, 1, q_bins).cpu(),
        negative_rows=_negatives(codes, store, hookpoints, n_negatives, L, first, seed),
    )
    log.info("evidence over %d rows: %d of %d latents fire at least once", n, int((count > 0).sum()), L)
    return ev


class ContextCache:
    """Memoises ``store.row_context`` so that rows shared between latents are rebuilt once."""

    def __init__(self, store: Store, before: int = 8, after: int = 4) -> None:
        self.store, self.before, self.after = store, before, after
        self._cache: dict[int, object] = {}

    def context(self, row: int):
        if row not in self._cache:
            self._cache[row] = self.store.row_context(row, before=self.before, after=self.after)
        return self._cache[row]

    def example(self, row: int, activation: float) -> Example:
        ctx = self.context(row)
        return Example(
            row=int(row),
            activation=float(activation),
            tokens=tuple(str(t) for t in ctx.tokens),
            marked=int(ctx.marked),
            text=str(ctx.text),
        )

    def examples(self, rows: Tensor, values: Tensor) -> tuple[Example, ...]:
        """Examples for rows [n] with activations [n]; rows of -1 are skipped."""
        return tuple(self.example(int(r), float(v)) for r, v in zip(rows.tolist(), values.tolist()) if r >= 0)


class LogitLens(NamedTuple):
    top_ids: Tensor  # [L, k] token ids most promoted by each direction
    top_values: Tensor  # [L, k]
    bottom_ids: Tensor  # [L, k] most suppressed
    bottom_values: Tensor  # [L, k]


def logit_lens(directions: Tensor, unembed: Tensor, k: int = 10, chunk: int = 256) -> LogitLens:
    """Top/bottom tokens of ``directions [L, D] @ unembed [D, V]``, computed ``chunk`` latents at a time."""
    if directions.shape[-1] != unembed.shape[0]:
        raise ValueError(
            f"directions have D={directions.shape[-1]} but the unembedding is {tuple(unembed.shape)}; "
            "the logit lens needs the dictionary's hookpoint to live in the residual stream of the same model"
        )
    k = min(k, unembed.shape[1])
    parts = []
    for i in range(0, directions.shape[0], chunk):
        logits = directions[i : i + chunk].float() @ unembed.float()
        top, bot = logits.topk(k, dim=1), logits.topk(k, dim=1, largest=False)
        parts.append((top.indices, top.values, bot.indices, bot.values))
    return LogitLens(*(torch.cat([p[i] for p in parts]) for i in range(4)))
