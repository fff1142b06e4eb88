"""``conceptdict compare`` of dictionaries read lazily (:class:`~saes.lazy.LazyDictionary`): the weight metrics and
the latent matching of :mod:`saes.compare` computed block against block, so that neither an [L_a, L_b] cosine matrix
nor a whole decoder is ever in memory.

A dictionary's latents come as **parts**: ``(first latent, read)`` pairs, ``read()`` giving the part's decoder rows
[n, S*D] (an in-memory dictionary is one part; a lazy one, one part per block, :attr:`LazyDictionary.blocks`). Every
quantity is a max / any over pairs of parts, each part cut into chunks of ``chunk`` rows, so its value equals the whole
computation's up to the order of a dot product's sums (1e-6 relative): each latent's best decoder cosine with another
latent of its dictionary, its split flag (a partner at decoder cosine >= ``SPLIT_COSINE`` it almost never fires with),
and each live latent's best cosine with the live latents of another dictionary. Which latents fire on the compared
rows is kept sparse (the (row, latent) pairs that fire), so co-firing counts cost the firings, not N x L.

Peak: two parts' decoders (the one read and the one held, as unit rows) plus [chunk, part] cosines, plus the firing
pairs (rows x L0 of them) and per-latent vectors [L].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .compare import NEAR_DUPLICATE, SPLIT_COSINE, SPLIT_JACCARD, encoder_decoder_cosine
from .lazy import LazyDictionary
from .lazy_ranks import one_process, summed
from .model import SparseCoder

Parts = list[tuple[int, Callable[[], Tensor]]]


def parts_of(model: LazyDictionary, tensor: str = "W_dec") -> Parts:
    """(first latent, read its rows [n, S*D] as float) of each block of a lazy dictionary: decoder rows, or with
    ``tensor="W_enc"`` encoder vectors (the columns of W_enc)."""
    one_process(model, "comparing latents block against block")

    def read(a: int, b: int) -> Tensor:
        w = getattr(model.latents(a, b), tensor).detach().float().cpu()
        return w.T if tensor == "W_enc" else w

    return [(a, (lambda a=a, b=b: read(a, b))) for a, b in model.blocks]


def max_other_cosines(model: LazyDictionary, tensor: str = "W_dec") -> Tensor:
    """``saes.compare.max_other_cosine`` of a lazy dictionary's decoder rows (or encoder vectors), block against
    block: each latent's largest cosine with another latent [L]."""
    return self_cosines(parts_of(model, tensor), model.n_latents)[0]


def _unit(w: Tensor) -> Tensor:
    return torch.nn.functional.normalize(w, dim=1)


class Firing:
    """Which latents fire on the compared rows, as the sorted (latent, row) pairs that do: ``columns(a, b)`` is the
    dense float [N, b - a] of latents [a, b) (what ``saes.compare.firing`` holds for all L at once)."""

    def __init__(self, latent: Tensor, row: Tensor, n_rows: int, n_latents: int):
        order = torch.argsort(latent * n_rows + row)
        self.latent, self.row, self.n_rows = latent[order], row[order], n_rows
        self.count = torch.bincount(latent, minlength=n_latents).float()
        self.live = self.count > 0

    def columns(self, a: int, b: int) -> Tensor:
        lo, hi = (int(torch.searchsorted(self.latent, v)) for v in (a, b))
        out = torch.zeros(self.n_rows, b - a)
        out[self.row[lo:hi], self.latent[lo:hi] - a] = 1.0
        return out


@torch.no_grad()
def lazy_firing(model: LazyDictionary, batches: Iterable[Tensor], max_rows: int) -> Firing:
    """:class:`Firing` of a lazy dictionary on the first ``max_rows`` rows (the inference rule over every block, as
    ``saes.compare.firing``'s)."""
    one_process(model, "lazy_firing()")
    latents, rows, n = [], [], 0
    for x in batches:
        inp, _ = model.split(model.flatten_batch(x.to(model.device, model.dtype)))
        inp = inp[: max_rows - n]
        for a, block, f in model.block_codes(inp):
            r, c = (f != 0).nonzero(as_tuple=True)
            rows.append(r.cpu() + n)
            latents.append(c.cpu() + a)
            del block, f
        n += inp.shape[0]
        if n >= max_rows:
            break
    return Firing(torch.cat(latents), torch.cat(rows), n, model.n_latents)


def _pairs(parts_a: Parts, parts_b: Parts | None, chunk: int) -> Iterable[tuple[int, Tensor, int, Tensor]]:
    """(first latent, unit rows) of each chunk of a's parts against (first latent, unit rows) of each of b's parts
    (b None: a's own): one part of each read at a time, each part of a read once."""
    for a, read in parts_a:
        ua = _unit(read())
        for b, read_b in parts_a if parts_b is None else parts_b:
            ub = ua if parts_b is None and b == a else _unit(read_b())
            for s in range(0, ua.shape[0], chunk):
                yield a + s, ua[s:s + chunk], b, ub
            del ub
        del ua


def self_cosines(parts: Parts, n_latents: int, fires: Firing | None = None, chunk: int = 1024
                 ) -> tuple[Tensor, Tensor]:
    """Per latent: its largest decoder cosine with another latent of the dictionary [L], and whether it has a split
    partner (``saes.compare.split_fraction``'s rule; all False without ``fires``) [L] bool. Each chunk against every
    part in turn."""
    best = torch.full((n_latents,), -math.inf)
    split = torch.zeros(n_latents, dtype=torch.bool)
    for start, ui, a, uj in _pairs(parts, None, chunk):
        stop, b = start + ui.shape[0], a + uj.shape[0]
        cos = ui @ uj.T
        if a < stop and start < b:  # the chunk's own latents: not their own partners
            r = torch.arange(max(start, a), min(stop, b))
            cos[r - start, r - a] = -math.inf
        best[start:stop] = torch.maximum(best[start:stop], cos.max(dim=1).values)
        near = None if fires is None else (cos >= SPLIT_COSINE) & fires.live[start:stop, None] & fires.live[None, a:b]
        if near is not None and near.any():
            both = fires.columns(start, stop).T @ fires.columns(a, b)
            jaccard = both / (fires.count[start:stop, None] + fires.count[None, a:b] - both).clamp_min(1)
            split[start:stop] |= (near & (jaccard <= SPLIT_JACCARD)).any(dim=1)
        del cos, near
    return best, split


def lazy_weights(model: LazyDictionary, fires: Firing) -> dict[str, float]:
    """``saes.compare``'s weight metrics of a lazy dictionary, block against block (module docstring)."""
    parts = parts_of(model)
    best, split = self_cosines(parts, model.n_latents, fires)
    enc_dec = torch.cat([encoder_decoder_cosine(model.latents(a, b)) for a, b in model.blocks])
    live = fires.live
    return {"decoder_max_cosine_mean": float(best.mean()), "decoder_max_cosine_max": float(best.max()),
            "near_duplicate_fraction": float((best > NEAR_DUPLICATE).float().mean()),
            "encoder_decoder_cosine_mean": float(enc_dec.mean()),
            "split_fraction": float(split[live].float().mean()) if int(live.sum()) >= 2 else 0.0}


def best_live_match(parts_a: Parts, live_a: Tensor, parts_b: Parts, live_b: Tensor, chunk: int = 1024) -> Tensor:
    """Each live latent of a (in latent order): its best decoder cosine with a live latent of b (-inf where b has
    none), as ``saes.compare.max_other_cosine`` of the live decoders, chunk against part."""
    best = torch.full((live_a.shape[0],), -math.inf)
    for start, ui, a, uj in _pairs(parts_a, parts_b, chunk):
        stop, b = start + ui.shape[0], a + uj.shape[0]
        rows, cols = live_a[start:stop], live_b[a:b]
        if rows.any() and cols.any():
            best[start:stop][rows] = torch.maximum(best[start:stop][rows], (ui[rows] @ uj[cols].T).max(dim=1).values)
    return best[live_a]


def tag_counts(model: SparseCoder | LazyDictionary, density: Tensor) -> dict[str, int]:
    """A two-source crosscoder's live latents per diff tag (``diffing.live_tag_counts``), block by block for a lazy
    dictionary (split over ranks: each rank counts its latents, the counts summed over the ranks)."""
    from .diffing import live_tag_counts

    if not isinstance(model, LazyDictionary):
        return live_tag_counts(model, density)
    parts = [live_tag_counts(model.latents(a, b), density[a:b]) for a, b in model.blocks]
    counts = summed(torch.tensor([[p[tag] for tag in parts[0]] for p in parts]).sum(0), model.comm)
    return dict(zip(parts[0], map(int, counts)))


__all__ = ["Firing", "best_live_match", "lazy_firing", "lazy_weights", "max_other_cosines", "parts_of", "self_cosines", "tag_counts"]
