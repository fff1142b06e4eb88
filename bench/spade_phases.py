"""CPU milliseconds of each part of ``bench/train_step.py``'s kind-spade step (defaults: D 768, L 16384, k 32,
B 4096, float32), the calling thread's, with each part's memory floor: the bytes it must move at a measured
one-thread copy rate. Run with one thread so that every part runs on the calling thread:

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_phases.py --steps 3

Parts are timed by wrapping the library's functions from outside (the library is unchanged); ``rest`` is the step
less the timed parts (torch's [B, K] work of the code and the loss, forward and backward, autograd's bookkeeping).
Each step's minor page faults and system CPU (``getrusage``) are printed too, and each part's faults a step: the
fresh arrays a step maps.
``--kind topk`` times TopK's step the same way (its sparse passes are the row kernels: not wrapped).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step as ts

# (label, module, attribute) wrapped for the timed steps
PARTS = (
    ("encoder matmul", "torch", "addmm"), ("encoder matmul", "torch", "mm"),
    ("support search", "conceptdict.saes.kernels.numba_sparsemax", "sparsemax_rows"),
    ("bucketing by latent", "conceptdict.saes.kernels.numba_wide", "bucket"),
    ("gather-sums", "conceptdict.saes.kernels.numba_wide", "gather_sum"),
    ("scatters", "conceptdict.saes.kernels.numba_wide", "scatter"),
    ("gather-dot", "conceptdict.saes.kernels.numba_wide", "gather_dot"),
    ("Adam (both matrices)", "conceptdict.saes.kernels.numba_update", "adam_rows"),
)
LABELS = tuple(dict.fromkeys(label for label, _, _ in PARTS))


class Timers:
    def __init__(self):
        self.on, self.ms, self.faults, self.depth = False, {}, {}, 0

    def wrap(self, label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            c, f = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.ms[label] = self.ms.get(label, 0.0) + 1e3 * (time.thread_time() - c)
                self.faults[label] = self.faults.get(label, 0) + resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        return timed


def copy_rate(nbytes: int = 1 << 28) -> float:
    """Bytes a second one thread moves in a copy of a [nbytes / 4] float32 array into another (read + write)."""
    import numpy as np

    a, b = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(5):
        c = time.thread_time()
        np.copyto(b, a)
        best = min(best, time.thread_time() - c)
    return 2 * nbytes / best


def floors(p: dict, entries: float) -> dict[str, float]:
    """Bytes each part must move at least (each weight matrix read once, the code's arrays once)."""
    B, D, L = p["B"], p["D"], p["L"]
    n, w = B * entries, 4 * L * D
    return {"encoder matmul": 4 * (B * D + L * D), "support search": 4 * B * L,
            "bucketing by latent": 2 * (12 * B * entries + 16 * n),  # two codes: idx, value read; row, value, entry
            "gather-sums": 2 * (w + 4 * B * D + 8 * n), "scatters": 2 * (w + 4 * B * D + 8 * n),
            "gather-dot": w + 4 * B * D + 12 * n, "Adam (both matrices)": 2 * 7 * w}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kind", default="spade", choices=("spade", "topk"))
    a = ap.parse_args(argv)
    import conceptdict  # noqa: F401
    import torch

    timers = Timers()
    for label, module, attr in PARTS:
        owner = importlib.import_module(module)
        setattr(owner, attr, timers.wrap(label, getattr(owner, attr)))
    steps, faults = [], []
    p = dict(ts.PRESETS["full"], device="cpu", floor=False, threads=1, precision="float32", steps=a.steps, warmup=1)

    def run(meter, step, batches, warmup):
        for b in batches[:warmup]:
            step(b)
        timers.on = True
        for b in batches[warmup:]:
            c, r = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
            step(b)
            steps.append(1e3 * (time.thread_time() - c))
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            faults.append((r1.ru_minflt - r.ru_minflt, 1e3 * (r1.ru_stime - r.ru_stime)))
        timers.on = False
        meter.times = meter.floors = [1.0]

    ts._Meter.run = run
    ts._Meter.time_floor = lambda *args, **kwargs: None
    r = ts._measure(f"kind-{a.kind}", p)
    n = len(steps)
    rate = copy_rate()
    cpu = ts.cpu_info()
    print(f"CPU {cpu['model']} | load {os.getloadavg()[0]:.1f} | torch threads {torch.get_num_threads()} | "
          f"copy rate {rate / 1e9:.1f} GB/s")
    entries = r.get("entries_per_row", p["k"])
    print(f"kind-{a.kind}, D {p['D']} L {p['L']} k {p['k']} B {p['B']} float32, {entries:.0f} entries a row; "
          f"{n} steps after 1 warm-up; step CPU ms: {', '.join(f'{s:.0f}' for s in steps)}; minor page faults (system "
          f"CPU ms): {', '.join(f'{f} ({t:.0f})' for f, t in faults)}")
    fl = floors(p, entries)
    timed = 0.0
    print(f"{'part':22s} {'CPU ms':>8s} {'floor ms':>9s} {'faults':>8s}")
    for label in LABELS:
        ms = timers.ms.get(label, 0.0) / n
        timed += ms
        f = f"{1e3 * fl[label] / rate:9.1f}" if label in fl else f"{'':9s}"
        print(f"{label:22s} {ms:8.1f} {f} {timers.faults.get(label, 0) // n:8d}")
    print(f"{'rest':22s} {sum(steps) / n - timed:8.1f} {'':9s} {sum(f for f, _ in faults) // n - sum(timers.faults.values()) // n:8d}")
    print(f"{'step':22s} {sum(steps) / n:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
