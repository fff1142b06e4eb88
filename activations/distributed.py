"""Activation stores under ``torch.distributed``: rank-sliced caching with a merged manifest, and
rank-sliced training batches.

Caching (``cache_distributed``): context i of the dataset (its global index, counted before any slicing)
goes to rank ``i % world`` (round-robin), so the split is deterministic and independent of batch sizes.
Each rank runs the ordinary, crash-safe ``cache_activations`` into its own part store
``OUT/parts/rank-RRRRR-of-WWWWW/`` (rows keep their GLOBAL context index), so a killed job resumes every
rank from its own manifest. When every part is complete, rank 0 merges them: part shards are hard-linked
(copied where links are impossible) into ``OUT/shard-NNNNN.safetensors`` in rank order, and
``OUT/manifest.json`` is written once, atomically; a crash during the merge only repeats the merge. The
merged store holds exactly the rows of a one-process store of the same config (as a set, with the same
tokens, context indices and positions), in rank-major rather than dataset order; its ``config_hash`` is
the one-process store's, so either can be resumed or reused by the other.

Training data is split by ``stream_batches(..., part=(rank, world_size))``: rank r reads rows
``[r*B//W, (r+1)*B//W)`` of every global batch, so the ranks together see exactly the batches one process sees.

Who this process is (rank, world size) is decided once, by the command line (``conceptdict.ranks``),
which joins the job and passes ``rank`` / ``world_size`` / ``barrier`` here explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from conceptdict.activations import store as st
from conceptdict.activations.store import StoreError

log = logging.getLogger(__name__)

PARTS_DIR = "parts"


def part_dir(out: Path, rank: int, world_size: int) -> Path:
    """Where ``rank`` of ``world_size`` caches its contexts: ``OUT/parts/rank-RRRRR-of-WWWWW``."""
    return Path(out) / PARTS_DIR / f"rank-{rank:05d}-of-{world_size:05d}"


def rank_contexts(contexts: Iterable[Any], rank: int, world_size: int) -> Iterator[tuple[int, Any]]:
    """(global index, context) for the contexts of ``rank``: every ``world_size``-th from ``rank`` on."""
    for i, ctx in enumerate(contexts):
        if i % world_size == rank:
            yield i, ctx


def cache_distributed(cfg, records: Iterable[Any] | None = None, *, rank: int = 0, world_size: int = 1,
                      barrier: Callable[[], None] | None = None) -> Path:
    """``cache_activations`` for ``rank`` of ``world_size`` processes: this rank caches its contexts into its
    part store, then rank 0 merges every part into ``cfg.out`` (all ranks wait for it through ``barrier``,
    which several ranks must pass). With one rank: ``cache_activations``.

    ``cfg`` is the ``CacheConfig`` of the whole job (``--tokens`` unsupported with several ranks)."""
    from conceptdict.activations import cache as cache_mod

    out = Path(cfg.out)
    if world_size == 1:
        return cache_mod.cache_activations(cfg, records)
    if barrier is None:
        raise ValueError(f"cache_distributed with world_size={world_size} needs barrier= (the process group's)")
    if cfg.tokens is not None:
        raise ValueError(f"--tokens={cfg.tokens} with {world_size} ranks: the first N rows of the dataset cannot be "
                         "split without caching past them; cache the whole dataset (a smaller --dataset) or "
                         "run one process")
    digest = _digest(cfg, records)
    done = st.read_manifest(out) if (out / st.MANIFEST).exists() else None
    if done is not None and not done.get("complete"):
        raise FileExistsError(f"{out} holds an unfinished one-process store; resume it with one process (the same "
                              "command without torchrun) or choose another --out")
    if done is None or done.get("config_hash") != digest:
        if done is not None:
            raise FileExistsError(f"{out} holds a store made with a different configuration; choose a new --out")
        part = replace(cfg, out=part_dir(out, rank, world_size), progress=cfg.progress and rank == 0)
        cache_mod.cache_activations(part, records, part=(rank, world_size))
        barrier()
        if rank == 0:
            merge_parts(out, world_size, digest, cfg)
    barrier()
    return out


def _digest(cfg, records) -> str:
    """The one-process store's config_hash for ``cfg`` over ``records``."""
    from conceptdict.activations.cache import config_hash, records_digest

    return config_hash(cfg, records_digest(records))


class MergeResult(NamedTuple):
    """What :func:`merge_parts` wrote."""

    path: Path
    rows: int
    shards: int


def merge_parts(out: Path, world_size: int, config_hash: str, cfg=None) -> MergeResult:
    """Merge the complete part stores ``OUT/parts/rank-*-of-W`` into the store ``out`` (one atomic manifest
    write; idempotent: a crash midway is repaired by running it again). Removes the parts afterwards."""
    out = Path(out)
    parts = [part_dir(out, r, world_size) for r in range(world_size)]
    manifests = []
    for p in parts:
        m = st.read_manifest(p)
        if m is None or not m.get("complete"):
            raise StoreError(f"part store {p} is missing or unfinished; re-run the same torchrun command to "
                             "resume every rank before merging")
        manifests.append(m)
    if any(m.get("config_hash") != config_hash for m in manifests):
        raise StoreError(f"part stores under {out / PARTS_DIR} were cached with another configuration "
                         f"(config_hash {[m.get('config_hash') for m in manifests]}, expected {config_hash}); "
                         "remove that directory and cache again")
    merged = _merged_manifest(manifests, config_hash, cfg)
    for i, (p, entry) in enumerate(_shard_sources(parts, manifests)):
        target = out / st.shard_name(i)
        _link(p / entry["file"], target)
        merged["shards"].append({k: v for k, v in entry.items() if k not in ("next_batch", "file")}
                                | {"file": target.name})
    merged["num_rows"] = sum(int(e["rows"]) for e in merged["shards"])
    tok = parts[0] / "tokenizer"
    if tok.exists() and not (out / "tokenizer").exists():
        shutil.copytree(tok, out / ".tokenizer.tmp", dirs_exist_ok=True)
        os.replace(out / ".tokenizer.tmp", out / "tokenizer")
    st.write_manifest(out, merged)
    shutil.rmtree(out / PARTS_DIR, ignore_errors=True)
    log.info("merged %d part stores into %s: %d rows in %d shards", world_size, out, merged["num_rows"],
             len(merged["shards"]))
    return MergeResult(out, merged["num_rows"], len(merged["shards"]))


def _shard_sources(parts: list[Path], manifests: list[dict]) -> Iterator[tuple[Path, dict]]:
    for p, m in zip(parts, manifests):
        for entry in m["shards"]:
            yield p, entry


def _link(src: Path, dst: Path) -> None:
    """Make ``dst`` hold ``src``'s bytes: a hard link (no copy) or, across filesystems, an atomic copy."""
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        st.atomic_write_bytes(dst, src.read_bytes())


def _merged_manifest(manifests: list[dict], config_hash: str, cfg) -> dict:
    """The one-process store's manifest fields from the parts' (shards filled in by the caller)."""
    first = json.loads(json.dumps(manifests[0]))
    for key in ("level", "hookpoints", "dtype", "config_hash"):
        if any(m.get(key) != first.get(key) for m in manifests):
            raise StoreError(f"part stores disagree on {key!r}; they were cached with different settings — "
                             "remove the parts directory and cache again")
    first["shards"], first["num_rows"], first["complete"] = [], 0, True
    first.pop("part", None)  # the parts' (rank, world_size) mark; the merged store is the whole job's
    first["config_hash"] = config_hash
    if cfg is not None:
        from conceptdict.activations.cache import config_json

        first["config"] = config_json(cfg)  # what a one-process store records
    if "images" in first:  # image stores: every rank's skipped files
        first["images"]["skipped"] = [s for m in manifests for s in m["images"].get("skipped", [])]
        first["images"]["skipped_count"] = len(first["images"]["skipped"])
    first["label_keys"] = sorted({k for m in manifests for k in m.get("label_keys", [])})
    first["excluded_tokens"]["rows"] = sum(int(m["excluded_tokens"].get("rows", 0)) for m in manifests)
    if "contexts" in first.get("dataset", {}):
        first["dataset"]["contexts"] = max(int(m["dataset"].get("contexts", 0)) for m in manifests)
    first["distributed"] = {"world_size": len(manifests), "assignment": "context i -> rank i % world_size",
                            "rows_per_rank": [int(m["num_rows"]) for m in manifests]}
    return first
