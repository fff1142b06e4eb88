"""safetensors files read and written in pieces with ``pread`` / ``pwrite`` at the offsets their header names.

:class:`WeightsFile` reads a whole tensor or a range of it along one axis; :class:`TensorsWriter` declares every
tensor's dtype and shape first (the header) and then takes ranges along one axis in any order, so that a file larger
than a process's memory is written a piece at a time. Neither maps the file: a mapping counts its whole file
against a process's address-space limit (``ulimit -v``), a read or write only the piece it moves
(``saes.lazy``, ``naming.written``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
from torch import Tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""safetensors dtype names -> torch dtypes."""


def io_all(call: Callable[[int, Any, int], int], fd: int, view: memoryview, offset: int, what: str) -> None:
    """``os.preadv`` / ``os.pwritev`` of all of ``view`` at ``offset`` (one call moves at most ~2 GiB)."""
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{what}: {len(view) - done} bytes short at offset {offset + done}; the file is truncated")
        done += n


def byte_rows(t: Tensor, outer: int) -> np.ndarray:
    """``t`` (contiguous) as bytes [outer, -1], sharing its memory."""
    return t.view(-1).view(torch.uint8).numpy().reshape(outer, -1)


class WeightsFile:
    """One safetensors file's header, and reads of whole tensors or of a range along one axis (``pread``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.base = 8 + size
        header.pop("__metadata__", None)
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {
            name: (DTYPES[h["dtype"]], tuple(h["shape"]), int(h["data_offsets"][0])) for name, h in header.items()}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int | None = None,
             index: int | None = None) -> Tensor:
        """Tensor ``name``, or its entries ``[start, stop)`` along ``axis``; ``index``: of entry ``index`` of the first
        axis alone (axis > 0), which the result drops (a CLT's encoder [S, D, n]: one layer's [D, stop - start])."""
        dtype, full, offset = self.tensors[name]
        shape = full or (1,)
        if axis is None:
            axis, start, stop = 0, 0, shape[0]
        stop = shape[axis] if stop is None else stop
        if index is not None and not (axis > 0 and 0 <= index < shape[0]):
            raise ValueError(f"{self.path}: {name} {list(shape)} has no entry {index} of its first axis to read along "
                             f"axis {axis}")
        kept = shape[1:axis] if index is not None else shape[:axis]
        outer, inner = math.prod(kept), math.prod(shape[axis + 1:])
        first = 0 if index is None else index * outer  # the first row of ``outer`` rows read
        out = torch.empty((*kept, stop - start, *shape[axis + 1:]), dtype=dtype)
        width = out.element_size() * inner  # bytes of one entry along ``axis``
        rows = byte_rows(out, outer)
        with open(self.path, "rb") as f:
            for o in range(outer):
                io_all(os.preadv, f.fileno(), memoryview(rows[o]),
                       self.base + offset + ((first + o) * shape[axis] + start) * width, str(self.path))
        return out if full else out.reshape(())


class TensorsWriter:
    """A safetensors file written in pieces: ``shapes`` ({name: (dtype, shape)}) fix its header (tensors in name
    order, as the safetensors library writes tensors of one dtype); :meth:`write` puts a range along one axis; the
    file appears at ``path`` on :meth:`close` (written to ``path.tmp`` until then). Use it as a context manager:
    an error leaves no file at ``path``."""

    def __init__(self, path: Path, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path, self.shapes = Path(path), shapes
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        self.offsets: dict[str, int] = {}
        offset = 0
        for name in sorted(shapes):
            dtype, shape = shapes[name]
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": next(k for k, v in DTYPES.items() if v == dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.offsets[name] = offset
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.base = 8 + len(text)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed by close / __exit__)
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.file.truncate(self.base + offset)

    def write(self, name: str, t: Tensor, axis: int | None = None, start: int = 0) -> None:
        """Entries ``[start, start + t.shape[axis])`` of tensor ``name`` along ``axis`` (None: the whole tensor)."""
        dtype, full = self.shapes[name]
        t = t.detach().to("cpu", dtype).contiguous()
        at = self.base + self.offsets[name]
        if axis is None:
            if tuple(t.shape) != tuple(full):
                raise ValueError(f"{self.path}: {name} is declared {list(full)} but {list(t.shape)} was given")
            io_all(os.pwritev, self.file.fileno(), memoryview(byte_rows(t, 1)[0]), at, str(self.path))
            return
        outer, L = math.prod(t.shape[:axis]), full[axis]
        width = t.element_size() * math.prod(t.shape[axis + 1:])  # bytes of one entry along ``axis`` per row
        rows = byte_rows(t, outer)
        for o in range(outer):
            io_all(os.pwritev, self.file.fileno(), memoryview(rows[o]), at + (o * L + start) * width, str(self.path))

    def close(self) -> Path:
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.file.close()
            self.tmp.unlink(missing_ok=True)


__all__ = ["DTYPES", "TensorsWriter", "WeightsFile", "byte_rows", "io_all"]
