"""Cheap, always-on checks of what a store reader reads, and the sha256 of each shard once per process.

Two levels, both raising :class:`~conceptdict.activations.store.StoreError` with the message
``conceptdict store verify`` gives for the same damage:

- :func:`check_shard_file` (every open, costs one small read per shard): the file exists, has the byte
  size the manifest lists, and its safetensors header holds exactly the expected tensors with the
  manifest's dtype and shape, and data offsets that fit the file. Catches truncation, a header edited
  from F32 to I32, a shard swapped for another run's, a file that is not safetensors at all.
- :func:`check_shard_hash` (the first time this process reads a shard): the streamed sha256 against the
  manifest, and every activation finite (NaN/Inf written into a shard whose hash was fixed up). Results are remembered **in memory, per process**, keyed by the file's path, size, mtime and
  inode. Not in a cache file: a reader must never write into a store (stores are shared, may be
  read-only), and a cache file would let a later process trust a shard that was damaged without its
  mtime changing (bit rot, a copy with preserved times). The cost is one read of each shard per process
  (``bench/store_verify.py`` measures it); :data:`POLICY` ``verify_hash=False`` (the CLI's
  ``--no-verify``) skips it for users who ran ``store verify`` already.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
RESERVED_DTYPE = {"tokens": "I32", "context_index": "I64", "position": "I32"}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


@dataclass
class ReadPolicy:
    """How store readers in this process check what they read (set once by the CLI)."""

    verify_hash: bool = True
    """Check each shard's sha256 the first time this process reads it (``--no-verify`` turns it off)."""
    wait_for_writer: float = 0.0
    """Seconds to wait for a store's writer to finish before refusing to read it (``--wait``)."""


POLICY = ReadPolicy()
_HASHED: dict[tuple[str, int, int, int], str] = {}  # (real path, size, mtime_ns, inode) -> sha256 seen


def set_read_policy(*, verify_hash: bool | None = None, wait_for_writer: float | None = None) -> ReadPolicy:
    """Change :data:`POLICY` for this process; returns it."""
    if verify_hash is not None:
        POLICY.verify_hash = bool(verify_hash)
    if wait_for_writer is not None:
        POLICY.wait_for_writer = max(0.0, float(wait_for_writer))
    return POLICY


def _corrupt(store: Path, entry: dict, what: str) -> str:
    return (f"corrupt store {store}: shard {entry['file']} {what}; re-create the store (or re-run the cache "
            "into a new directory)")


def read_header(path: Path, size: int) -> tuple[int, dict] | None:
    """(header length, parsed safetensors header) of ``path`` (``size`` bytes), or None when it is not one."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            return None
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
    return (n, header) if isinstance(header, dict) else None


def expected_tensors(manifest: dict, rows: int) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype code, shape) every shard of ``rows`` rows must hold."""
    code = SAFETENSORS_DTYPE[manifest["dtype"]]
    want = {hp: (code, [rows, int(spec["d"])]) for hp, spec in manifest["hookpoints"].items()}
    want.update({name: (dt, [rows]) for name, dt in RESERVED_DTYPE.items()})
    return want


def check_shard_file(store: Path, manifest: dict, entry: dict) -> None:
    """Size and safetensors header of one shard against the manifest; raise StoreError naming the damage."""
    from conceptdict.activations.store import StoreError

    path = Path(store) / entry["file"]
    if not path.exists():
        raise StoreError(f"corrupt store {store}: shard {entry['file']} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise StoreError(_corrupt(store, entry, f"has {size} bytes, the manifest says {entry['bytes']}"))
    parsed = read_header(path, size)
    if parsed is None:
        raise StoreError(_corrupt(store, entry, "has no valid safetensors header"))
    n, header = parsed
    header.pop("__metadata__", None)
    want = expected_tensors(manifest, int(entry["rows"]))
    if set(header) != set(want):
        raise StoreError(_corrupt(store, entry, f"holds {sorted(header)}, expected {sorted(want)}"))
    end = 0
    for name, (dtype, shape) in want.items():
        info = header[name]
        if info.get("dtype") != dtype or list(info.get("shape", [])) != shape:
            raise StoreError(_corrupt(store, entry, f"{name} is {info.get('dtype')} {info.get('shape')}, the "
                                                    f"manifest implies {dtype} {shape}"))
        end = max(end, int(info.get("data_offsets", [0, 0])[1]))
    if end != size - 8 - n:
        raise StoreError(_corrupt(store, entry, "has data offsets that do not match its size"))


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    """Streamed sha256 of ``path`` (4 MiB reads)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(path: Path) -> tuple[str, int, int, int]:
    s = os.stat(path)
    return (os.path.realpath(path), s.st_size, s.st_mtime_ns, s.st_ino)


def check_shard_hash(store: Path, entry: dict, *, force: bool = False, hookpoints: Iterable[str] = ()) -> None:
    """sha256 of one shard against the manifest, and every value of its ``hookpoints`` finite, once per process
    per (path, size, mtime, inode) unless ``force``; raise StoreError on a mismatch or a NaN/Inf."""
    from conceptdict.activations.store import StoreError

    path = Path(store) / entry["file"]
    key = _key(path)
    if not force and _HASHED.get(key) == entry["sha256"]:
        return
    _HASHED.pop(key, None)
    if file_sha256(path) != entry["sha256"]:
        raise StoreError(_corrupt(store, entry, "does not match its sha256 in the manifest"))
    check_shard_finite(store, entry, hookpoints)
    _HASHED[key] = entry["sha256"]


def check_shard_finite(store: Path, entry: dict, hookpoints: Iterable[str]) -> None:
    """Every activation of the shard's ``hookpoints`` is finite (a NaN written into a shard whose sha256 was then
    fixed up passes the hash); raise StoreError naming the hookpoint and the first row."""
    import torch
    from safetensors import safe_open

    from conceptdict.activations.store import StoreError

    with safe_open(str(Path(store) / entry["file"]), framework="pt") as fh:
        for hookpoint in hookpoints:
            values = fh.get_tensor(hookpoint)
            if math.isfinite(float(values.sum(dtype=torch.float32))):
                continue  # a NaN or Inf always reaches the sum (an overflow only sends us to the exact check)
            bad = ~torch.isfinite(values).all(dim=-1)
            if bad.any():
                rows = bad.nonzero().flatten()
                raise StoreError(_corrupt(store, entry, f"holds NaN/Inf activations at {hookpoint} in "
                                                        f"{rows.numel()} row(s), the first its row {int(rows[0])}"))


def forget_hashes() -> None:
    """Drop the per-process record of verified shards (tests and benchmarks)."""
    _HASHED.clear()
