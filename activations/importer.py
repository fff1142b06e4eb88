"""Turn activations a user already has (``.npy``, ``.npz``, ``.safetensors``) into a store, streamed.

Arrays are read in row chunks, never fully loaded and never unpickled: ``.npy`` through
``np.load(mmap_mode="r", allow_pickle=False)``, ``.npz`` members through their zip stream and the
``.npy`` header parser, ``.safetensors`` through ``safe_open`` slices. Every floating array with rows
[N, ...] becomes a hookpoint [N, D] (trailing axes flattened); 1-D integer arrays of length N are kept
as per-row labels. Rows carry no tokens (token id -1, context index = row, position -1).
"""

from __future__ import annotations

import logging
import math
import sys
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from conceptdict.activations import store as st
from conceptdict.activations.lock import writer_lock
from conceptdict.activations.true_features import FILE as TRUE_FEATURES_FILE
from conceptdict.activations.true_features import save_true_features
from conceptdict.activations.writer import ShardWriter

log = logging.getLogger(__name__)


@dataclass
class ImportConfig:
    """Flags of ``conceptdict store import``."""

    array: Path = field(metadata={"help": "The .npy, .npz or .safetensors file to import."})
    out: Path = field(metadata={"help": "The store directory to create."})
    keys: list[str] = field(default_factory=list, metadata={"flag": "key",
        "help": "Arrays to import as hookpoints (repeatable); default: every floating array in the file."})
    hookpoints: list[str] = field(default_factory=list, metadata={"flag": "hookpoint",
        "help": ("Hookpoint names for the imported arrays, one per array in the order of --key (or of the file); "
                 "default: the array names (for a .npy file: the file's stem).")})
    dtype: str | None = field(default=None, metadata={
        "help": "Stored dtype: float32, float16 or bfloat16 (default: the array's own float dtype, else float32)."})
    level: str = field(default="token", metadata={"help": "Row level recorded in the manifest: token or sequence."})
    shard_rows: int = field(default=65536, metadata={"help": "Rows per shard file."})
    chunk_rows: int = field(default=8192, metadata={"help": "Rows read from the array at a time (bounds memory)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing store at --out."})
    true_features: Path | None = field(default=None, metadata={
        "help": "A .npy [features, D] of the true feature directions the rows were built from (synthetic data): "
                "kept with the store for `eval --metrics ground-truth` (MCC, uniqueness)."})
    true_codes: Path | None = field(default=None, metadata={
        "help": "A .npy [rows, features] of the true features' activation on each row (with --true-features): "
                "adds each latent's precision / recall / F1 as a detector of its matched feature."})

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in st.DTYPES:
            raise ValueError(f"dtype must be one of {sorted(st.DTYPES)}, got {self.dtype!r}")
        if self.level not in st.LEVELS:
            raise ValueError(f"level must be one of {st.LEVELS}, got {self.level!r}")
        if self.shard_rows < 1 or self.chunk_rows < 1:
            raise ValueError("shard_rows and chunk_rows must be >= 1")
        if self.true_codes is not None and self.true_features is None:
            raise ValueError(f"true_codes={self.true_codes} needs true_features (the directions [features, D] the "
                             f"codes' columns are activations of); pass --true-features F.npy too")


@dataclass
class _Array:
    shape: tuple[int, ...]
    dtype: np.dtype | torch.dtype
    floating: bool
    read: object  # (start, stop) -> np.ndarray | torch.Tensor, rows of the array


class DamagedHeader(ValueError):
    """A .npy header numpy cannot parse (a truncated or damaged file)."""


def _npy_stream(fh, name: str) -> _Array:
    try:
        version = np.lib.format.read_magic(fh)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        parsed = read[version](fh) if version in read else None
    except (ValueError, SyntaxError, EOFError, OSError):
        raise DamagedHeader(f"array {name!r} has a damaged or truncated .npy header; re-save it with numpy.save") \
            from None
    if parsed is None:
        raise ValueError(f"array {name!r} uses .npy format version {version}; re-save it with numpy's default")
    shape, fortran, dtype = parsed
    if dtype.hasobject:
        raise ValueError(f"array {name!r} holds Python objects; only numeric arrays can be imported (no pickles)")
    if fortran and len(shape) > 1:
        raise ValueError(f"array {name!r} is Fortran-ordered; save it C-ordered (np.ascontiguousarray) to import")
    row_items = math.prod(shape[1:])
    state = {"next": 0}

    def read(start: int, stop: int) -> np.ndarray:
        if start != state["next"]:
            raise ValueError("zip members are read sequentially")
        count = (stop - start) * row_items
        buf = fh.read(count * dtype.itemsize)
        state["next"] = stop
        return np.frombuffer(buf, dtype=dtype, count=count).reshape((stop - start, *shape[1:]))

    return _Array(tuple(shape), dtype, np.issubdtype(dtype, np.floating), read)


def _check_magic(path: Path, suffix: str) -> None:
    """Refuse a file whose first bytes are not what its suffix promises (never reach numpy's pickle hint)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    want = {".npy": b"\x93NUMPY", ".npz": b"PK"}[suffix]
    if not head.startswith(want):
        raise ValueError(f"{path} is not a {suffix} file (it does not start with the {suffix} signature); save the "
                         f"array with numpy.{'save' if suffix == '.npy' else 'savez'} (conceptdict never unpickles)")


def _open_safetensors(path: Path, stack: ExitStack):
    from safetensors import SafetensorError

    try:
        return stack.enter_context(safe_open(str(path), framework="pt"))
    except SafetensorError as e:
        raise ValueError(f"{path} is not a valid safetensors file ({e}); save it with safetensors' save_file, or "
                         "use .npy/.npz") from None


def _open_arrays(path: Path, stack: ExitStack) -> dict[str, _Array]:
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        _check_magic(path, suffix)
    if suffix == ".npy":
        arr = _load_npy(path)
        return {path.stem: _Array(arr.shape, arr.dtype, np.issubdtype(arr.dtype, np.floating),
                                  lambda a, b, arr=arr: np.asarray(arr[a:b]))}
    if suffix == ".npz":
        zf = stack.enter_context(zipfile.ZipFile(path))
        out = {}
        for member in zf.namelist():
            if member.endswith(".npy"):
                out[member[:-4]] = _npy_stream(stack.enter_context(zf.open(member)), member[:-4])
        return out
    if suffix == ".safetensors":
        handle = _open_safetensors(path, stack)
        out = {}
        for key in handle.keys():
            sl = handle.get_slice(key)
            code = sl.get_dtype()
            out[key] = _Array(tuple(sl.get_shape()), code, code in ("F64", "F32", "F16", "BF16"),
                              lambda a, b, sl=sl: sl[a:b])
        return out
    raise ValueError(f"cannot import {path}: expected a .npy, .npz or .safetensors file")


def _load_npy(path: Path) -> np.ndarray:
    """``path`` memory-mapped; its header read first, so a pickle, an odd version or a truncated file is refused
    with the file's name (numpy would say "Array can't be memory-mapped" or "mmap length is greater than file
    size")."""
    with open(path, "rb") as fh:
        try:
            _npy_stream(fh, path.name)  # the header's checks: parsed, version, Python objects, Fortran order
        except DamagedHeader:
            raise ValueError(f"{path} has a damaged or truncated .npy header; re-save it with numpy.save") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path} is truncated or damaged: its header promises more bytes than the file holds "
                         f"({e}); re-save it with numpy.save") from None


def _as_torch(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    if x.dtype.byteorder not in ("=", "|") and x.dtype.byteorder != {"little": "<", "big": ">"}[sys.byteorder]:
        x = x.astype(x.dtype.newbyteorder("="))  # a big-endian file: torch reads native byte order only
    return torch.from_numpy(np.array(x, copy=True))


def _pick(arrays: dict[str, _Array], keys: list[str], path: Path) -> tuple[list[str], list[str], int]:
    floats = [k for k, a in arrays.items() if a.floating and len(a.shape) >= 2]
    chosen = keys or floats
    missing = [k for k in chosen if k not in arrays]
    if missing:
        raise ValueError(f"{path} has no array {missing[0]!r}; it has {sorted(arrays)}")
    if not chosen:
        raise ValueError(f"{path} holds no floating array with at least 2 axes ([N, D]); found "
                         f"{ {k: a.shape for k, a in arrays.items()} }")
    rows = {k: arrays[k].shape[0] for k in chosen}
    if len(set(rows.values())) > 1:
        raise ValueError(f"arrays in {path} have different row counts {rows}; import them with --key one at a time")
    n = next(iter(rows.values()))
    labels = [k for k, a in arrays.items() if k not in chosen and not a.floating and a.shape == (n,)]
    return chosen, labels, n


def _hookpoint_names(chosen: list[str], names: list[str], path: Path) -> dict[str, str]:
    """array name -> hookpoint name (the array's own name unless --hookpoint gives one per array)."""
    if not names:
        return {k: k for k in chosen}
    if len(names) != len(chosen):
        raise ValueError(f"{len(names)} --hookpoint names {names} for {len(chosen)} arrays {chosen} of {path}; give "
                         f"one name per imported array (select arrays with --key)")
    if len(set(names)) != len(names):
        raise ValueError(f"--hookpoint names {names} repeat a name; each array needs its own hookpoint")
    return dict(zip(chosen, names))


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def import_array(cfg: ImportConfig) -> Path:
    """Write the arrays of ``cfg.array`` as an activation store at ``cfg.out``; returns the store path."""
    path, out = Path(cfg.array), Path(cfg.out)
    if not path.exists():
        raise FileNotFoundError(f"array file {path} does not exist")
    with writer_lock(out):
        _prepare_out(out, cfg.overwrite)
        try:
            _write_store(cfg, path, out)
        except BaseException:
            remove_store_files(out)  # a refused or failed import leaves no half store behind
            raise
    return out


def _write_store(cfg: ImportConfig, path: Path, out: Path) -> None:
    with ExitStack() as stack:
        arrays = _open_arrays(path, stack)
        chosen, label_keys, n = _pick(arrays, cfg.keys, path)
        if n == 0:
            raise ValueError(f"{path}: {', '.join(chosen)} holds 0 rows; a store needs at least one row of "
                             f"activations (check the file the array was saved to)")
        names = _hookpoint_names(chosen, cfg.hookpoints, path)
        dims = {names[k]: math.prod(arrays[k].shape[1:]) for k in chosen}
        for k in chosen:
            if len(arrays[k].shape) > 2:
                log.warning("%s: array %r of shape %s is imported as %d rows of %d values (its trailing axes "
                            "flattened, as a hookpoint's heads are); for [batch, position, d] activations save "
                            "a.reshape(-1, d) instead", path, k, tuple(arrays[k].shape), n, dims[names[k]])
        dtype = cfg.dtype or _default_dtype(arrays[chosen[0]].dtype)
        labels = {k: _as_torch(arrays[k].read(0, n)).tolist() for k in label_keys}
        manifest = st.new_manifest(level=cfg.level, hookpoints=dims, dtype=dtype,
                                   dataset={"kind": "import", "source": str(path.resolve()), "keys": chosen},
                                   model={"id": None, "loader": "conceptdict store import"},
                                   config={"array": str(path), "keys": chosen, "dtype": dtype})
        if cfg.true_features is not None:
            if len(chosen) != 1:
                raise ValueError(f"--true-features describes one hookpoint's rows; {path} imports {chosen}: pick one "
                                 f"with --key")
            save_true_features(out, manifest, cfg.true_features, cfg.true_codes, n, dims[names[chosen[0]]])
        writer = ShardWriter(out, manifest, cfg.shard_rows)
        bad = _NonFinite(path, st.DTYPES[dtype])
        for a, b in _chunks(n, cfg.chunk_rows):
            rows = {names[k]: _as_torch(arrays[k].read(a, b)).reshape(b - a, dims[names[k]]) for k in chosen}
            if bad.scan(rows, a):
                continue  # keep counting, write nothing more
            rows["tokens"] = torch.full((b - a,), -1, dtype=torch.int32)
            rows["context_index"] = torch.arange(a, b, dtype=torch.int64)
            rows["position"] = torch.full((b - a,), -1, dtype=torch.int32)
            writer.add(rows, labels={k: v[a:b] for k, v in labels.items()} or None)
        bad.check()
        writer.close()
    log.info("imported %d rows of %s from %s into %s", n, chosen, path, out)


class _NonFinite:
    """Counts NaN/Inf values (after the cast to the stored dtype, so float16 overflow counts too)."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.path, self.dtype, self.count, self.first = path, dtype, 0, None

    def scan(self, rows: dict[str, torch.Tensor], start: int) -> bool:
        for key, x in rows.items():
            finite = torch.isfinite(x.to(self.dtype))
            if not bool(finite.all()):
                self.count += int((~finite).sum())
                row = start + int((~finite.all(dim=1)).nonzero()[0, 0])
                if self.first is None or row < self.first[1]:
                    self.first = (key, row)
        return self.count > 0

    def check(self) -> None:
        if self.count:
            key, row = self.first
            raise ValueError(f"{self.path} holds {self.count} NaN/Inf value(s) (as {str(self.dtype).split('.')[-1]}), "
                             f"the first in array {key!r} row {row}; nothing was imported: replace or drop them "
                             "(e.g. numpy.nan_to_num, or --dtype float32 if float16 overflowed) and import again")


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _default_dtype(dtype) -> str:
    name = _SAFETENSORS_DTYPES.get(str(dtype), str(dtype).replace("torch.", ""))
    return name if name in st.DTYPES else "float32"


def _prepare_out(out: Path, overwrite: bool) -> None:
    if (out / st.MANIFEST).exists():
        if not overwrite:
            raise FileExistsError(f"{out} already holds a store; choose a new --out or pass --overwrite")
        remove_store_files(out)
    out.mkdir(parents=True, exist_ok=True)


def remove_store_files(out: Path) -> None:
    """Delete a store's manifest and shards (only files this package writes)."""
    (out / st.MANIFEST).unlink(missing_ok=True)
    for p in out.glob("shard-*.safetensors"):
        p.unlink()
    (out / TRUE_FEATURES_FILE).unlink(missing_ok=True)
    for p in out.glob(".*.tmp-*"):
        p.unlink()
