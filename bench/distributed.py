"""Issue 7: training throughput (tokens/s) in 1 process and under ``torchrun --nproc_per_node=2`` (gloo).

Both runs train the same dictionary (same store, flags and seed; ``--batch-size`` is the global batch) through
``conceptdict.saes.train`` over the process group's seam (``saes.distributed.process_group_comm``; one
process: the identity seam). Each run reports the
rows trained per second of its ``train()`` call (model init, held-out evaluation included; process start-up
and imports excluded), and the 2-process run the share of its wall time spent in the gradient all-reduce
(an upper bound on what DDP's overlap of communication with the backward could save). The CPU budget is
split evenly: 1 process gets ``--threads`` torch threads, each of N processes ``--threads / N``; a third run,
1 process with ``--threads / N`` threads, shows how much of a difference is thread scaling rather than
distribution. Printed ratios are against the first 1-process run of the same invocation; the maximum weight
difference between the 1- and N-process dictionaries is printed too.

    .venv/bin/python bench/distributed.py                   # D=256 L=4096 k=32 B=2048, 20 steps
    .venv/bin/python bench/distributed.py --small --json out.json
    .venv/bin/python bench/distributed.py --nproc 4 --device cuda --backend nccl   # a GPU machine

On the 2-core CI machine expect about no speed-up (2 processes share the 2 cores and the all-reduce adds
work); the point here is correctness and overhead. On GPUs each rank has its own device.
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

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "default": dict(D=256, L=4096, k=32, B=2048, steps=20, rows=65536),
    "small": dict(D=64, L=1024, k=16, B=512, steps=12, rows=16384),
}


def make_store(directory: Path, rows: int, d: int, seed: int = 0) -> Path:
    """A synthetic store: sparse combinations of 4*D random atoms plus noise, [rows, D] float32."""
    import numpy as np

    from conceptdict.activations import ImportConfig, import_array

    rng = np.random.default_rng(seed)
    atoms = rng.normal(size=(4 * d, d)).astype(np.float32)
    out = np.empty((rows, d), dtype=np.float32)
    for start in range(0, rows, 8192):
        n = min(8192, rows - start)
        codes = rng.random((n, 4 * d), dtype=np.float32) * (rng.random((n, 4 * d)) < 0.02)
        out[start:start + n] = codes @ atoms + 0.05 * rng.normal(size=(n, d)).astype(np.float32)
    np.save(directory / "acts.npy", out)
    return import_array(ImportConfig(array=directory / "acts.npy", out=directory / "store"))


def worker(spec: dict) -> dict:
    """Train once in this process (a torchrun rank or the whole job); rank 0 returns the figures."""
    import torch

    from conceptdict.activations import ActivationStore, stream_batches
    from conceptdict import ranks
    from conceptdict.saes import TrainConfig, train
    from conceptdict.saes.distributed import process_group_comm

    w = ranks.join(spec["backend"])
    torch.set_num_threads(max(1, spec["threads"] // w.size))
    comm = {"s": 0.0}
    seam = process_group_comm()
    reduce_grads = seam.reduce_grads

    def timed(model):
        t = time.perf_counter()
        reduce_grads(model)
        comm["s"] += time.perf_counter() - t

    seam.reduce_grads = timed
    store = ActivationStore(spec["store"])
    cfg = TrainConfig(kind=spec["kind"], latents=spec["L"], k=spec["k"], batch_size=spec["B"],
                      tokens=spec["B"] * spec["steps"], eval_batches=1, init_rows=spec["B"], log_every=10 ** 9,
                      checkpoint_every=0, device=spec["device"], seed=0)
    batches = lambda start: stream_batches(store, store.hookpoints[0], cfg.batch_size, epochs=None,  # noqa: E731
                                           start_batch=start, part=w.part)
    warm = TrainConfig(**{**vars(cfg), "tokens": 2 * cfg.batch_size})
    train(warm, batches, comm=seam)  # compiles the kernels (numba JIT) and touches the store: not timed
    torch.set_num_threads(max(1, spec["threads"] // w.size))  # numba's OpenMP start-up may have reset it
    ranks.barrier()
    threads = torch.get_num_threads()
    t = time.perf_counter()
    comm["s"] = 0.0
    model = train(cfg, batches, comm=seam)
    wall = time.perf_counter() - t
    result = {"processes": w.size, "threads_per_process": threads, "wall_s": wall,
              "tokens_per_s": cfg.tokens / wall, "allreduce_s": comm["s"], "allreduce_share": comm["s"] / wall,
              "heldout_fvu": (model.training_summary or {}).get("heldout_eval", {}).get("fvu")}
    if w.main:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, spec["result"] + ".weights")
    if w.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


def worker_main(path: Path, worker) -> int:
    """One process of a benchmark run (a torchrun rank, or the whole job): ``worker`` on the spec at ``path``;
    rank 0 writes its figures to the spec's ``result`` path."""
    spec = json.loads(path.read_text())
    result = worker(spec)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    return 0


def launch(spec: dict, nproc: int, tmp: Path) -> dict:
    tag = f"{nproc}x{spec['threads']}"
    path, out = tmp / f"spec-{tag}.json", tmp / f"result-{tag}.json"
    path.write_text(json.dumps(spec | {"result": str(out)}))
    per = str(max(1, spec["threads"] // nproc))
    env = os.environ | {"OMP_NUM_THREADS": per, "NUMBA_NUM_THREADS": per}
    if nproc == 1:
        cmd = [sys.executable, __file__, "--worker", str(path)]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", __file__, "--worker", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc}-process run failed:\n{proc.stderr[-4000:]}")
    from safetensors.torch import load_file

    return json.loads(out.read_text()) | {"weights": load_file(str(out) + ".weights")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a preset that finishes in about a minute")
    p.add_argument("--nproc", type=int, default=2, help="processes of the parallel run")
    p.add_argument("--kind", default="batchtopk", help="dictionary kind")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads shared by the run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker, worker)
    preset = PRESETS["small" if args.small else "default"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = make_store(tmp, preset["rows"], preset["D"])
        spec = {**preset, "store": str(store), "kind": args.kind, "threads": args.threads, "device": args.device,
                "backend": args.backend}
        one = launch(spec, 1, tmp)
        many = launch(spec, args.nproc, tmp)
        # the same per-process thread count as the parallel run: on an oversubscribed machine, one process
        # with several OpenMP threads can be much slower than its thread count suggests
        narrow = launch(spec | {"threads": max(1, args.threads // args.nproc)}, 1, tmp)
    diff = max(float((one["weights"][k] - many["weights"][k]).abs().max()) for k in one["weights"])
    rel = float((one["weights"]["W_dec"] - many["weights"]["W_dec"]).norm() / one["weights"]["W_dec"].norm())
    for r in (one, many, narrow):
        r.pop("weights")
    figures = {"preset": preset, "kind": args.kind, "runs": [one, many, narrow],
               "speedup": many["tokens_per_s"] / one["tokens_per_s"], "max_weight_diff": diff,
               "relative_W_dec_diff": rel}
    print(f"kind={args.kind} D={preset['D']} L={preset['L']} k={preset['k']} global B={preset['B']} "
          f"steps={preset['steps']} threads={args.threads}")
    print(f"{'processes':>9} {'threads/proc':>12} {'tokens/s':>10} {'vs 1 proc':>9} {'all-reduce share':>16} "
          f"{'held-out FVU':>12}")
    for r in (one, many, narrow):
        print(f"{r['processes']:>9} {r['threads_per_process']:>12} {r['tokens_per_s']:>10,.0f} "
              f"{r['tokens_per_s'] / one['tokens_per_s']:>8.2f}x {100 * r['allreduce_share']:>15.1f}% "
              f"{r['heldout_fvu'] or float('nan'):>12.5f}")
    print(f"1 vs {args.nproc} processes: max |weight difference| {diff:.2e}, "
          f"|W_dec difference| / |W_dec| {rel:.2e}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
