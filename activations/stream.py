"""Training batches out of activation stores: shuffled across shards, deterministic, resumable.

How the order is made (a pure function of the seed, the row count and the sizes, never of the data):
rows are cut into blocks of consecutive rows; each epoch visits the blocks in a seeded random order;
blocks are poured into a mixing buffer of about ``buffer_rows`` rows, the buffer (plus the rows left
over from the previous fill) is permuted, and whole batches are cut from it. So one batch mixes rows
from many shards, memory stays bounded, and skipping ``start_batch`` batches needs no data reads.
With ``holdout_batches=n`` the rows of the first n batches (training's held-out evaluation rows) never
come again: later epochs leave them out.

How the rows move: a background thread reads and shuffles the next fill (:func:`prefetched`) while the
caller trains on the current one; rows travel in the store's dtype and are converted where they are used
(on the CPU while gathering, on a GPU after a ``non_blocking`` copy out of pinned memory).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from conceptdict.activations.store import ActivationStore, StoreError

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def _gather(pairs: list[tuple[ActivationStore, str]], ids: np.ndarray, dtype: torch.dtype,
            pin: bool = False) -> torch.Tensor:
    """Rows ``ids`` of every source as ``dtype`` [n, S, D] (in pinned memory with ``pin``), reading each covered
    contiguous run once and copying it straight to its rows of the output."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    breaks = np.flatnonzero(np.diff(sorted_ids) > 1) + 1
    runs = np.split(sorted_ids, breaks)
    out = torch.empty(len(ids), len(pairs), pairs[0][0].d_in(pairs[0][1]), dtype=dtype, pin_memory=pin)
    pos = 0
    for run in runs:  # consecutive row ids, a row twice where an epoch's carry meets the next epoch
        start, stop = int(run[0]), int(run[-1]) + 1
        dest = torch.from_numpy(order[pos:pos + len(run)])
        pick = None if len(run) == stop - start else torch.from_numpy(run - start)
        for s, (store, hp) in enumerate(pairs):
            block = store.rows(hp, start, stop)
            out[dest, s] = (block if pick is None else block[pick]).to(dtype)
        pos += len(run)
    return out


def prefetched(items: Iterator[T], depth: int) -> Iterator[T]:
    """``items``, produced up to ``depth`` ahead by a background thread (``depth=0``: in the caller's thread).
    An exception in the thread is raised here, at the item it replaced; closing the iterator stops the thread."""
    if depth < 1:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, exc))

    thread = threading.Thread(target=work, name="stream-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        thread.join()


def source_dtype(pairs: list[tuple[ActivationStore, str]]) -> torch.dtype:
    """The dtype the rows travel in: the stores' own when they share one, else float32."""
    dtypes = {store.dtype for store, _ in pairs}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


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
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = torch.float32,
    prefetch: int = 1,
) -> Iterator[torch.Tensor]:
    """Shuffled batches: [B, D] for one source, [B, S, D] for several.

    Sources are every (store, hookpoint) pair, stores outermost; several stores must hold the same tokens.
    Deterministic given ``seed``; ``epochs=None`` repeats forever; a last incomplete batch is dropped.
    ``start_batch`` skips exactly that many batches without reading them. ``part`` = (rank, world_size):
    yield only that rank's contiguous rows of every batch (:func:`rank_rows`), [B_r, ...]; the ranks together
    see exactly the batches of one process, and ``start_batch`` counts whole batches, so a run resumes under
    any number of ranks. ``holdout_batches``: the rows of the first that many batches never come again in
    later epochs (``saes.train`` evaluates on its first ``eval_batches`` batches, so training passes
    ``eval_batches`` here).

    Batches are made on ``device`` (default CPU) as ``dtype`` (None: the store's dtype). ``prefetch`` buffer
    fills are read and shuffled ahead by a background thread while the caller works on the current one (0:
    read in the caller's thread; the batches are the same). On CUDA a fill is gathered into pinned memory
    in the store's dtype, each batch is copied with ``non_blocking`` and converted on the device.
    """
    lo, hi = rank_rows(batch_size, *part)
    pairs, num_rows = open_sources(stores, hookpoints, batch_size, epochs, "stream_batches")
    device = torch.device(device or "cpu")
    on_cpu = device.type == "cpu"
    wire = (dtype or source_dtype(pairs)) if on_cpu else source_dtype(pairs)  # CPU: converted while gathering
    squeeze = len(pairs) == 1
    plan = _index_plan(num_rows, batch_size, seed, epochs, max(buffer_rows, batch_size), holdout_batches)

    def fills() -> Iterator[tuple[torch.Tensor, int]]:
        index = 0  # batch index
        for _, batches in plan:
            wanted = [b[lo:hi] for i, b in enumerate(batches, index) if i >= start_batch]
            index += len(batches)
            if wanted:
                pin = device.type == "cuda" and torch.cuda.is_available()
                yield _gather(pairs, np.concatenate(wanted), wire, pin=pin), len(wanted)

    for data, n in prefetched(fills(), prefetch):
        for j in range(n):
            batch = data[j * (hi - lo):(j + 1) * (hi - lo)]
            if not on_cpu:
                batch = batch.to(device, non_blocking=True)
            if dtype is not None:
                batch = batch.to(dtype)
            yield batch[:, 0] if squeeze else batch


def heldout_recipe(stores: Sequence[ActivationStore], hookpoints: Sequence[str], batch_size: int, seed: int,
                   batches: int, buffer_rows: int) -> dict:
    """What a training run records of the batches it held out (its first ``batches`` batches of the stream
    ``stream_batches(stores, hookpoints, batch_size, seed=seed, buffer_rows=buffer_rows)``), so that
    :func:`heldout_batches` can rebuild them: rows training never saw."""
    return {"stores": [str(s.path.resolve()) for s in stores], "hookpoints": list(hookpoints),
            "batch_size": int(batch_size), "seed": int(seed), "batches": int(batches), "buffer_rows": int(buffer_rows)}


def heldout_batches(recipe: dict | None, store: ActivationStore | Sequence[ActivationStore],
                    hookpoints: Sequence[str], rows: int) -> Iterator[torch.Tensor] | None:
    """The held-out batches of ``recipe`` (:func:`heldout_recipe`) read at ``hookpoints`` of ``store`` (or of
    several stores over the same tokens, a crosscoder's; the rows do not depend on the hookpoints read), at most
    ``rows`` rows; None when there is no recipe, it held nothing out, or it was recorded for other stores."""
    stores = list(store) if isinstance(store, (list, tuple)) else [store]
    if not recipe or not recipe.get("batches") or recipe.get("stores") != [str(s.path.resolve()) for s in stores]:
        return None
    n = min(int(recipe["batches"]), max(1, rows // int(recipe["batch_size"])))
    stream = stream_batches(stores, list(hookpoints), int(recipe["batch_size"]), seed=int(recipe["seed"]), epochs=1,
                            buffer_rows=int(recipe.get("buffer_rows", 65536)))
    return itertools.islice(stream, n)


def heldout_row_ids(recipe: dict | None, store: ActivationStore) -> np.ndarray | None:
    """The store rows (ids, sorted) of ``recipe``'s held-out batches (:func:`heldout_recipe`): the rows
    :func:`heldout_batches` reads; None when there is no recipe, it held nothing out, or it was recorded for another
    store."""
    if not recipe or not recipe.get("batches") or recipe.get("stores") != [str(store.path.resolve())]:
        return None
    want, size, got = int(recipe["batches"]), int(recipe["batch_size"]), []
    plan = _index_plan(store.num_rows, size, int(recipe["seed"]), 1, max(int(recipe.get("buffer_rows", 65536)), size))
    for _, batches in plan:
        got += batches[: want - len(got)]
        if len(got) >= want:
            break
    return np.sort(np.concatenate(got)) if got else None


def first_batches(store: ActivationStore | Sequence[ActivationStore], hookpoints: Sequence[str], rows: int,
                  batch_size: int) -> Iterator[torch.Tensor]:
    """The first ``rows`` rows in batches: [B, D] for one hookpoint, [B, 2, D] (input, output) for a transcoder's
    two, [B, S, D] for a crosscoder's sources (every (store, hookpoint) pair, stores outermost, as
    :func:`stream_batches` orders them)."""
    stores = list(store) if isinstance(store, (list, tuple)) else [store]
    stop = min([rows] + [s.num_rows for s in stores])
    for start in range(0, stop, batch_size):
        parts = [s.rows(h, start, min(start + batch_size, stop)).float() for s in stores for h in hookpoints]
        yield parts[0] if len(parts) == 1 else torch.stack(parts, dim=1)
