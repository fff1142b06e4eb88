"""``cache_images``: an image model + an image dataset -> activation store (``cache_activations`` for images).

Data flow: image records (``activations.images``) -> batches of ``batch_size`` records -> decode (unreadable
files reported by path and skipped, counted in the manifest) -> the model's image processor -> one forward
of the vision tower per batch -> rows -> shards. ``image.embed*`` give one row per image (a sequence-level
store; the image's source is its text); ``vision.blocks.N.hook_out`` give per image its CLS row
(position -1) and one row per patch (position = patch index, row-major over ``manifest["images"]
["patch_grid"]``), a token-level store. Each row's ``tokens`` entry is a 31-bit CRC of the image's bytes.

Every shard's metadata keeps, per image, its source (path or ``record N``), the sha256 of its bytes and a
small PNG thumbnail, so a row can be shown later without the dataset. A shard is cut only after a whole
batch and records the next batch index and the images skipped so far, so a killed run resumes at that batch.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from conceptdict.activations import cache as cache_mod
from conceptdict.activations import families
from conceptdict.activations import images as img
from conceptdict.activations import store as st
from conceptdict.activations import vision
from conceptdict.activations.writer import ShardWriter

log = logging.getLogger(__name__)


def cache_images(cfg, records: Iterable[Any] | None = None, part: tuple[int, int] = (0, 1)) -> Path:
    """Cache ``cfg.hookpoints`` of the image model ``cfg.model`` over the images of ``cfg.dataset`` (or
    ``records``, in-memory dicts with an image column) into ``cfg.out``; the caller holds the writer lock."""
    rank, world_size = part
    text_only = [f"--{k.replace('_', '-')}" for k in ("tokens_column", "tokenizer", "packing") if getattr(cfg, k)]
    if text_only:
        raise ValueError(f"{cfg.model} is an image model: {', '.join(text_only)} applies to text models only; "
                         "drop it (images go through the model's own image processor)")
    out = Path(cfg.out)
    digest = cache_mod.config_hash(cfg, cache_mod.records_digest(records))
    manifest = cache_mod.open_out(cfg, digest)
    if manifest is not None and manifest.get("complete"):
        log.info("store %s is already complete (%d rows); nothing to do", out, manifest["num_rows"])
        return out
    handle = families.load_model(cfg.model, device=cfg.device, dtype=cfg.model_dtype)
    vision.check_image_hookpoints(handle, cfg.hookpoints)
    out.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = _fresh_manifest(cfg, handle, digest)
        if world_size > 1:
            manifest["part"] = [rank, world_size]
        st.write_manifest(out, manifest)
    resume = int(manifest["shards"][-1]["next_batch"]) if manifest["shards"] else 0
    _run(cfg, handle, manifest, records, resume, part)
    return out


def _fresh_manifest(cfg, handle: vision.ImageModelHandle, digest: str) -> dict:
    dataset = img.describe_image_dataset(cfg.dataset) if cfg.dataset else {"kind": "memory"}
    manifest = st.new_manifest(
        level=cfg.level, hookpoints={h: handle.d_model(h) for h in cfg.hookpoints}, dtype=cfg.dtype,
        model=handle.load_info, dataset=dataset, tokenizer=None, context_length=None,
        excluded_tokens={"ids": [], "strings": [], "rows": 0}, config=cache_mod.config_json(cfg),
        config_hash=digest)
    manifest["images"] = {"thumbnail_px": img.THUMBNAIL, "cls_position": vision.CLS_POSITION if
                          handle.prefix_tokens else None, "patch_grid": None, "skipped": [], "skipped_count": 0}
    return manifest


def _batches(cfg, records, part: tuple[int, int]) -> Iterator[tuple[int, list[tuple[int, img.ImageRecord]]]]:
    """(batch index, [(global record index, record)]) of this rank's records (record i -> rank i % world)."""
    rank, world_size = part
    source = records if records is not None else cfg.dataset
    recs = img.iter_image_records(source, cfg.image_column, cfg.label_columns, cfg.split)
    mine = ((i, r) for i, r in enumerate(recs) if i % world_size == rank)
    index = 0
    while True:
        chunk = list(islice(mine, cfg.batch_size))
        if not chunk:
            return
        yield index, chunk
        index += 1


def _rows(cfg, handle, acts: dict[str, torch.Tensor], good: list[tuple[int, img.DecodedImage]]) -> dict:
    crc = torch.tensor([zlib.crc32(d.sha256.encode()) & 0x7FFFFFFF for _, d in good], dtype=torch.int32)
    ctx = torch.tensor([i for i, _ in good], dtype=torch.int64)
    if cfg.level == "sequence":
        return {**acts, "tokens": crc, "context_index": ctx, "position": torch.full((len(good),), -1,
                                                                                   dtype=torch.int32)}
    tensors: dict[str, torch.Tensor] = {}
    for hp, a in acts.items():
        tensors[hp], pos = vision.patch_rows(handle, a)
    per = pos.shape[0] // len(good)
    tensors.update(tokens=crc.repeat_interleave(per), context_index=ctx.repeat_interleave(per), position=pos)
    return tensors


def _run(cfg, handle, manifest: dict, records, resume: int, part: tuple[int, int]) -> None:
    out = Path(cfg.out)
    shards = ShardWriter(out, manifest, cfg.shard_rows)
    skipped = [img.Skipped(*s) for e in manifest["shards"] for s in e.get("skipped", [])]
    new_skips: list[img.Skipped] = []
    rows, contexts = int(manifest["num_rows"]), 0
    last = {"next_batch": resume}
    bar = tqdm(total=cfg.tokens, initial=rows, unit="row", disable=not cfg.progress, desc=f"cache {out.name}",
               dynamic_ncols=True)
    try:
        for index, chunk in _batches(cfg, records, part):
            contexts = chunk[-1][0] + 1
            if index < resume:
                continue
            decoded = [(i, img.decode(r)) for i, r in chunk]
            new_skips += [d for _, d in decoded if isinstance(d, img.Skipped)]
            good = [(i, d) for i, d in decoded if isinstance(d, img.DecodedImage)]
            extra = {"next_batch": index + 1, "skipped": [list(s) for s in new_skips]}
            if not good:
                continue
            pixels = vision.preprocess(handle, [d.image for _, d in good])
            acts = vision.capture_images(handle, pixels, cfg.hookpoints)
            if cfg.level == "token" and manifest["images"]["patch_grid"] is None:
                n_tokens = next(iter(acts.values())).shape[1]
                manifest["images"]["patch_grid"] = vision.patch_grid(n_tokens - handle.prefix_tokens -
                                                                     handle.registers)
            tensors = _rows(cfg, handle, acts, good)
            per = int(tensors["tokens"].shape[0]) // len(good)  # rows per image: 1, or CLS + patches
            limit = None if cfg.tokens is None else cfg.tokens - rows
            if limit is not None and tensors["tokens"].shape[0] > limit:
                tensors = {k: v[:limit] for k, v in tensors.items()}
            n = int(tensors["tokens"].shape[0])
            labels = {k: [d.labels.get(k) for _, d in good] for k in sorted({k for _, d in good for k in d.labels})}
            labels = {k: [v for v in vals for _ in range(per)][:n] for k, vals in labels.items()}
            texts = [d.source for _, d in good][:n] if cfg.level == "sequence" else None
            records_meta = [{"context": i, "source": d.source, "sha256": d.sha256, "thumbnail": d.thumbnail}
                            for i, d in good]
            shards.add(tensors, labels or None, texts, extra=extra, images=records_meta)
            last = extra
            if shards.buffered_rows == 0:
                skipped, new_skips = skipped + new_skips, []
            rows += n
            bar.update(n)
            if cfg.tokens is not None and rows >= cfg.tokens:
                break
    finally:
        bar.close()
    skipped += new_skips
    shards.flush({**last, "skipped": [list(s) for s in new_skips]})
    manifest["images"]["skipped"] = [list(s) for s in skipped]
    manifest["images"]["skipped_count"] = len(skipped)
    img.report_skipped(skipped, str(out))
    cache_mod.finish_store(shards, manifest, contexts)
