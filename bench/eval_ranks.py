"""Resident peak of ``conceptdict eval`` on a block artifact: loaded whole, read lazily in one process, and split over
2 ranks under torchrun (each rank reading only its half of the latents).

    .venv/bin/python bench/eval_ranks.py [--latents 65536] [--d 512] [--files 2] [--rows 8192] [--ranks 2]

Builds (in --work, default /tmp/eval_ranks) a topk block artifact of ``--files`` files (as a ``--files``-shard run
writes it; D 512, L 65,536: 256 MiB of float32 weights), a store of ``--rows`` rows and a small artifact for the
warm-up. Each measured process first evaluates the small artifact (every import, thread pool and kernel), then resets
its VmHWM (``/proc/self/clear_refs``), reads VmRSS, evaluates the big one and reads VmHWM: its peak above its own
baseline. glibc returns freed blocks of 64 KiB or more (``MALLOC_MMAP_THRESHOLD_``), as in tests/lazy_capped.py.
Prints one line per process (mode, rank, baseline, peak above it, seconds, FVU) and checks that the FVUs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding import peak_mib, reset_peak, rss_mib  # noqa: E402  (the memory figures bench/sharding.py reads)


def build(work: Path, d: int, latents: int, files: int, rows: int) -> None:
    import numpy as np
    import torch
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part
    from conceptdict.saes.model import SparseCoder

    if (work / "big" / "config.json").exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "acts.npy", np.random.default_rng(0).normal(size=(rows, d)).astype(np.float32))
    store = import_array(ImportConfig(array=work / "acts.npy", out=work / "store"))
    for name, n in (("warmup", 2048), ("big", latents)):
        for i in range(files):
            torch.manual_seed(i)
            part = SparseCoder(d, n // files, 32, "topk")
            save_dictionary_part(part, work / name, i, files)
        finish_parts(part, work / name, files, extra={"stores": [str(store)], "hookpoints": ["acts"]})


def measure(work: Path, mode: str, batch: int) -> None:
    """One process's (one rank's) line: the warm-up, then the measured evaluation."""
    import conceptdict as cd
    from conceptdict import ranks

    settings = {"rows_from": "start", "contexts": 0, "batch_size": batch}
    cd.evaluate(work / "warmup", out=work / f"warmup-{mode}.json", **settings)
    reset_peak()
    base, started = rss_mib(), time.perf_counter()
    result = cd.evaluate(work / "big", out=work / f"{mode}.json", **settings)
    line = {"mode": mode, "rank": ranks.current().rank, "base_rss_mib": round(base, 1),
            "peak_above_mib": round(peak_mib() - base, 1), "seconds": round(time.perf_counter() - started, 1),
            "fvu": result.metrics.fvu, "blocks": len(getattr(result.dictionary, "blocks", [None]))}
    print("RESULT " + json.dumps(line), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/eval_ranks"))
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--latents", type=int, default=65536)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a measured process's mode
    a = p.parse_args()
    if a.measure:
        measure(a.work, a.measure, a.batch_size)
        if a.measure == "ranks":
            from conceptdict import ranks

            ranks.leave()
        return
    build(a.work, a.d, a.latents, a.files, a.rows)
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    me = [str(Path(__file__).resolve()), "--work", str(a.work), "--batch-size", str(a.batch_size)]
    torchrun = Path(sys.executable).with_name("torchrun")
    runs = [("whole", [sys.executable, *me, "--measure", "whole"], {"CONCEPTDICT_LAZY": "0"}),
            ("lazy", [sys.executable, *me, "--measure", "lazy"], {"CONCEPTDICT_LAZY": "1"}),
            ("ranks", [str(torchrun), f"--nproc_per_node={a.ranks}", "--rdzv_backend=c10d",
                       "--rdzv_endpoint=localhost:0", *me, "--measure", "ranks"], {})]
    fvus = []
    for mode, cmd, extra in runs:
        proc = subprocess.run(cmd, env=env | extra, capture_output=True, text=True, check=False)
        lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
        if proc.returncode or not lines:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        for ln in lines:
            print(ln)
            fvus.append(json.loads(ln)["fvu"])
    print(f"FVU spread over the runs: {max(fvus) - min(fvus):.3g} (relative {(max(fvus) - min(fvus)) / max(fvus):.3g})")


if __name__ == "__main__":
    main()
