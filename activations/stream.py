"""Training batches out of activation stores: shuffled across shards, deterministic, resumable.

How the order is made (a pure function of the seed, the row count and the sizes, never of the data):
rows are cut into blocks of consecutive rows; each epoch visits the blocks in a seeded random order;
blocks are poured into a mixing buffer of about ``buffer_rows`` rows, the buffer (plus the rows left
over from the previous fill) is permuted, and whole batches are cut from it. So one batch mixes rows
from many shards, memory stays bounded, and skipping ``start_batch`` batches needs no data reads.
With ``holdout_batches=n`` the rows of the first n batches (training's held-out evaluation rows) never
come again: later epochs leave them out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from conceptdict.activations.store import ActivationStore, StoreError

log = logging.getLogger(__name__)


def _sources(stores: Sequence[ActivationStore], hookpoints: Sequence[str]) -> list[tuple[ActivationStore, str]]:
    """Every (store, hookpoint) pair, stores outermost; all must share D."""
    pairs = [(s, h) for s in stores for h in hookpoints]
    dims = {(str(s.path), h): s.d_in(h) for s, h in pairs}
    if len(set(dims.values())) > 1:
        raise StoreError(f"aligned sources must share D, got {dims}; stream them separately")
    return pairs


def check_aligned(stores: Sequence[ActivationStore], chunk: int = 1 << 16) -> None:
    """Raise :class:`StoreError` unless every store holds the same rows (tokens, contexts, positions)."""
    first = stores[0]
    for other in stores[1:]:
        if other.num_rows != first.num_rows:
            raise StoreError(f"stores are not aligned: {first.path} has {first.num_rows} rows, {other.path} has "
                             f"{other.num_rows}; cache both models over the same dataset, context length and tokens")
        if other.level != first.level:
            raise StoreError(f"stores are not aligned: {first.path} is {first.level}-level, {other.path} is "
                             f"{other.level}-level")
        for start in range(0, first.num_rows, chunk):
            stop = min(first.num_rows, start + chunk)
            for what in ("tokens", "context_index", "position"):
                a, b = getattr(first, what)(start, stop), getattr(other, what)(start, stop)
                if not torch.equal(a, b):
                    row = start + int((a != b).nonzero()[0, 0])
                    raise StoreError(f"stores are not aligned: {what} differ at row {row} ({first.path}: "
                                     f"{int(a[row - start])}, {other.path}: {int(b[row - start])}); crosscoders "
                                     "need stores cached over the same tokens (same tokenizer, dataset, context length)")


def _block_size(buffer_rows: int, batch_size: int) -> int:
    return max(1, min(4096, buffer_rows // 16, max(batch_size, 64)))


def _index_plan(num_rows: int, batch_size: int, seed: int, epochs: int | None, buffer_rows: int,
                holdout: int = 0) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Yield (rows of this fill, batches of global row ids) per buffer fill; the rows of the first
    ``holdout`` batches are left out of every later epoch."""
    if holdout and holdout * batch_size >= num_rows:
        raise ValueError(f"holding out {holdout} batches of {batch_size} rows leaves none of the {num_rows} rows "
                         f"to train on; lower eval_batches or batch_size, or add data")
    block = _block_size(buffer_rows, batch_size)
    n_blocks = -(-num_rows // block)
    carry = np.empty(0, dtype=np.int64)
    held: list[np.ndarray] = []  # the held-out batches' rows, complete once `holdout` batches are out
    held_sorted = None
    epoch, fill, emitted = 0, 0, 0
    while epochs is None or epoch < epochs:
        order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
        per_fill = max(1, buffer_rows // block)
        if epoch > 0 and held and held_sorted is None:
            held_sorted = np.sort(np.concatenate(held))
        for i in range(0, n_blocks, per_fill):
            new = [np.arange(b * block, min(num_rows, (b + 1) * block)) for b in order[i:i + per_fill]]
            if held_sorted is not None:
                new = [r[~np.isin(r, held_sorted, assume_unique=True)] for r in new]
            ids = np.concatenate([carry, *new])
            ids = ids[np.random.default_rng([seed, epoch, fill, 1]).permutation(len(ids))]
            fill += 1
            n_full = len(ids) // batch_size
            carry = ids[n_full * batch_size:]
            batches = [ids[j * batch_size:(j + 1) * batch_size] for j in range(n_full)]
            held += batches[: max(0, holdout - emitted)]
            emitted += n_full
            yield ids[: n_full * batch_size], batches
        epoch += 1


def _gather(pairs: list[tuple[ActivationStore, str]], ids: np.ndarray) -> torch.Tensor:
    """Rows ``ids`` of every source as float32 [n, S, D], reading each covered contiguous run once."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    breaks = np.flatnonzero(np.diff(sorted_ids) > 1) + 1
    runs = np.split(sorted_ids, breaks)
    out = torch.empty(len(ids), len(pairs), pairs[0][0].d_in(pairs[0][1]), dtype=torch.float32)
    pos = 0
    for run in runs:
        start, stop = int(run[0]), int(run[-1]) + 1
        dest = torch.from_numpy(order[pos:pos + len(run)])
        for s, (store, hp) in enumerate(pairs):
            block = store.rows(hp, start, stop).to(torch.float32)
            out[dest, s] = block[torch.from_numpy(run - start)]
        pos += len(run)
    return out


def open_sources(stores: Sequence[ActivationStore] | ActivationStore, hookpoints: Sequence[str] | str,
                 batch_size: int, epochs: int | None, caller: str) -> tuple[list[tuple[ActivationStore, str]], int]:
    """(every (store, hookpoint) pair, rows per store) for a stream of ``batch_size`` batches over ``epochs``,
    after the checks every stream needs (``caller`` names the function in the errors)."""
    stores = [stores] if isinstance(stores, ActivationStore) else list(stores)
    hookpoints = [hookpoints] if isinstance(hookpoints, str) else list(hookpoints)
    if not stores or not hookpoints:
        raise ValueError(f"{caller} needs at least one store and one hookpoint")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for store in stores:  # a damaged shard stops the stream before its first batch, not halfway through
        store.verify_hashes()
    if len(stores) > 1:
        check_aligned(stores)
    pairs = _sources(stores, hookpoints)
    num_rows = stores[0].num_rows
    if num_rows == 0:
        raise ValueError(f"store {stores[0].path} is empty")
    if epochs is not None and num_rows * epochs < batch_size:
        raise ValueError(f"store {stores[0].path} has {num_rows} rows x {epochs} epochs, fewer than one batch of "
                         f"{batch_size}; lower batch_size or raise epochs")
    return pairs, num_rows


def rank_rows(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, stop) rows of a global batch that ``rank`` of ``world_size`` reads (contiguous, sizes
    differing by at most one)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if batch_size < world_size:
        raise ValueError(f"batch_size={batch_size} is below the number of ranks {world_size}: every rank needs "
                         "at least one row; raise --batch-size (it is the GLOBAL batch)")
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


def stream_batches(
    stores: Sequence[ActivationStore] | ActivationStore,
    hookpoints: Sequence[str] | str,
    batch_size: int,
    *,
    seed: int = 0,
    epochs: int | None = 1,
    buffer_rows: int = 65536,
    start_batch: int = 0,
    part: tuple[int, int] = (0, 1),
    holdout_batches: int = 0,
) -> Iterator[torch.Tensor]:
    """Shuffled float32 batches: [B, D] for one source, [B, S, D] for several.

    Sources are every (store, hookpoint) pair, stores outermost; several stores must hold the same tokens.
    Deterministic given ``seed``; ``epochs=None`` repeats forever; a last incomplete batch is dropped.
    ``start_batch`` skips exactly that many batches without reading them. ``part`` = (rank, world_size):
    yield only that rank's contiguous rows of every batch (:func:`rank_rows`), [B_r, ...]; the ranks together
    see exactly the batches of one process, and ``start_batch`` counts whole batches, so a run resumes under
    any number of ranks. ``holdout_batches``: the rows of the first that many batches never come again in
    later epochs (``saes.train`` evaluates on its first ``eval_batches`` batches, so training passes
    ``eval_batches`` here).
    """
    lo, hi = rank_rows(batch_size, *part)
    pairs, num_rows = open_sources(stores, hookpoints, batch_size, epochs, "stream_batches")
    squeeze = len(pairs) == 1
    index = 0  # batch index
    for _, batches in _index_plan(num_rows, batch_size, seed, epochs, max(buffer_rows, batch_size), holdout_batches):
        wanted = [b[lo:hi] for i, b in enumerate(batches, index) if i >= start_batch]
        index += len(batches)
        if not wanted:
            continue
        data = _gather(pairs, np.concatenate(wanted))
        for j in range(len(wanted)):
            batch = data[j * (hi - lo):(j + 1) * (hi - lo)]
            yield batch[:, 0] if squeeze else batch
