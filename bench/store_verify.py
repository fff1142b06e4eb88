"""What verification on read costs: a multi-GB store streamed with and without the sha256 check.

A store of ``--gb`` GB (random float32 rows of width ``--d``) is written to a temporary directory, then
one epoch of training batches (``stream_batches``, the reader ``conceptdict train`` uses) is timed:

- ``cold, no verify``      page cache emptied for the store's files first, ``--no-verify`` (the baseline);
- ``cold, first read``     page cache emptied, sha256 of every shard checked before the first batch;
- ``warm, no verify``      the store in the page cache, no check (the warm baseline);
- ``warm, first read``     the store in the page cache, hashes not yet checked in this process (pure CPU);
- ``warm, later read``     hashes already checked in this process (what every later epoch and reader pays);
- with ``--train-steps N``, N steps of ``saes.train`` on the stream in the three warm states.

Every measurement is repeated ``--repeats`` times, interleaved with the others, and the best time is kept
(the machine may be shared; the best time is the one least disturbed).

Each line is printed as seconds and as a ratio to its baseline measured in this run. The page cache is
emptied per file with ``posix_fadvise(DONTNEED)`` (nothing else on the machine is evicted).

    .venv/bin/python bench/store_verify.py                    # 2 GB, D=768 (about 10 minutes on 2 shared cores)
    .venv/bin/python bench/store_verify.py --gb 0.2 --train-steps 0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from conceptdict.activations import ActivationStore, integrity, stream_batches
from conceptdict.activations import store as st
from conceptdict.activations.writer import ShardWriter

HP = "blocks.0.hook_out"


def write_store(path: Path, gb: float, d: int, shard_rows: int) -> ActivationStore:
    rows = int(gb * 1e9 / (4 * d))
    manifest = st.new_manifest(level="token", hookpoints={HP: d}, dtype="float32")
    path.mkdir(parents=True)
    writer = ShardWriter(path, manifest, shard_rows)
    gen = torch.Generator().manual_seed(0)
    for a in range(0, rows, 16384):
        n = min(rows, a + 16384) - a
        writer.add({HP: torch.randn(n, d, generator=gen), "tokens": torch.zeros(n, dtype=torch.int32),
                    "context_index": torch.arange(a, a + n), "position": torch.zeros(n, dtype=torch.int32)})
    writer.close()
    return ActivationStore(path)


def evict(store: ActivationStore) -> None:
    for entry in store.manifest["shards"]:
        fd = os.open(store.path / entry["file"], os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of ``fn(*args)``. CPU time is what a shared
    machine disturbs least; wall time includes waiting for the disk."""
    w, c = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - w, time.process_time() - c


def hash_all(path: Path) -> None:
    integrity.forget_hashes()
    ActivationStore(path).verify_hashes()


def timed_pass(path: Path, batch_size: int, verify: bool, forget: bool) -> None:
    integrity.set_read_policy(verify_hash=verify)
    if forget:
        integrity.forget_hashes()
    total = 0.0
    for batch in stream_batches(ActivationStore(path), HP, batch_size, epochs=1):
        total += float(batch[0, 0])


def timed_train(path: Path, steps: int, batch_size: int, verify: bool, forget: bool) -> None:
    from conceptdict.saes import TrainConfig, train

    integrity.set_read_policy(verify_hash=verify)
    if forget:
        integrity.forget_hashes()
    cfg = TrainConfig(kind="topk", latents=1024, k=32, batch_size=batch_size, tokens=steps * batch_size,
                      eval_batches=0, checkpoint_every=0, log_every=10**9, device="cpu")
    train(cfg, lambda start: stream_batches(ActivationStore(path), HP, batch_size, epochs=None, start_batch=start))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="store size in GB")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--shard-rows", type=int, default=65536)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--train-steps", type=int, default=40, help="steps of a 1024-latent TopK per warm state (0: skip)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best time of each is kept")
    p.add_argument("--dir", type=Path, default=None, help="where to write the store (default: a temporary dir)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=str, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="store_verify_", dir=a.dir))
    try:
        t0 = time.perf_counter()
        store = write_store(root / "store", a.gb, a.d, a.shard_rows)
        size = store.size_bytes()
        print(f"store: {size / 1e9:.2f} GB, {store.num_rows:,} rows x D={a.d}, {len(store.manifest['shards'])} "
              f"shards (written in {time.perf_counter() - t0:.1f} s)")
        modes = {  # name -> (cold, verify, forget hashes first, what runs)
            "cold, no verify": (True, False, True, "pass"), "cold, first read": (True, True, True, "pass"),
            "warm, no verify": (False, False, True, "pass"), "warm, first read": (False, True, True, "pass"),
            "warm, later read": (False, True, False, "pass"), "sha256 of every shard alone": (False, True, True, "hash"),
        }
        if a.train_steps:
            modes.update({"train, no verify": (False, False, True, "train"),
                          "train, first read": (False, True, True, "train"),
                          "train, later read": (False, True, False, "train")})
        res: dict[str, tuple[float, float]] = {}
        for _ in range(a.repeats):  # interleaved, best of --repeats: the machine may be shared
            for name, (cold, verify, forget, what) in modes.items():
                if cold:
                    evict(store)
                if what == "pass":
                    got = timed(timed_pass, store.path, a.batch_size, verify, forget)
                elif what == "train":
                    got = timed(timed_train, store.path, a.train_steps, a.batch_size, verify, forget)
                else:
                    got = timed(hash_all, store.path)
                best = res.get(name, (float("inf"), float("inf")))
                res[name] = (min(got[0], best[0]), min(got[1], best[1]))
        base = {"cold": "cold, no verify", "warm": "warm, no verify", "sha256": "warm, no verify",
                "train": "train, no verify"}
        print(f"{'measurement':30s} {'wall s':>7s} {'GB/s':>5s} {'ratio':>6s} {'CPU s':>7s} {'ratio':>6s}"
              "   (ratios: to the no-verify run in the same state)")
        rows = []
        for name, (wall, cpu) in res.items():
            ref = res[base[name.split(",")[0].split(" ")[0]]]
            gbs = f"{size / 1e9 / wall:5.2f}" if not name.startswith("train") else "    -"
            print(f"{name:30s} {wall:7.2f} {gbs} {wall / ref[0]:6.3f} {cpu:7.2f} {cpu / ref[1]:6.3f}")
            rows.append({"name": name, "wall_s": wall, "wall_ratio": wall / ref[0], "cpu_s": cpu,
                         "cpu_ratio": cpu / ref[1]})
        if a.json:
            Path(a.json).write_text(json.dumps({"bytes": size, "d": a.d, "rows": store.num_rows,
                                                "results": rows}, indent=2) + "\n")
    finally:
        integrity.set_read_policy(verify_hash=True)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
