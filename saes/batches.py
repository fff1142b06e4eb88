"""The training data as the loop reads it: checked batches, the held-out batches, the first rows.

``train`` takes any iterable of ``[B, D]`` / ``[B, S, D]`` tensors, or a function ``start_batch ->`` such an
iterable (so that ``resume`` skips without reading). Under several processes each yields this process's
part of every batch (``activations.stream_batches(..., part=(rank, world_size))``); the batches the loop
needs whole (the held-out ones, the rows that initialise b_dec and the scale) are gathered through the seam.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import Tensor

from .comm import Comm

Batches = Iterable[Tensor] | Callable[[int], Iterable[Tensor]]
"""Training data: an iterable of [B, D] / [B, S, D] tensors, or a function start_batch -> such an iterable
that starts at that batch (lets ``resume`` skip without reading, e.g. ``stream_batches(start_batch=...)``)."""


class TrainingData(NamedTuple):
    """The data of a run as :func:`open_training_data` splits it."""

    held_out: list[Tensor]
    """The first ``eval_batches`` batches, whole, for the final evaluation."""
    calibration: list[Tensor]
    """The next ``calibration_batches`` batches, whole, never trained on: the inference threshold is set on them."""
    head: list[Tensor]
    """This process's parts of the first training batches (read to initialise a fresh run)."""
    whole_head: list[Tensor]
    """The same batches whole (b_dec and the normalisation scale come from them; the model's shape too)."""
    rest: Iterator[Tensor]
    """This process's parts of the following batches."""


def check_batch(x: Tensor, index: int, source: str) -> Tensor:
    """``x`` as float32 after checking it is a finite [B, D] / [B, S, D] tensor; the error names batch and source."""
    if not isinstance(x, Tensor):
        raise TypeError(f"batch {index} from {source} is a {type(x).__name__}, not a torch.Tensor")
    if x.dim() not in (2, 3) or x.shape[0] == 0:
        raise ValueError(f"batch {index} from {source} has shape {list(x.shape)}; expected [B, D] or [B, S, D] "
                         f"with B > 0")
    # a finite sum proves every entry finite (a NaN or an inf makes the sum one); a sum that overflows although
    # every entry is finite is counted exactly. In float32 (float64 for float64 rows): 0.7 ms against 2.6 ms for
    # float64 at 4096 x 768 on one core, and 14 ms for the count
    total = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    bad = 0 if bool(torch.isfinite(total)) else int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(f"batch {index} from {source} holds {bad} NaN/inf values of {x.numel()}; "
                         f"fix or re-cache the activations (e.g. cache in float32)")
    return x.float()


def seekable(batches: Batches) -> bool:
    """True for a function start_batch -> iterable (it can start anywhere without reading what it skips)."""
    return callable(batches) and not hasattr(batches, "__iter__")


def open_at(batches: Batches, start: int) -> Iterator[Tensor]:
    """Iterator over the batches from batch ``start`` on (skipping by reading when the source cannot seek)."""
    if seekable(batches):
        return iter(batches(start))
    return itertools.islice(iter(batches), start, None)


def picked(batches: Batches, source: int | tuple[int, ...] | None) -> Batches:
    """``batches`` with every [B, S, D] batch cut to its source ``source`` [B, D] (several: [B, len(source), D], e.g.
    one layer's MLP input and output; None: unchanged)."""
    source = list(source) if isinstance(source, tuple) else source
    if source is None:
        return batches
    if seekable(batches):
        return lambda start: (x[:, source] for x in batches(start))
    if isinstance(batches, (list, tuple)):
        return [x[:, source] for x in batches]
    return (x[:, source] for x in batches)


class SharedReads:
    """``batches`` as a function start_batch -> iterator that several readers share, so that each batch is
    produced once: a sweep's dictionaries each read their held-out and first batches, then the loop reads on
    from the first training batch (``train_sweep``). Producing a batch may cost more than a step: a model's
    forward (``activations.live_batches``).

    One iterator over ``batches`` is open at a time; a reader at its position takes the next batch from it, a
    reader elsewhere reads a batch kept earlier, or else reopens the iterator there (seeking as ``open_at``
    does: a resumed sweep's dictionaries skip to their own positions). Batches are kept until :meth:`read_on`
    opens the last reader."""

    def __init__(self, batches: Batches):
        self.batches = batches
        self.kept: dict[int, Tensor] = {}
        self.keeping = True
        self.it: Iterator[Tensor] | None = None
        self.at = 0
        """Position of the next batch ``it`` yields."""
        self.end: int | None = None
        """Position where the data ended (None: not seen yet)."""

    def __call__(self, start: int) -> Iterator[Tensor]:
        pos = start
        while self.end is None or pos < self.end:
            x = self.kept[pos] if pos in self.kept and pos != self.at else self._next(pos)
            if x is None:
                return
            yield x
            pos += 1

    def _next(self, pos: int) -> Tensor | None:
        if self.it is None or self.at != pos:
            self.it, self.at = open_at(self.batches, pos), pos
        x = next(self.it, None)
        if x is None:
            self.end = pos
            return None
        if self.keeping:
            self.kept[pos] = x
        self.at += 1
        return x

    def read_on(self, start: int) -> Iterator[Tensor]:
        """The last reader: the batches from ``start`` on, keeping no more of them (those kept are still served)."""
        self.keeping = False
        return self(start)


def shape_of(x: Tensor) -> tuple[int, int]:
    """(S, D) of a batch [B, D] or [B, S, D]."""
    return (1, x.shape[1]) if x.dim() == 2 else (x.shape[1], x.shape[2])


def checked(it: Iterator[Tensor], start: int, source: str) -> Iterator[Tensor]:
    """The batches of ``it`` (the first at data position ``start``) through :func:`check_batch`."""
    for i, x in enumerate(it, start):
        yield check_batch(x, i, source)


def _take_rows(stream: Iterator[Tensor], rows: int, comm: Comm) -> tuple[list[Tensor], list[Tensor]]:
    """Read batches until they hold at least ``rows`` rows of the whole batch (or the data ends);
    returns (this process's parts, the whole batches). Every process must see the data end together."""
    local, whole, n = [], [], 0
    while n < rows:
        x = next(stream, None)
        if int(comm.all_sum(torch.tensor([x is None], dtype=torch.int64))[0]):
            if x is not None:
                raise RuntimeError("ranks disagree on the end of the data; stream slices of the same global "
                                   "batches on every rank (activations.stream_batches(..., part=...))")
            break
        local.append(x)
        whole.append(comm.gather_rows(x))
        n += whole[-1].shape[0]
    return local, whole


def open_training_data(batches: Batches, eval_batches: int, init_rows: int, position: int | None, source: str,
                       comm: Comm, calibration_batches: int = 0) -> TrainingData:
    """Split ``batches`` into the held-out batches (evaluation, then calibration), the head and the rest.
    ``position``: a resumed run's data position (batches read, held-out ones included), None for a fresh run
    (which reads ``init_rows`` rows)."""
    stream = checked(open_at(batches, 0), 0, source)
    held_out = [comm.gather_rows(x) for x in itertools.islice(stream, eval_batches)]
    calibration = [comm.gather_rows(x) for x in itertools.islice(stream, calibration_batches)]
    n_held = len(held_out) + len(calibration)
    if position is not None:  # continue at the checkpoint's data position
        skipped = (open_at(batches, position) if seekable(batches)
                   else itertools.islice(stream, position - n_held, None))
        stream = checked(skipped, position, source)
    head, whole = _take_rows(stream, init_rows if position is None else 1, comm)
    if not head and not n_held:
        raise ValueError(f"{source} holds no rows: nothing to train on (is the store empty?)")
    if not head and position is None:
        raise ValueError(f"{source} holds only {n_held} batches, all held out ({len(held_out)} for evaluation, "
                         f"{len(calibration)} to calibrate the threshold); lower eval_batches / "
                         f"calibration_batches or add data")
    return TrainingData(held_out, calibration, head, whole, stream)


# -- statistics of the head rows that initialise a fresh run ------------------------------------------

def geometric_median(x: Tensor, iters: int = 50, tol: float = 1e-6) -> Tensor:
    """Weiszfeld's algorithm: the point minimising the sum of Euclidean distances to the rows of x [N, F] -> [F]."""
    x = x.double()
    y = x.mean(dim=0)
    for _ in range(iters):
        w = 1.0 / (x - y).norm(dim=1).clamp_min(1e-8)
        y_new = (w[:, None] * x).sum(dim=0) / w.sum()
        moved = (y_new - y).norm() / max(float(y.norm()), 1e-12)
        y = y_new
        if moved < tol:
            break
    return y.float()


def source_mean_norms(x_flat: Tensor, n_sources: int, d_in: int) -> Tensor:
    """Mean Euclidean norm of each source over the rows of x_flat [B, S*D] -> [S]."""
    return x_flat.view(x_flat.shape[0], n_sources, d_in).norm(dim=2).mean(dim=0)


def normalisation_scale(x_flat: Tensor, n_sources: int, d_in: int) -> Tensor:
    """Factor per source [S] that brings each source's mean norm to sqrt(D) (Kissane et al.)."""
    norms = source_mean_norms(x_flat, n_sources, d_in).clamp_min(1e-12)
    return math.sqrt(d_in) / norms
