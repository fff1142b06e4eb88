"""CPU seconds of each part of the real training loop's steps: ``conceptdict.train`` on a store (the CLI's path: the
shuffled stream, the batch check, the normalisation) or on in-memory rows (``bench/train_step.py``'s), with timers
around the library's functions and the numba kernels (wrapped here from outside; the library is unchanged).

``bench/step_phases.py`` splits a step's wall time under ``torch.profiler``; on a machine other jobs share, wall time
measures them too. This reports, per timed step, each part's wall time, the calling thread's CPU time and the
process's CPU time (every thread: torch's and numba's pools, the stream's prefetch thread), and the process's share.
With ``OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1`` every part runs on the calling thread and the two CPU columns agree.
Parts nest (``step`` holds ``encode``, which holds ``mm``, ``k.row_topk`` and ``exact_values``; ``apply_update`` holds
``backward``, which holds ``decode_backward`` and ``encoder_backward``); ``k.*`` are the numba kernels' calls.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/step_cpu.py --store runs/whole-train/store-d768-b4096-n98
    .venv/bin/python bench/step_cpu.py --rows memory --latents 16384
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
from train_step import cpu_info, synthetic_batches

KERNELS = ("row_topk", "gather_sum", "gather_dot", "scatter_rows", "encoder_backward")
# label -> (module, attribute): timed around every call
WRAPPED = {
    "encode": ("conceptdict.saes.kernels.sparse", "encode"),
    "exact_values": ("conceptdict.saes.kernels.sparse", "_exact_values"),
    "mm": ("torch", "mm"),
    "apply_update": ("conceptdict.saes.training", "apply_update"),
    "backward": ("torch:Tensor", "backward"),
    "clip": ("conceptdict.saes.update", "clip_grads"),
    "adam": ("conceptdict.saes.adam:Adam", "step"),
    "grad_proj": ("conceptdict.saes.model:SparseCoder", "remove_parallel_decoder_grad"),
    "record": ("conceptdict.saes.training", "record_step"),
    "check_batch": ("conceptdict.saes.batches", "check_batch"),
}


class Timers:
    """Wall, calling-thread CPU and process CPU seconds per label, counted while ``on``."""

    def __init__(self):
        self.on = False
        self.t: dict[str, list[float]] = {}

    def wrap(self, label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            w, c, p = time.perf_counter(), time.thread_time(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                t = self.t.setdefault(label, [0.0, 0.0, 0.0, 0])
                t[0] += time.perf_counter() - w
                t[1] += time.thread_time() - c
                t[2] += time.process_time() - p
                t[3] += 1
        return timed


def instrument(timers: Timers, warmup: int) -> dict:
    """Wrap the parts; returns the dict the counters of the timed steps land in."""
    import conceptdict.saes.kernels.numba_impl as nb
    from conceptdict.saes.kernels import sparse

    backend = nb.BACKEND._replace(**{f: timers.wrap("k." + f, getattr(nb.BACKEND, f)) for f in KERNELS})
    nb.BACKEND = backend
    (nb.encode, nb.encode_topk, nb.batch_topk, nb.sparse_decode, nb.encode_aux, nb.gather_pre,
     nb.encode_above) = sparse.make_ops(backend)
    for label, cls, attr in (("decode", sparse._SparseDecode, "forward"), ("decode_backward", sparse._SparseDecode,
                             "backward"), ("encoder_backward", sparse._SparseEncoderGrad, "backward")):
        setattr(cls, attr, staticmethod(timers.wrap(label, getattr(cls, attr))))  # the sparse autograd's halves
    for label, (where, attr) in WRAPPED.items():
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, attr, timers.wrap(label, getattr(owner, attr)))
    training = importlib.import_module("conceptdict.saes.training")
    step, loop, steps, marks = training.step, training._loop, [], {}

    def counted(*args, **kwargs):
        if len(steps) == warmup:  # the timed steps start
            timers.on = True
            marks["start"] = (time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF))
        steps.append(1)
        return timers.wrap("step", step)(*args, **kwargs)

    def looped(*args, **kwargs):
        loop(*args, **kwargs)
        marks["end"] = (time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF))
        marks["steps"] = len(steps) - warmup
        timers.on = False

    training.step, training._loop = counted, looped
    return marks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, help="a store of one hookpoint (the CLI's data path)")
    ap.add_argument("--rows", choices=("store", "memory"), default="store",
                    help="memory: bench/train_step.py's synthetic rows handed to saes.train as a list")
    ap.add_argument("--d", type=int, default=768, help="the synthetic rows' width")
    ap.add_argument("--latents", type=int, default=8192)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24, help="steps of the run (the first --warmup untimed)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--precision", default="bf16", choices=("float32", "bf16"))
    ap.add_argument("--out", type=Path, default=Path("runs/step-cpu"))
    a = ap.parse_args(argv)
    if a.rows == "store" and a.store is None:
        ap.error("--store STORE, or --rows memory")
    import conceptdict as cd
    import torch
    from conceptdict.activations.integrity import set_read_policy
    from conceptdict.saes import TrainConfig, train

    timers = Timers()
    marks = instrument(timers, a.warmup)
    if a.rows == "memory":
        cfg = TrainConfig(latents=a.latents, k=a.k, batch_size=a.batch, tokens=a.batch * a.steps, eval_batches=1,
                          calibration_batches=0, init_rows=2 * a.batch, checkpoint_every=0, precision=a.precision)
        train(cfg, synthetic_batches(a.steps + 2, a.batch, a.d, "cpu"), out=a.out)
    else:
        set_read_policy(verify_hash=False)  # as --no-verify
        cd.train(store=str(a.store), latents=a.latents, k=a.k, batch_size=a.batch, tokens=a.batch * a.steps,
                 precision=a.precision, eval_batches=1, calibration_batches=0, stop_patience=0, checkpoint_every=0,
                 seed=0, overwrite=True, out=str(a.out))
    n = marks["steps"]
    (w0, p0, r0), (w1, p1, r1) = marks["start"], marks["end"]
    proc = p1 - p0
    cpu = cpu_info()
    print(f"CPU {cpu['model']} | flags {' '.join(cpu['flags']) or '-'} | load {os.getloadavg()[0]:.1f} | threads torch "
          f"{torch.get_num_threads()}")
    print(f"D {a.d} L {a.latents} k {a.k} B {a.batch} {a.precision}, rows: {a.rows}; {n} timed steps (+{a.warmup})")
    print(f"per step: wall {1e3 * (w1 - w0) / n:.1f} ms, process CPU {1e3 * proc / n:.1f} ms (user "
          f"{1e3 * (r1.ru_utime - r0.ru_utime) / n:.1f}, system {1e3 * (r1.ru_stime - r0.ru_stime) / n:.1f}), minor "
          f"faults {(r1.ru_minflt - r0.ru_minflt) / n:.0f}")
    print(f"{'part':18s} {'wall ms':>8s} {'thread':>8s} {'process':>8s} {'% CPU':>6s} calls/step")
    for label, (w, c, p, m) in sorted(timers.t.items(), key=lambda kv: -kv[1][2]):
        print(f"{label:18s} {1e3 * w / n:8.1f} {1e3 * c / n:8.1f} {1e3 * p / n:8.1f} {100 * p / proc:6.1f} {m / n:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
