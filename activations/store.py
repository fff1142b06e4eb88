"""The activation store on disk: sharded safetensors + ``manifest.json``, its writer and its reader.

Layout of a store directory::

    manifest.json              the single source of truth (a shard not listed here does not exist)
    shard-00000.safetensors    one tensor per hookpoint [N, D] (stored dtype), tokens [N] int32,
    shard-00001.safetensors    context_index [N] int64, position [N] int32; metadata: format + version,
    ...                        optional per-row labels and (sequence level) input texts as JSON
    tokenizer/                 optional copy of the tokenizer, so rows can be decoded without the model

Writes are crash-safe: every file is written under a temporary name, fsynced, renamed, and only then
listed in the manifest, which is itself replaced atomically.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from conceptdict.activations import integrity

log = logging.getLogger(__name__)

FORMAT = "conceptdict.activations"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESERVED = ("tokens", "context_index", "position")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LEVELS = ("token", "sequence")
REQUIRED_KEYS = ("level", "hookpoints", "dtype", "num_rows", "shards", "complete")
SHARD_KEYS = ("file", "rows", "bytes", "sha256")


class StoreError(ValueError):
    """A store that cannot be read or written as asked; the message names the file and the fix."""


class RowContext(NamedTuple):
    """The text around one store row. ``marked`` indexes ``tokens`` (-1 for sequence-level rows)."""

    tokens: list[str]
    marked: int
    text: str
    context_index: int
    position: int


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a full disk or a kill leaves no half-written temporary behind
        if isinstance(e, OSError) and e.filename is None:  # write/fsync errors name no file: name it
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    _fsync_dir(path.parent)


def write_manifest(directory: Path, manifest: dict) -> None:
    """Replace ``directory/manifest.json`` atomically."""
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    atomic_write_bytes(Path(directory) / MANIFEST, text.encode())


def read_manifest(directory: Path) -> dict | None:
    """The parsed manifest of ``directory``, or None when there is none."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path} is not valid JSON ({e}); the store is damaged, re-create it") from None
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path} is not a conceptdict activation store manifest (format={manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(
            f"{path} has format_version {manifest.get('format_version')}, this conceptdict reads {FORMAT_VERSION}; "
            "re-create the store with this version"
        )
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise StoreError(f"{path} lacks the key(s) {missing}; the store is damaged, re-create it")
    bad = [i for i, e in enumerate(manifest["shards"]) if not isinstance(e, dict) or set(SHARD_KEYS) - set(e)]
    if bad:
        raise StoreError(f"{path}: shard entry {bad[0]} lacks one of {list(SHARD_KEYS)}; the store is damaged, "
                         "re-create it")
    seen: dict[str, int] = {}
    for i, entry in enumerate(manifest["shards"]):
        name = os.path.normpath(str(entry["file"]))
        if name in seen:
            raise StoreError(f"corrupt store {directory}: {MANIFEST} lists shard {entry['file']} twice (entries "
                             f"{seen[name]} and {i}), so its rows would be read twice; re-create the store")
        seen[name] = i
    return manifest


def new_manifest(
    *, level: str, hookpoints: dict[str, int], dtype: str, model: dict | None = None,
    dataset: dict | None = None, tokenizer: str | None = None, context_length: int | None = None,
    excluded_tokens: dict | None = None, config: dict | None = None, config_hash: str | None = None,
) -> dict:
    """A manifest with no shards yet. ``hookpoints`` maps name -> D."""
    if level not in LEVELS:
        raise StoreError(f"level must be one of {LEVELS}, got {level!r}")
    if dtype not in DTYPES:
        raise StoreError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    bad = [h for h in hookpoints if h in RESERVED]
    if bad:
        raise StoreError(f"hookpoint name {bad[0]!r} is reserved for row metadata; rename it")
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "level": level,
        "hookpoints": {h: {"d": int(d)} for h, d in hookpoints.items()}, "dtype": dtype,
        "model": model or {}, "dataset": dataset or {}, "tokenizer": tokenizer,
        "context_length": context_length, "excluded_tokens": excluded_tokens or {},
        "config": config or {}, "config_hash": config_hash, "label_keys": [],
        "num_rows": 0, "shards": [], "complete": False,
    }


def encode_shard(tensors: dict[str, torch.Tensor], labels: dict[str, list] | None = None,
                 texts: list[str] | None = None, images: list[dict] | None = None) -> bytes:
    """Serialise one shard. ``tensors`` holds the hookpoints [N, D] plus tokens/context_index/position [N];
    ``images`` (image stores): one record per input image of the shard (context, source, sha256, thumbnail)."""
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    if labels:
        meta["labels"] = json.dumps(labels)
    if texts is not None:
        meta["texts"] = json.dumps(texts)
    if images:
        meta["images"] = json.dumps(images)
    return canonical_safetensors(st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))


def canonical_safetensors(data: bytes) -> bytes:
    """Rewrite a safetensors header with sorted keys, so equal content gives equal bytes (safetensors
    serialises its metadata map in a per-process random order). Tensor bytes are untouched."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def append_shard(directory: Path, manifest: dict, data: bytes, rows: int, extra: dict | None = None) -> dict:
    """Write shard bytes crash-safely, list it in ``manifest`` and persist the manifest. Returns the entry."""
    index = len(manifest["shards"])
    name = shard_name(index)
    atomic_write_bytes(Path(directory) / name, data)
    entry = {"file": name, "rows": int(rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    entry.update(extra or {})
    manifest["shards"].append(entry)
    manifest["num_rows"] = int(manifest["num_rows"]) + int(rows)
    write_manifest(directory, manifest)
    return entry


def finish(directory: Path, manifest: dict) -> None:
    """Mark the store complete (the last manifest write of a run)."""
    manifest["complete"] = True
    write_manifest(directory, manifest)


class ActivationStore:
    """Read-only, memory-mapped view of a finished store; never needs the model or the dataset.

    Opening checks every shard's size and header against the manifest and refuses a store another
    process is writing; the first read of a shard in this process checks its sha256
    (``activations.integrity``)."""

    def __init__(self, path: str | Path) -> None:
        from conceptdict.activations.lock import wait_for_writer

        self.path = Path(path)
        if self.path.is_dir():
            wait_for_writer(self.path, integrity.POLICY.wait_for_writer)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise StoreError(f"{self.path} has no {MANIFEST}; it is not an activation store (make one with "
                             "`conceptdict cache` or `conceptdict store import`)")
        if not manifest.get("complete"):
            raise StoreError(f"store {self.path} is unfinished (its writer stopped early); re-run the same "
                             "`conceptdict cache` command to resume it")
        self.manifest = manifest
        self.hookpoints = list(manifest["hookpoints"])
        self.num_rows = int(manifest["num_rows"])
        self.level = manifest["level"]
        self.dtype = DTYPES[manifest["dtype"]]
        self._starts = []
        total = 0
        for entry in manifest["shards"]:
            self._starts.append(total)
            total += int(entry["rows"])
        if total != self.num_rows:
            raise StoreError(f"{self.path}/{MANIFEST}: shard rows sum to {total} but num_rows is {self.num_rows}")
        for entry in manifest["shards"]:
            integrity.check_shard_file(self.path, manifest, entry)
        self._handles: dict[int, Any] = {}
        self._meta: dict[tuple[int, str], Any] = {}

    def __repr__(self) -> str:
        """One line (under 200 characters): path (its end when long), rows, level, dtype, the first hookpoints."""
        path = str(self.path) if len(str(self.path)) <= 40 else "..." + str(self.path)[-37:]
        hooks = [repr(h if len(h) <= 32 else h[:29] + "...") for h in self.hookpoints[:2]]
        more = [f"+{len(self.hookpoints) - 2} more"] if len(self.hookpoints) > 2 else []
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"ActivationStore({path!r}, rows={self.num_rows}, {self.level}, {dtype}, "
                f"hookpoints=[{', '.join(hooks + more)}])")

    def __len__(self) -> int:
        return self.num_rows

    def d_in(self, hookpoint: str) -> int:
        return int(self.manifest["hookpoints"][self._check(hookpoint)]["d"])

    def _check(self, hookpoint: str) -> str:
        if hookpoint not in self.manifest["hookpoints"]:
            raise StoreError(f"store {self.path} has no hookpoint {hookpoint!r}; it has {self.hookpoints}")
        return hookpoint

    def _handle(self, shard: int):
        if shard not in self._handles:
            path = self.path / self.manifest["shards"][shard]["file"]
            if not path.exists():
                raise StoreError(f"shard {path} listed in the manifest is missing; run `conceptdict store verify`")
            if integrity.POLICY.verify_hash:
                integrity.check_shard_hash(self.path, self.manifest["shards"][shard], hookpoints=self.hookpoints)
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def _spans(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(shard, local start, local stop) pieces covering global rows [start, stop)."""
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"rows [{start}, {stop}) out of range for store {self.path} with {self.num_rows} rows")
        row = start
        while row < stop:
            shard = bisect.bisect_right(self._starts, row) - 1
            base = self._starts[shard]
            end = min(stop, base + int(self.manifest["shards"][shard]["rows"]))
            yield shard, row - base, end - base
            row = end

    def _read(self, key: str, start: int, stop: int) -> torch.Tensor:
        parts = [self._handle(s).get_slice(key)[a:b] for s, a, b in self._spans(start, stop)]
        if not parts:
            return self._empty(key)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _empty(self, key: str) -> torch.Tensor:
        if key in self.manifest["hookpoints"]:
            return torch.empty(0, self.d_in(key), dtype=self.dtype)
        return torch.empty(0, dtype=torch.int64 if key == "context_index" else torch.int32)

    def rows(self, hookpoint: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of ``hookpoint``: [n, D] in the stored dtype."""
        return self._read(self._check(hookpoint), start, stop)

    def iter_rows(self, hookpoint: str, chunk: int = 8192) -> Iterator[tuple[int, torch.Tensor]]:
        """(start row, [n, D]) chunks in row order."""
        self._check(hookpoint)
        for start in range(0, self.num_rows, chunk):
            yield start, self.rows(hookpoint, start, min(self.num_rows, start + chunk))

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        """[n] int32 token id of each row (sequence level: a 31-bit CRC of the input text)."""
        return self._read("tokens", start, stop)

    def context_index(self, start: int, stop: int) -> torch.Tensor:
        """[n] int64 index of the context (input) each row comes from."""
        return self._read("context_index", start, stop)

    def position(self, start: int, stop: int) -> torch.Tensor:
        """[n] int32 position of each row's token within its context (-1 for sequence-level rows)."""
        return self._read("position", start, stop)

    def _shard_meta(self, shard: int, key: str) -> list | dict | None:
        """A JSON entry of one shard's safetensors metadata (labels, texts), parsed once."""
        if (shard, key) not in self._meta:
            meta = self._handle(shard).metadata() or {}
            self._meta[(shard, key)] = json.loads(meta[key]) if key in meta else None
        return self._meta[(shard, key)]

    def labels(self, key: str) -> list | None:
        """Per-row label column carried from the dataset (e.g. "module"), or None if the store has none."""
        if key not in self.manifest.get("label_keys", []):
            return None
        out: list = []
        for shard in range(len(self.manifest["shards"])):
            out.extend(self._shard_meta(shard, "labels")[key])
        return out

    def texts(self) -> list[str] | None:
        """Sequence-level stores: the input text of each row; None for token-level stores."""
        if self.level != "sequence":
            return None
        out: list[str] = []
        for shard in range(len(self.manifest["shards"])):
            out.extend(self._shard_meta(shard, "texts") or [])
        return out

    @property
    def is_image_store(self) -> bool:
        """True for a store cached from images (``activations.image_cache``)."""
        return "images" in self.manifest

    @functools.cached_property
    def image_records(self) -> dict[int, dict]:
        """Image stores: context index -> {"source", "sha256", "thumbnail"} of each stored image; else {}."""
        out: dict[int, dict] = {}
        for shard in range(len(self.manifest["shards"]) if self.is_image_store else 0):
            for rec in self._shard_meta(shard, "images") or []:
                out[int(rec["context"])] = rec
        return out

    def _image_context(self, row: int) -> RowContext:
        ctx, pos = int(self.context_index(row, row + 1)[0]), int(self.position(row, row + 1)[0])
        source = self.image_records.get(ctx, {}).get("source", f"image {ctx}")
        if self.level == "sequence":
            return RowContext([], -1, source, ctx, -1)
        cols = (self.manifest["images"].get("patch_grid") or [1, 1])[1]
        where = "CLS token" if pos < 0 else f"patch {pos} (row {pos // cols}, column {pos % cols})"
        return RowContext([], -1, f"{source} \u00b7 {where}", ctx, pos)

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer saved with the store (``tokenizer/``), or None."""
        from conceptdict.activations.models import load_tokenizer_dir

        return load_tokenizer_dir(self.path / "tokenizer")

    def decode_tokens(self, ids: list[int]) -> list[str]:
        """Token strings for ``ids`` (``"<id>"`` when the store has no tokenizer)."""
        tok = self.tokenizer
        if tok is None:
            return [f"<{i}>" for i in ids]
        return [tok.decode([i]) for i in ids]

    def row_context(self, row: int, before: int = 8, after: int = 4) -> RowContext:
        """The row's token with up to ``before``/``after`` neighbours from the same context, or
        (sequence level) the whole input with ``marked`` = -1. Image stores: the image's source, and for a
        patch row which patch, with ``marked`` = -1."""
        if self.is_image_store:
            return self._image_context(row)
        ctx = int(self.context_index(row, row + 1)[0])
        if self.level == "sequence":
            shard = bisect.bisect_right(self._starts, row) - 1
            texts = self._shard_meta(shard, "texts") or []
            text = texts[row - self._starts[shard]] if texts else ""
            tok = self.tokenizer
            pieces = tok.tokenize(text) if tok is not None and text else []
            return RowContext(pieces, -1, text, ctx, -1)
        lo, hi = max(0, row - before), min(self.num_rows, row + after + 1)
        ids = self.tokens(lo, hi).tolist()
        ctxs = self.context_index(lo, hi).tolist()
        keep = [i for i, c in enumerate(ctxs) if c == ctx]
        kept = [ids[i] for i in keep]
        pieces = self.decode_tokens(kept)
        text = self.tokenizer.decode(kept) if self.tokenizer is not None else " ".join(pieces)
        return RowContext(pieces, keep.index(row - lo), text, ctx, int(self.position(row, row + 1)[0]))

    def verify(self) -> None:
        """Check every listed shard's size, header and sha256 (always re-hashed); raise :class:`StoreError`
        naming a corrupt shard."""
        for entry in self.manifest["shards"]:
            integrity.check_shard_file(self.path, self.manifest, entry)
            integrity.check_shard_hash(self.path, entry, force=True, hookpoints=self.hookpoints)

    def verify_hashes(self) -> None:
        """The sha256 of every shard this process has not checked yet (skipped under ``--no-verify``):
        readers that will consume the whole store call it before their first step."""
        if integrity.POLICY.verify_hash:
            for entry in self.manifest["shards"]:
                integrity.check_shard_hash(self.path, entry, hookpoints=self.hookpoints)

    def size_bytes(self) -> int:
        return sum(int(e["bytes"]) for e in self.manifest["shards"])

