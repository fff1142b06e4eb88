"""A new store from an old one with one hookpoint's rows mapped through a function (an eraser, a steering map).

Everything else is copied shard by shard: the other hookpoints, tokens, context indices, positions, labels and
texts, the model and dataset records, the tokenizer. The new manifest records where it came from
(``derived_from``). The output is written under the writer lock and marked complete only at the end, like a
cache run, so a killed run leaves an unfinished store that readers refuse.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from conceptdict.activations import integrity
from conceptdict.activations.lock import writer_lock
from conceptdict.activations.store import (
    ActivationStore,
    StoreError,
    append_shard,
    encode_shard,
    finish,
    write_manifest,
)


def map_store(source: str | Path, out: str | Path, hookpoint: str, fn: Callable[[torch.Tensor], torch.Tensor],
              note: dict | None = None, chunk: int = 8192) -> Path:
    """Write ``out``: ``source`` with ``hookpoint``'s rows [n, D] replaced by ``fn(rows.float())`` (cast back to
    the store's dtype). ``note`` is recorded in the manifest's ``derived_from``."""
    src = ActivationStore(source)
    if hookpoint not in src.hookpoints:
        raise StoreError(f"store {src.path} has no hookpoint {hookpoint!r}; it has {src.hookpoints}")
    out = Path(out)
    if (out / "manifest.json").exists():
        raise StoreError(f"{out} already holds a store; pass a new --out directory")
    out.mkdir(parents=True, exist_ok=True)
    with writer_lock(out):
        manifest = copy.deepcopy(src.manifest)
        manifest.update(shards=[], num_rows=0, complete=False,
                        derived_from={"store": str(src.path), "hookpoint": hookpoint, **(note or {})})
        write_manifest(out, manifest)
        if (src.path / "tokenizer").is_dir():
            shutil.copytree(src.path / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
        for entry in src.manifest["shards"]:
            if integrity.POLICY.verify_hash:
                integrity.check_shard_hash(src.path, entry, hookpoints=src.hookpoints)
            with safe_open(str(src.path / entry["file"]), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            rows = tensors[hookpoint]
            mapped = [fn(rows[i:i + chunk].float()).to(rows.dtype) for i in range(0, rows.shape[0], chunk)]
            tensors[hookpoint] = torch.cat(mapped) if mapped else rows
            labels = json.loads(meta["labels"]) if "labels" in meta else None
            texts = json.loads(meta["texts"]) if "texts" in meta else None
            extra = {k: v for k, v in entry.items() if k not in ("file", "rows", "bytes", "sha256")}
            append_shard(out, manifest, encode_shard(tensors, labels, texts), rows.shape[0], extra)
        finish(out, manifest)
    return out
