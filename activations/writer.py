"""Accumulate rows into shards (``ShardWriter``) and do it off the forward path (``BackgroundWriter``).

A shard is cut only at a boundary the caller marks (an ``add`` call), so the caller can record in
each shard entry where to resume (``extra``, e.g. the next batch index).
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from conceptdict.activations import store as st

log = logging.getLogger(__name__)


class ShardWriter:
    """Buffers rows and appends a shard to the store at ``directory`` once ``shard_rows`` are buffered.

    ``manifest`` must be the store's current manifest (new or resumed); the writer mutates and persists it.
    """

    def __init__(self, directory: Path, manifest: dict, shard_rows: int) -> None:
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
        self.directory = Path(directory)
        self.manifest = manifest
        self.shard_rows = shard_rows
        self.dtype = st.DTYPES[manifest["dtype"]]
        self._parts: list[dict[str, torch.Tensor]] = []
        self._labels: dict[str, list] = {}
        self._texts: list[str] = []
        self._images: list[dict] = []
        self._rows = 0

    @property
    def buffered_rows(self) -> int:
        """Rows added but not yet written as a shard."""
        return self._rows

    @property
    def rows_written(self) -> int:
        return int(self.manifest["num_rows"])

    def add(self, tensors: dict[str, torch.Tensor], labels: dict[str, list] | None = None,
            texts: list[str] | None = None, extra: dict | None = None, images: list[dict] | None = None) -> None:
        """Buffer rows: hookpoints [n, D] (any float dtype, cast here) and tokens/context_index/position [n].
        ``extra`` is recorded in the shard entry if a shard is cut after these rows; ``images``: records of
        the input images these rows come from (image stores)."""
        n = int(tensors["tokens"].shape[0])
        part = {}
        for key, value in tensors.items():
            if key in self.manifest["hookpoints"]:
                part[key] = value.detach().to("cpu", self.dtype)
            elif key == "context_index":
                part[key] = value.to("cpu", torch.int64)
            else:
                part[key] = value.to("cpu", torch.int32)
        self._parts.append(part)
        for key, values in (labels or {}).items():
            self._labels.setdefault(key, []).extend(values)
        if texts is not None:
            self._texts.extend(texts)
        self._images.extend(images or [])
        self._rows += n
        if self._rows >= self.shard_rows:
            self.flush(extra)

    def flush(self, extra: dict | None = None) -> None:
        """Write buffered rows (if any) as one shard."""
        if not self._rows:
            return
        tensors = {k: torch.cat([p[k] for p in self._parts]) for k in self._parts[0]}
        labels = {k: v for k, v in self._labels.items()}
        if labels and not self.manifest["label_keys"]:
            self.manifest["label_keys"] = sorted(labels)
        texts = self._texts if self.manifest["level"] == "sequence" else None
        data = st.encode_shard(tensors, labels or None, texts, self._images or None)
        entry = st.append_shard(self.directory, self.manifest, data, self._rows, extra)
        log.debug("wrote %s (%d rows, %.1f MB)", entry["file"], entry["rows"], entry["bytes"] / 1e6)
        self._parts, self._labels, self._texts, self._images, self._rows = [], {}, [], [], 0

    def close(self, extra: dict | None = None) -> None:
        """Flush the remainder and mark the store complete."""
        self.flush(extra)
        st.finish(self.directory, self.manifest)


class BackgroundWriter:
    """Runs ``handle(item)`` for each submitted item on one worker thread, through a bounded queue.

    The forward loop calls :meth:`submit` and keeps going; a worker exception is re-raised in the
    caller at the next :meth:`submit` or at :meth:`close`.
    """

    _DONE = object()

    def __init__(self, handle: Callable[[Any], None], max_pending: int = 4) -> None:
        self._handle = handle
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="conceptdict-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if self._error is None:
                try:
                    self._handle(item)
                except BaseException as e:  # noqa: BLE001 - handed to the caller thread
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the store writer failed: {self._error}") from self._error

    def submit(self, item: Any) -> None:
        self._raise()
        self._queue.put(item)

    def close(self) -> None:
        """Wait for every submitted item to be handled; re-raise a worker error."""
        self._queue.put(self._DONE)
        self._thread.join()
        self._raise()
