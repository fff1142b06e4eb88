"""Image datasets -> decoded images with labels, a content hash and a thumbnail; unreadable ones reported.

A dataset spec is one of:

- a folder tree: every file under it, in sorted path order; the first sub-folder below the root is the class,
  carried as the label column ``label`` (files directly in the root get no label);
- a ``.csv`` / ``.jsonl`` / ``.json`` / ``.parquet`` table whose image column (``--image-column``, default
  ``image``) holds a path (relative paths are read from the table's folder), raw bytes, or a
  ``{"bytes", "path"}`` record; every other scalar column is a label (or those named by ``--label-column``);
- a hub image dataset (``name`` or ``name:config``), streamed through the same reader as text datasets
  (``data.iter_records``): its image column holds decoded images or ``{"bytes", "path"}`` records.

The model's own image processor resizes later; here an image is only decoded (forcing the whole file to be
read, so a truncated file fails here) and converted to RGB. A file that does not decode is reported by path
with the reason and skipped, and counted.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from conceptdict.activations import data as data_mod

log = logging.getLogger(__name__)

THUMBNAIL = 64  # longest side of the thumbnail kept per image, in pixels
TABLE_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")


class ImageRecord(NamedTuple):
    """One dataset entry before decoding: where it comes from, how to get it, its labels."""

    source: str
    """File path, or ``"record N"`` for an image held inside a table / hub dataset."""
    payload: Any
    """A path, bytes, or an already decoded PIL image."""
    labels: dict[str, Any]


class DecodedImage(NamedTuple):
    """A readable image: RGB pixels, the sha256 of its bytes (16 hex digits) and a PNG thumbnail."""

    source: str
    image: Any
    sha256: str
    thumbnail: str
    """``data:image/png;base64,...`` of the image shrunk to at most :data:`THUMBNAIL` pixels a side."""
    labels: dict[str, Any]


class Skipped(NamedTuple):
    source: str
    reason: str


def describe_image_dataset(spec: str) -> dict:
    """The manifest's dataset descriptor; a folder's lists its file count and total size."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = _folder_files(path)
        return {"kind": "image folder", "spec": str(path.resolve()), "files": len(files),
                "bytes": sum(f.stat().st_size for f in files)}
    return data_mod.describe_dataset(spec)


def _folder_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(s.startswith(".") for s in
                                                                         p.relative_to(root).parts))


def iter_image_records(spec: str | Iterable, image_column: str = "image", label_columns: list[str] | None = None,
                       split: str = "train") -> Iterator[ImageRecord]:
    """Image records of a folder tree, a table of images, a hub dataset or an in-memory list of dicts."""
    path = Path(spec).expanduser() if isinstance(spec, str) else None
    if path is not None and path.is_dir():
        files = _folder_files(path)
        if not files:
            raise ValueError(f"image folder {path} holds no files; point --dataset at a folder of images "
                             "(one sub-folder per class)")
        for f in files:
            rel = f.relative_to(path).parts
            yield ImageRecord(str(f), f, {"label": rel[0]} if len(rel) > 1 else {})
        return
    if path is not None and path.is_file() and path.suffix.lower() not in TABLE_SUFFIXES:
        raise ValueError(f"cannot read images from {path}: pass a folder of images or a "
                         f"{'/'.join(TABLE_SUFFIXES)} table of image paths or bytes (or a hub dataset name)")
    base = path.parent if path is not None and path.is_file() else Path.cwd()
    records = data_mod.iter_records(spec, split=split)
    for i, rec in enumerate(records):
        if image_column not in rec:
            raise ValueError(f"dataset record {i} has no image column {image_column!r}; its columns are "
                             f"{sorted(rec)}; pass --image-column with the one holding images")
        value = rec[image_column]
        source = f"record {i}"
        if isinstance(value, str):
            source, value = value, (base / value if not Path(value).is_absolute() else Path(value))
        elif isinstance(value, dict):
            source = value.get("path") or source
            value = value.get("bytes") or (base / value["path"] if value.get("path") else None)
        yield ImageRecord(str(source), value, _labels(rec, image_column, label_columns))


def _labels(record: dict, image_column: str, label_columns: list[str] | None) -> dict[str, Any]:
    keys = label_columns if label_columns is not None else [
        k for k, v in record.items() if k != image_column and isinstance(v, (str, int, float, bool))]
    return {k: record.get(k) for k in keys}


def decode(record: ImageRecord) -> DecodedImage | Skipped:
    """The decoded RGB image with its hash and thumbnail, or why it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    payload = record.payload
    try:
        if isinstance(payload, Image.Image):
            buffer = io.BytesIO()
            payload.save(buffer, format="PNG")
            data = buffer.getvalue()
        elif isinstance(payload, (bytes, bytearray)):
            data = bytes(payload)
        elif isinstance(payload, Path):
            data = payload.read_bytes()
        else:
            return Skipped(record.source, f"holds {type(payload).__name__}, not an image path or bytes")
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes every pixel: a truncated file fails here, not in the processor
            rgb = img.convert("RGB")
    except FileNotFoundError:
        return Skipped(record.source, "file not found")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        return Skipped(record.source, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}")
    return DecodedImage(record.source, rgb, hashlib.sha256(data).hexdigest()[:16], thumbnail(rgb), record.labels)


def thumbnail(image, size: int = THUMBNAIL) -> str:
    """A PNG data URI of ``image`` shrunk (aspect kept) to at most ``size`` pixels a side."""
    small = image.copy()
    small.thumbnail((size, size))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def report_skipped(skipped: list[Skipped], where: str) -> None:
    """Log every unreadable image by path and the count (never silent)."""
    for s in skipped:
        log.warning("skipped unreadable image %s (%s)", s.source, s.reason)
    if skipped:
        log.warning("%s: skipped %d unreadable image(s): %s", where, len(skipped),
                    "; ".join(f"{s.source} ({s.reason})" for s in skipped[:10])
                    + (" ..." if len(skipped) > 10 else ""))
