"""Where one kind's step of ``bench/train_step.py`` goes: its ``kind_step`` (forward, loss, ``apply_update``) at the
benchmark's defaults, with timers around the library's functions and the numba kernels (wrapped here from outside;
the library is unchanged), per timed step. For JumpReLU it also prints its packed code's width: the slots a row, the
entries in the threshold's window and those that fire.

``--clock wall`` (default) times wall seconds (read it with the machine to yourself, or under the bench lock at high
priority); ``--clock thread`` the calling thread's CPU seconds, which with ``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1`` is
the step's CPU time whatever else runs. ``--fresh-vs-reused`` instead times numba's ``gather_sum`` decoding a
Matryoshka-like regrouped code (G x B rows) into a fresh output array and into a reused one. ``--profile`` also runs
the timed steps under ``torch.profiler`` and prints its operators by self CPU time and input shapes.

    .venv/bin/python bench/kind_parts.py jumprelu
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/kind_parts.py matryoshka --clock thread
    .venv/bin/python bench/kind_parts.py matryoshka --fresh-vs-reused
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

KERNELS = ("gather_sum", "gather_dot", "scatter_rows", "scatter_rows_by_group", "row_topk", "row_above",
           "row_above_floor", "_bucket_by_latent", "_scatter_buckets")
# label -> (module, attribute): timed around every call (absent attributes are skipped: another tree's library)
WRAPPED = {
    "encode": ("conceptdict.saes.kernels.sparse", "encode"),
    "encode_above": ("conceptdict.saes.kernels.sparse", "encode_above"),
    "mm": ("torch", "mm"),
    "backward": ("torch:Tensor", "backward"),
    "adam": ("conceptdict.saes.adam:Adam", "step"),
    "prefix: regrouped decode": ("conceptdict.saes.kernels.kinds", "_group_parts"),
    "prefix: from the code": ("conceptdict.saes.kernels.numba_prefix", "prefix_residuals"),
    "prefix: gather_dot_by_group": ("conceptdict.saes.kernels.numba_prefix", "gather_dot_by_group"),
    **{f"k.{k}": ("conceptdict.saes.kernels.numba_kernels", k) for k in KERNELS},
    # BatchTopK's selection around the kernels (the names sparse.encode calls)
    **{f"select: {k}": ("conceptdict.saes.kernels.sparse", k) for k in ("row_candidates", "above_candidates",
                                                                        "join_candidates", "batch_from_candidates")},
    "select: _pad_rows": ("conceptdict.saes.kernels.select", "_pad_rows"),
    # the same selection with the candidates in one buffer and numba's cut and packing (branch i53-mat)
    "select: BatchCandidates.add": ("conceptdict.saes.kernels.select:BatchCandidates", "add"),
    "select: BatchCandidates.select": ("conceptdict.saes.kernels.select:BatchCandidates", "select"),
    **{f"nb.{k}": ("conceptdict.saes.kernels.numba_batch", k) for k in ("kth_largest", "high_counts",
                                                                       "row_counts", "pack_rows")},
}


class Timers:
    def __init__(self, clock):
        self.clock, self.on, self.t = clock, False, {}

    def wrap(self, label: str, where: str, attr: str) -> None:
        module, _, cls = where.partition(":")
        try:
            owner = importlib.import_module(module)
        except ImportError:
            return
        owner = getattr(owner, cls, None) if cls else owner
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t.setdefault(label, []).append(self.clock() - start)

        setattr(owner, attr, timed)


class PartsMeter:
    """A stand-in for ``train_step._Meter``: ``train_step.kind_step`` builds the step and hands it here; the first batch
    warms up, the others are timed whole and by parts (optionally under ``torch.profiler``)."""

    def __init__(self, timers: Timers, profile: bool):
        self.timers, self.profile = timers, profile

    def run(self, step, batches, warmup: int) -> None:
        import torch

        for x in batches[:warmup]:
            step(x)
        self.timers.on = True
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        if self.profile:
            prof.__enter__()
        for x in batches[warmup:]:
            start = self.timers.clock()
            step(x)
            self.timers.t.setdefault("STEP", []).append(self.timers.clock() - start)
        if self.profile:
            prof.__exit__(None, None, None)
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30,
                                                                     max_name_column_width=40))


def step_parts(kind: str, steps: int, clock, profile: bool = False) -> tuple[dict, list]:
    import conceptdict.saes.kernels.numba_impl  # noqa: F401  (the kernels wrapped below)
    import torch
    from conceptdict.saes import kernels
    from conceptdict.saes.kinds.jumprelu import DEFAULT_BANDWIDTH
    from train_step import kind_step, synthetic_batches

    timers = Timers(clock)
    for label, (where, attr) in WRAPPED.items():
        timers.wrap(label, where, attr)
    widths = []
    above = kernels.encode_above

    def measured(x, W_enc, b_enc, floor, k=1, impl="auto"):  # JumpReLU's: floor = theta - eps / 2
        z, idx, kept = above(x, W_enc, b_enc, floor, k, impl)
        if timers.on:
            window = kept.sum(dim=1).float()
            fired = ((z.detach() > (floor + DEFAULT_BANDWIDTH / 2)[idx]) & kept).sum(dim=1).float()
            q = torch.quantile(window, torch.tensor([0.5, 0.9, 0.99]))
            widths.append((z.shape[1], float(window.mean()), float(fired.mean()), *q.tolist(), float(window.max())))
        return z, idx, kept

    kernels.encode_above = measured
    p = {"D": 768, "L": 16384, "k": 32, "B": 4096, "device": "cpu", "precision": "float32", "warmup": 1}
    torch.manual_seed(0)
    kind_step(f"kind-{kind}", p, PartsMeter(timers, profile), synthetic_batches(steps + 1, p["B"], p["D"], "cpu"))
    return timers.t, widths


def fresh_vs_reused(G: int = 5, B: int = 4096, D: int = 768, L: int = 16384) -> dict[str, float]:
    """Median ms of numba's gather_sum of a regrouped code (row (g, b): row b's entries of group g, 2, 2, 4, 8, 16
    entries for G 5, zero-padded to 34) into a fresh [G*B, D] array and into one reused array."""
    import numpy as np
    from conceptdict.saes.kernels import numba_kernels as nk

    rng = np.random.default_rng(0)
    idx = rng.integers(0, L, (G * B, 34))
    val = np.zeros((G * B, 34), np.float32)
    for g, n in enumerate([2, 2, 4, 8, 16][:G]):
        val[g * B:(g + 1) * B, :n] = rng.random((B, n), dtype=np.float32)
    W, bias, out = rng.standard_normal((L, D)).astype(np.float32), np.zeros(D, np.float32), np.empty((G * B, D),
                                                                                                     np.float32)
    res = {}
    for name, make in (("fresh", lambda: np.empty((G * B, D), np.float32)), ("reused", lambda: out)):
        times = []
        for _ in range(7):
            target = make()
            start = time.perf_counter()
            nk.gather_sum(idx, val, W, bias, target)
            times.append(time.perf_counter() - start)
        res[name] = 1e3 * statistics.median(times[1:])
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", help="a kind of the kind table: jumprelu, matryoshka, topk, batchtopk, ...")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--fresh-vs-reused", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    if a.fresh_vs_reused:
        print(" ".join(f"{k} {v:.1f} ms" for k, v in fresh_vs_reused().items()))
        return
    t, widths = step_parts(a.kind, a.steps, time.perf_counter if a.clock == "wall" else time.thread_time, a.profile)
    print(f"{a.kind}: D 768, L 16384, k 32, B 4096, float32, {a.steps} timed steps, {a.clock} ms a step")
    for label, v in sorted(t.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:28s} {1e3 * sum(v) / a.steps:8.1f}   calls a step {len(v) / a.steps:5.1f}")
    for K, window, fired, q50, q90, q99, top in widths:
        print(f"  code: {K} slots a row; window {window:.1f}, fired {fired:.1f} entries a row "
              f"(window median {q50:.0f}, 90% {q90:.0f}, 99% {q99:.0f}, max {top:.0f})")


if __name__ == "__main__":
    main()
