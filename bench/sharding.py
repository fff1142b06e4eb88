"""Issue 37: latent-sharded training (``latent_shards``) on CPU with gloo: peak memory per rank, tokens/s and the share
of the wall time spent communicating, for N = 1, 2, 4 shards of the same dictionary.

Each N trains the same dictionary (same store, flags and seed) through ``conceptdict.saes.train`` over
``saes.distributed.process_group_comm(latent_shards=N)`` under ``torchrun --nproc_per_node=N`` (N = 1: one plain
process, the identity seam). Every process gets ``--threads / N`` torch threads, so the runs share one CPU budget.
Reported per N:

- ``train MiB/rank``: the largest peak resident memory over the ranks during the training loop (read when the last
  step logs), less the process's resident memory before ``train()`` (imports, the store): the dictionary's weights,
  gradients, Adam state and the step's buffers; ``end MiB/rank`` the same after ``train()`` returns: the peak of
  the whole run, the end included, where each shard calibrates, evaluates and saves its latents (the artifact and
  the last checkpoint are written to a temporary directory). ``--single-file-gib`` is the run's ``single_file_gib``:
  0 (the default) saves one file per shard, so no process ever holds the whole dictionary; a large value gathers
  it onto rank 0, which writes one ``weights.safetensors``;
- ``plan MiB/rank``: what ``conceptdict plan`` (``cd.plan``, saes/sizing.py) predicts for the same run before it
  starts (weights, gradients, Adam, the CPU step's row-chunk scores, a CLT's one layer's, and tensors, a CLT's layer
  gradient, the stream's three buffer fills, the held-out batches and the allocator's slack), and ``train / plan``,
  the measured training peak over it (1.00: the plan is exact);
- memory is read from ``/proc/self/status``: the resident memory (VmRSS) before ``train()`` is the base, and the
  peak (VmHWM) is reset there (``/proc/self/clear_refs``), so what an earlier, freed allocation (the kernels'
  warm-up run) reached does not hide this run's peak;
- ``tokens/s`` of the ``train()`` call (initialisation, the final gather and evaluation included; process start-up
  and the kernels' compilation excluded) and ``comm share``: the wall time spent inside the seam's collectives
  (every all-reduce and gather of the data and shard groups) over the wall time, on rank 0.

    .venv/bin/python bench/sharding.py                # D=512 L=32768 k=32 B=1024, 8 steps
    .venv/bin/python bench/sharding.py --small --json out.json
    .venv/bin/python bench/sharding.py --single-file-gib 2   # the small-dictionary path: gathered onto rank 0
    python bench/sharding.py --small --shards 1 2 --device cuda --backend nccl   # two GPUs (bench/gpu.py runs it)
    .venv/bin/python bench/sharding.py --kind clt --layers 2   # a cross-layer transcoder over 2 layers, L in all

``--kind clt`` / ``clt-batchtopk`` train on a store of ``--layers`` synthetic MLP inputs and outputs (each output a
fixed random map of the inputs up to its layer plus noise); each shard holds its slice of every layer's latents.

On CUDA the memory figures are torch's peak allocation on the rank's device (``torch.cuda.max_memory_allocated``,
reset before ``train()``, less what was allocated there), and the plan is a GPU's (the data path in host memory).

On a shared 2-core machine N = 4 runs 4 processes on 2 cores: tokens/s there measures overhead, not scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import make_store, worker_main  # noqa: E402  (bench/distributed.py: the same synthetic store)

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "default": dict(D=512, L=32768, k=32, B=1024, steps=8, rows=16384),
    "small": dict(D=128, L=4096, k=16, B=512, steps=6, rows=8192),
}
COLLECTIVES = ("all_sum", "all_min", "any", "gather_rows", "reduce_grads", "barrier")


def _status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: resident now; VmHWM: its peak), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark reads Linux's memory figures)")


def rss_mib() -> float:
    """This process's resident memory now, MiB."""
    return _status_mib("VmRSS")


def peak_mib() -> float:
    """This process's peak resident memory since the last :func:`reset_peak`, MiB."""
    return _status_mib("VmHWM")


def reset_peak() -> None:
    """Set the peak resident memory (VmHWM) to the resident memory now (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def timed_seam(seam, clock: dict) -> None:
    """Wrap the collectives of ``seam`` and its ``shards`` (instance attributes) to add their wall time to
    ``clock["s"]``; a collective called inside another (gather_rows counts rows with all_sum) counts once."""
    depth = [0]
    for comm in {id(seam): seam, id(seam.shards): seam.shards}.values():
        for name in COLLECTIVES:
            inner = getattr(comm, name)

            def wrapped(*args, _inner=inner, **kwargs):
                depth[0] += 1
                t = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        clock["s"] += time.perf_counter() - t

            setattr(comm, name, wrapped)


class PeakSink:
    """A metrics sink that records the peak memory when each step logs (the last: the loop's peak): resident memory
    on a CPU, torch's peak allocation on a GPU."""

    def __init__(self, cuda: bool = False) -> None:
        self.peak, self.cuda = 0.0, cuda

    def write(self, record) -> None:
        if self.cuda:
            import torch

            self.peak = torch.cuda.max_memory_allocated() / 2 ** 20
        else:
            self.peak = peak_mib()

    def close(self) -> None:
        pass


def make_layered_store(directory: Path, rows: int, d: int, layers: int, seed: int = 0) -> Path:
    """A synthetic store for a cross-layer transcoder: hookpoints in_0 .. in_{S-1} (sparse combinations of random
    atoms plus noise) and out_0 .. out_{S-1} (out_m = sum over l <= m of in_l M_lm / sqrt(m + 1), plus noise)."""
    import numpy as np

    from conceptdict.activations import ImportConfig, import_array

    rng = np.random.default_rng(seed)
    ins = []
    for _ in range(layers):
        atoms = rng.normal(size=(4 * d, d)).astype(np.float32)
        codes = rng.random((rows, 4 * d), dtype=np.float32) * (rng.random((rows, 4 * d)) < 0.02)
        ins.append(codes @ atoms + 0.05 * rng.normal(size=(rows, d)).astype(np.float32))
    maps = [[rng.normal(size=(d, d)).astype(np.float32) / np.sqrt(d) for _ in range(layers)] for _ in range(layers)]
    outs = [sum(ins[l] @ maps[l][m] for l in range(m + 1)) / np.sqrt(m + 1) for m in range(layers)]
    arrays = {f"in_{l}": x for l, x in enumerate(ins)} | {f"out_{m}": y for m, y in enumerate(outs)}
    np.savez(directory / "layers.npz", **arrays)
    return import_array(ImportConfig(array=directory / "layers.npz", out=directory / "store"))


def worker(spec: dict) -> dict:
    """Train once in this process (a torchrun rank or the whole job); returns rank 0's figures, the memory the
    largest over the ranks."""
    import torch

    import conceptdict as cd
    from conceptdict import ranks
    from conceptdict.activations import ActivationStore, stream_batches
    from conceptdict.saes import train, train_config
    from conceptdict.saes.config import heldout_batch_count
    from conceptdict.saes.distributed import process_group_comm

    w = ranks.join(spec["backend"])
    cuda = spec["device"] == "cuda"
    n = spec["shards"]
    torch.set_num_threads(max(1, spec["threads"] // n))
    seam = process_group_comm(n)
    store = ActivationStore(spec["store"])
    cfg = train_config(kind=spec["kind"], latents=spec["L"], k=spec["k"], batch_size=spec["B"],
                       tokens=spec["B"] * spec["steps"], eval_batches=1, init_rows=spec["B"], log_every=1,
                       checkpoint_every=0, device=spec["device"], seed=0, latent_shards=n,
                       single_file_gib=spec["single_file_gib"])
    hps = spec["hookpoints"]
    batches = lambda start: stream_batches(store, hps if len(hps) > 1 else hps[0], cfg.batch_size,  # noqa: E731
                                           epochs=None, start_batch=start, part=(seam.rank, seam.size))
    small = train_config(**{**spec["warm"], "latent_shards": n, "device": spec["device"]})
    train(small, batches, comm=seam)  # compiles the kernels, touches the store: not timed, and small
    torch.set_num_threads(max(1, spec["threads"] // n))
    clock = {"s": 0.0}
    timed_seam(seam, clock)
    ranks.barrier()
    base, sink = rss_mib(), PeakSink(cuda)
    reset_peak()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2 ** 20
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    clock["s"] = 0.0
    out = Path(spec["result"]).with_name(f"dictionary-{n}")
    model = train(cfg, batches, comm=seam, sink=sink, out=out)
    wall = time.perf_counter() - t
    end = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else peak_mib()
    mem = torch.tensor([sink.peak - base, end - base])
    if w.size > 1:
        import torch.distributed as dist

        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    D, L = spec["D"], spec["L"]
    return {"shards": n, "threads_per_process": torch.get_num_threads(), "wall_s": wall,
            "tokens_per_s": cfg.tokens / wall, "comm_s": clock["s"], "comm_share": clock["s"] / wall,
            "train_mib_per_rank": float(mem[0]), "end_mib_per_rank": float(mem[1]),
            "plan_mib_per_rank": cd.plan(kind=spec["kind"], d_model=D, latents=L, k=spec["k"], latent_shards=n,
                                         sources=spec["layers"],
                                         batch_size=spec["B"], device=spec["device"], store_rows=store.num_rows,
                                         store_bytes=store.dtype.itemsize, heldout_batches=heldout_batch_count(cfg)
                                         ).peak / 2 ** 20,
            "heldout_fvu": (model.training_summary or {}).get("heldout_eval", {}).get("fvu"),
            "saved": sorted(p.name for p in out.glob("weights*"))}


def launch(spec: dict, shards: int, tmp: Path) -> dict:
    path, out = tmp / f"spec-{shards}.json", tmp / f"result-{shards}.json"
    path.write_text(json.dumps(spec | {"shards": shards, "result": str(out)}))
    per = str(max(1, spec["threads"] // shards))
    env = os.environ | {"OMP_NUM_THREADS": per, "NUMBA_NUM_THREADS": per}
    cmd = [sys.executable, __file__, "--worker", str(path)] if shards == 1 else [
        str(Path(sys.executable).with_name("torchrun")), f"--nproc_per_node={shards}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", __file__, "--worker", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shards}-shard run failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a preset that finishes in about a minute")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="latent shard counts to run")
    p.add_argument("--kind", default="topk", help="dictionary kind (a shardable one)")
    p.add_argument("--layers", type=int, default=2, help="a clt's layers (its store: each layer's MLP input and "
                                                           "output); --L is the latents over all of them")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads shared by a run")
    p.add_argument("--single-file-gib", type=float, default=0.0,
                   help="the runs' single_file_gib: 0 saves one file per shard, a large value gathers onto rank 0")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU per process: --backend nccl)")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend: gloo, or nccl on GPUs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, worker)
    preset = PRESETS["small" if args.small else "default"]
    warm = dict(kind=args.kind, latents=256, k=preset["k"] // 4, batch_size=preset["B"], tokens=2 * preset["B"],
                eval_batches=1, init_rows=preset["B"], log_every=10 ** 9, checkpoint_every=0, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        layers = args.layers if args.kind.startswith("clt") else 1
        store = (make_layered_store(tmp, preset["rows"], preset["D"], layers) if layers > 1 else
                 make_store(tmp, preset["rows"], preset["D"]))
        hookpoints = ([f"in_{l}" for l in range(layers)] + [f"out_{l}" for l in range(layers)] if layers > 1
                      else ["acts"])
        spec = {**preset, "store": str(store), "kind": args.kind, "threads": args.threads, "warm": warm,
                "layers": layers, "hookpoints": hookpoints,
                "device": args.device, "backend": args.backend,
                "single_file_gib": args.single_file_gib}
        runs = [launch(spec, n, tmp) for n in args.shards]
    print(f"kind={args.kind} D={preset['D']} L={preset['L']} k={preset['k']} B={preset['B']} steps={preset['steps']} "
          + (f"layers={args.layers} " if args.kind.startswith("clt") else "") +
          f"threads={args.threads} (shared by each run's processes) single_file_gib={args.single_file_gib}")
    print(f"{'shards':>6} {'plan MiB/rank':>13} {'train MiB/rank':>14} {'train / plan':>12} {'end MiB/rank':>12} "
          f"{'tokens/s':>9} {'comm share':>10} {'held-out FVU':>12}  saved")
    for r in runs:
        print(f"{r['shards']:>6} {r['plan_mib_per_rank']:>13.0f} {r['train_mib_per_rank']:>14.0f} "
              f"{r['train_mib_per_rank'] / r['plan_mib_per_rank']:>12.2f} "
              f"{r['end_mib_per_rank']:>12.0f} {r['tokens_per_s']:>9,.0f} {100 * r['comm_share']:>9.1f}% "
              f"{r['heldout_fvu'] or float('nan'):>12.5f}  {', '.join(r['saved'])}")
    if args.json:
        args.json.write_text(json.dumps({"preset": preset, "kind": args.kind, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
