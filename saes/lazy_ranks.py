"""A block artifact read by several processes (``torchrun``), each rank only its own contiguous range of latents.

A :class:`~saes.lazy.LazyDictionary` (or ``LazyCLT``) opened with ``comm`` (``open_lazy(DIR, comm=...)``, the seam of
``saes.distributed.process_group_comm``) holds rank r of N's range of :func:`rank_range` -- ``[r span / N,
(r + 1) span / N)`` of its latents (a CLT's: of each layer's) -- and reads only blocks within it. With the stored
shard count (or a divisor or multiple of it) the ranges are the stored files' or unions or halves of them; any other
N cuts ranges across files, read from both. Its inference is collective (every rank calls it with the same rows) and
gives the whole dictionary's result on every rank, as latent shards do in training:

- per-row TopK (``KindSpec.shard_encode``): each rank's k best of its blocks, kept where they are among the row's k
  largest over every rank's (``kinds.common.shard_code``, the latent-sharded step's merge; a CLT's per layer);
- the reconstruction: each rank's partial decode, summed over the ranks (:func:`summed`), then ``b_dec`` (and the
  skip path) once;
- per-latent counts (``saes.evaluation``): each rank counts its latents, the counts are summed over the ranks.

What needs every latent on one process (``decoder_directions``, ``whole``, the cutoffs of naming, the weight metrics
of ``compare`` / ``--metrics core``, exports) is refused on a split dictionary (:func:`one_process`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .comm import Comm
from .kinds.common import shard_code


def rank_range(span: int, k: int, shards: Comm, what: str) -> tuple[int, int]:
    """Rank ``shards.rank`` of ``shards.size``'s latents ``[lo, hi)`` of ``span`` (a CLT's: of each layer), equal
    ranges to one latent; each must hold more than k latents (a block's TopK keeps k of them)."""
    n, r = shards.size, shards.rank
    if n > 1 and span // n <= k:
        raise ValueError(f"{n} ranks split the {span} latents of {what} into ranges of {span // n}, not more than "
                         f"k={k}: run on at most {max(1, span // (k + 1))} processes (torchrun --nproc-per-node)")
    return r * span // n, (r + 1) * span // n


def clip(files: list[tuple[Any, int, int]], lo: int, hi: int) -> list[tuple[Any, int, int]]:
    """The files' latent ranges (file, a, b) within ``[lo, hi)``, the files outside it left out."""
    return [(f, max(a, lo), min(b, hi)) for f, a, b in files if max(a, lo) < min(b, hi)]


def merged(values: Tensor, k: int, comm: Comm) -> Tensor:
    """This rank's candidates ``values`` [..., k] (each row's k best of its latents; a CLT's per row and layer) with
    those that are not among the row's k largest over every rank's set to 0 (``kinds.common.shard_code``);
    unchanged in one process."""
    if comm.shards.size == 1:
        return values
    return shard_code(values.reshape(-1, values.shape[-1]), k, comm).view(values.shape)


def summed(t: Tensor, comm: Comm) -> Tensor:
    """``t`` summed over the ranks (each rank's part of a sum: a partial decode, latent counts)."""
    return t if comm.shards.size == 1 else comm.shards.all_sum(t)


def one_process(model: Any, call: str) -> None:
    """Refuse ``call``, which reads every latent, on a dictionary split over ranks."""
    shards = model.comm.shards
    if shards.size > 1:
        lo, hi = model.part
        raise ValueError(f"{call} reads every latent of {model.path}, but rank {shards.rank} of {shards.size} holds "
                         f"only latents [{lo}, {hi}){' of each layer' if model.spec.layered else ''}: run it in one "
                         f"process (open_lazy without comm, or the command without torchrun)")


__all__ = ["clip", "merged", "one_process", "rank_range", "summed"]
