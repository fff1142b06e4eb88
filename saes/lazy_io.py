"""Files of tensors read and written in pieces with ``pread`` / ``pwrite`` at the offsets their layout names.

:class:`WeightsFile` reads a whole tensor of a safetensors file or a range of it along one axis;
:class:`TensorsWriter` (safetensors) and :class:`TorchArchiveWriter` (``torch.save``'s zip archive, as
dictionary_learning's ``ae.pt``) declare every tensor's dtype and shape first (the header, the records) and then take
ranges along one axis in any order (:class:`PiecesWriter`), so that a file larger than a process's memory is written
a piece at a time (:func:`write_blocks`: a dictionary read lazily, a block of latents at a time). None maps the file:
a mapping counts its whole file against a process's address-space limit (``ulimit -v``), a read or write only the
piece it moves (``saes.lazy``, ``naming.written``, ``saes.formats``).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch._utils
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


class PiecesWriter:
    """A file of tensors, each at an offset its layout fixes before any is written, filled with ranges along one axis
    in any order (``pwrite``); the file appears at ``path`` on :meth:`close` (written to ``path.tmp`` until then).
    Use it as a context manager: an error leaves no file at ``path``. A layout (:class:`TensorsWriter`,
    :class:`TorchArchiveWriter`) fills ``offsets`` (each tensor's first byte in the file) and writes the rest of the
    file when it opens (:meth:`start`) and closes (:meth:`finish`)."""

    def __init__(self, path: Path, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.path, self.shapes = Path(path), shapes
        self.offsets: dict[str, int] = {}
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "w+b")  # noqa: SIM115 (closed by close / __exit__; read back by a layout)
        try:
            self.start()
        except BaseException:
            self.file.close()
            self.tmp.unlink(missing_ok=True)
            raise

    def start(self) -> None:
        """Fill :attr:`offsets` and write what precedes and lies between the tensors."""
        raise NotImplementedError

    def finish(self) -> None:
        """Write what can only be written once every tensor is (nothing by default)."""

    def write(self, name: str, t: Tensor, axis: int | None = None, start: int = 0) -> None:
        """Entries ``[start, start + t.shape[axis])`` of tensor ``name`` along ``axis`` (None: the whole tensor)."""
        dtype, full = self.shapes[name]
        t = t.detach().to("cpu", dtype).contiguous()
        at = self.offsets[name]
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
        self.file.flush()
        self.finish()
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


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class TensorsWriter(PiecesWriter):
    """A safetensors file written in pieces: ``shapes`` ({name: (dtype, shape)}) fix its header (tensors in name
    order, as the safetensors library writes tensors of one dtype); :meth:`write` puts a range along one axis."""

    def __init__(self, path: Path, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.metadata = metadata
        super().__init__(path, shapes)

    def start(self) -> None:
        header: dict[str, Any] = {"__metadata__": self.metadata} if self.metadata else {}
        offset, relative = 0, {}
        for name in sorted(self.shapes):
            dtype, shape = self.shapes[name]
            size = nbytes(dtype, shape)
            header[name] = {"dtype": next(k for k, v in DTYPES.items() if v == dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            relative[name] = offset
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.base = 8 + len(text)
        self.offsets = {name: self.base + at for name, at in relative.items()}
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.file.truncate(self.base + offset)


STORAGE_TYPES = {torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
                 torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
                 torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
                 torch.bool: "BoolStorage"}
"""torch dtypes -> the storage class ``torch.save`` names for them in its pickle."""

ALIGNMENT = 64
"""Where ``torch.save`` starts each record's bytes: a multiple of this (``torch.serialization``'s storage alignment)."""

U32 = 0xFFFFFFFF
"""A zip field of 4 bytes that holds this says that its value is in the record's zip64 extra field."""


class _Storage:
    """A storage of the pickle (its persistent id: ``('storage', class, key, 'cpu', numel)``)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """A contiguous tensor of the pickle, reduced as ``torch.Tensor.__reduce_ex__`` reduces one (offset 0, no
    gradient, no hooks)."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, tuple(int(n) for n in shape)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride = tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, stride, False, OrderedDict())


def state_pickle(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> bytes:
    """``data.pkl`` of a ``torch.save`` of a dict of contiguous tensors of these dtypes and shapes, in this order:
    the bytes torch writes for it (storage i is tensor i's, ``data/i`` in the archive)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    location = "cpu"
    pickler.persistent_id = lambda o: (("storage", getattr(torch, STORAGE_TYPES[o.dtype]), o.key, location, o.numel)
                                       if isinstance(o, _Storage) else None)
    pickler.dump({name: _Tensor(_Storage(str(i), dtype, math.prod(shape)), shape)
                  for i, (name, (dtype, shape)) in enumerate(shapes.items())})
    return buf.getvalue()


M64 = 2 ** 64 - 1


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64 bits."""
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & M64


class TorchArchiveWriter(PiecesWriter):
    """The zip archive ``torch.save`` writes for a dict of tensors (``shapes``: {name: (dtype, shape)}, in the dict's
    order), written in pieces: its records are those of torch's own writer, in its order and at its offsets
    (``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0`` ... one storage per tensor,
    ``version``, ``.data/serialization_id``; each record's bytes at a multiple of 64, stored uncompressed, with a
    data descriptor after them; zip64 end records). :meth:`write` puts a range of a tensor along one axis; on
    :meth:`close` each storage is read back a piece at a time for its CRC-32, and the descriptors, the central
    directory and the end records are written. ``torch.load(weights_only=True)`` reads it (so does
    ``zipfile``). A record of 4 GiB or more, or one that starts past 4 GiB, is described in zip64 extra fields
    (``zip64_from`` lowers that bound, for tests).

    Byte for byte it is torch's file except the first 20 digits of ``.data/serialization_id``, a hash of the record
    names (torch's hashes them with C++'s ``std::hash`` in an ``unordered_set``'s order; this one is the CRC-32 of
    the sorted names). The id is metadata: torch reports it when loading, nothing checks it. Its last 20 digits, of
    the records' CRC-32s, are torch's."""

    READ_BACK = 16 * 2 ** 20
    """Bytes read at a time for a storage's CRC-32."""

    def __init__(self, path: Path, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 zip64_from: int = U32) -> None:
        self.zip64_from = zip64_from
        super().__init__(path, shapes)

    def start(self) -> None:
        name = self.tmp.name
        self.prefix = os.path.splitext(name)[0] + "/"  # torch.save's archive name: the file's, less its extension
        keys = list(self.shapes)
        self.records: list[tuple[str, int, bytes | None]] = [
            ("data.pkl", 0, state_pickle(self.shapes)), (".format_version", 0, b"1"),
            (".storage_alignment", 0, str(ALIGNMENT).encode()), ("byteorder", 0, b"little"),
            *((f"data/{i}", nbytes(*self.shapes[k]), None) for i, k in enumerate(keys)),
            ("version", 0, b"3\n"), (".data/serialization_id", 40, None)]
        self.records = [(n, len(b) if b is not None else size, b) for n, size, b in self.records]
        self.at: list[tuple[int, int]] = []  # (local header, data) offsets of each record
        cursor = 0
        for rec, size, data in self.records:
            local = self._local_header(rec, size, cursor)
            self.at.append((cursor, cursor + len(local)))
            self.file.seek(cursor)
            self.file.write(local)
            if data is not None:
                self.file.write(data)
            cursor += len(local) + size + self._descriptor_size(size)
        self.end = cursor
        self.offsets = {k: self.at[4 + i][1] for i, k in enumerate(keys)}
        self.file.truncate(self.end)

    def _zip64(self, size: int, offset: int) -> tuple[bool, bool]:
        return size >= self.zip64_from, offset >= self.zip64_from

    def _descriptor_size(self, size: int) -> int:
        return 24 if self._zip64(size, 0)[0] else 16

    def _local_header(self, rec: str, size: int, offset: int) -> bytes:
        """The record's local header: sizes and CRC in the data descriptor (flag 3), UTF-8 names (flag 11), then
        torch's ``FB`` extra field of ``Z``s up to the next multiple of 64."""
        name = (self.prefix + rec).encode()
        big, far = self._zip64(size, offset)
        zip64 = (struct.pack("<Q", size) * 2 if big else b"") + (struct.pack("<Q", offset) if far else b"")
        extra = struct.pack("<HH", 1, len(zip64)) + zip64 if zip64 else b""
        start = offset + 30 + len(name) + len(extra) + 4
        pad = -start % ALIGNMENT
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        sizes = U32 if big else 0
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x0808, 0, 0, 0, 0, sizes, sizes, len(name),
                           len(extra)) + name + extra

    def _crc(self, at: int, size: int) -> int:
        crc, done = 0, 0
        buf = bytearray(min(size, self.READ_BACK))
        while done < size:
            view = memoryview(buf)[: min(len(buf), size - done)]
            io_all(os.preadv, self.file.fileno(), view, at + done, str(self.tmp))
            crc = zlib.crc32(view, crc)
            done += len(view)
        return crc

    def finish(self) -> None:
        crcs, combined = [], 0
        for rec, size, data in self.records[:-1]:
            crc = zlib.crc32(data) if data is not None else self._crc(self.at[len(crcs)][1], size)
            crcs.append(crc)
            combined = _hash_combine(combined, crc)
        names = zlib.crc32("\n".join(sorted(rec for rec, *_ in self.records[:-1])).encode())
        ident = f"{names:020d}{combined:020d}".encode()
        io_all(os.pwritev, self.file.fileno(), memoryview(ident), self.at[-1][1], str(self.tmp))
        crcs.append(zlib.crc32(ident))
        central = b""
        for (rec, size, _), (local, data), crc in zip(self.records, self.at, crcs):
            big, far = self._zip64(size, local)
            descriptor = struct.pack("<II", 0x08074B50, crc) + (struct.pack("<QQ", size, size) if big
                                                                 else struct.pack("<II", size, size))
            io_all(os.pwritev, self.file.fileno(), memoryview(descriptor), data + size, str(self.tmp))
            zip64 = (struct.pack("<QQ", size, size) if big else b"") + (struct.pack("<Q", local) if far else b"")
            extra = struct.pack("<HH", 1, len(zip64)) + zip64 if zip64 else b""
            name = (self.prefix + rec).encode()
            central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, 0x0808, 0, 0, 0, crc,
                                   U32 if big else size, U32 if big else size, len(name), len(extra), 0, 0, 0, 0,
                                   U32 if far else local) + name + extra
        n = len(self.records)
        end64 = self.end + len(central)
        tail = (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, len(central), self.end)
                + struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
                + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), min(self.end, U32), 0))
        io_all(os.pwritev, self.file.fileno(), memoryview(central + tail), self.end, str(self.tmp))


def write_blocks(model: Any, make: Callable[[Any], dict[str, Tensor]],
                 open_writer: Callable[[dict[str, tuple[torch.dtype, tuple[int, ...]]]], PiecesWriter]) -> None:
    """Write ``make(model)`` (a layout's tensors of a dictionary) of a dictionary read lazily (``saes.lazy``: its
    ``blocks`` and ``latents(a, b)``) a block at a time into ``open_writer(shapes)``, ``make`` run on each block.
    The axis along which each tensor runs over the latents is found by running ``make`` on two dictionaries on the
    meta device that differ by one latent; a tensor that does not run over them is written once, from the first
    block."""
    from .lazy_ranks import one_process
    from .model import SparseCoder

    one_process(model, "writing its files")  # a rank's blocks are only its own latents

    def meta(n: int) -> SparseCoder:
        return SparseCoder(model.d_in, n, model.k, model.kind, n_sources=model.n_sources, device="meta")

    whole, other = make(meta(model.n_latents)), make(meta(model.n_latents + 1))
    axes = {n: next((i for i, (p, q) in enumerate(zip(t.shape, other[n].shape)) if p != q), None)
            for n, t in whole.items()}
    with open_writer({n: (t.dtype, tuple(t.shape)) for n, t in whole.items()}) as out:
        for a, b in model.blocks:
            tensors = make(model.latents(a, b))
            for name, t in tensors.items():
                if axes[name] is not None or a == 0:
                    out.write(name, t, axes[name], a)
            del tensors


__all__ = ["DTYPES", "PiecesWriter", "TensorsWriter", "TorchArchiveWriter", "WeightsFile", "byte_rows", "io_all",
           "nbytes", "state_pickle", "write_blocks"]
