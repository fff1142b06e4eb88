"""Issue 38: seconds from process start to the first training step, and from the last step to exit.

Runs ``conceptdict train --store STORE --latents 1024 --k 16`` (the command's defaults otherwise) as a fresh
process, ``--repeat`` times, and reports the median of each phase. The child is the real CLI entry point
(``conceptdict.cli.main.main``) with timestamps taken by wrapping module attributes of the training code from
outside (this file): nothing in the library is instrumented for it.

Phases (seconds):
  interpreter      Popen -> the child's first line of Python (interpreter start, site, the editable finder)
  import_torch     ``import torch``
  cli              the CLI: parsing, the train API, opening the store, sizing the run (until setup starts)
  open_data        of which: the held-out and first batches read (``saes.batches.open_training_data``)
  setup            the model, its initialisation from the first rows (geometric median), the optimizer
  optimizer        of which: building torch.optim.Adam (its first call imports torch._dynamo)
  first_step       the first step (the sparse kernels' first call: numba loads its cached machine code)
  => to_first_step   process start -> the first step ends
  steps            the other steps (reported per step too)
  finish           last step -> the artifact is saved (threshold, held-out evaluation, save)
  checkpoint       of which: the last checkpoint (weights, Adam state; 0 with --checkpoint-every 0: none written)
  heldout_eval     of which: the held-out evaluation
  save             of which: the artifact (weights.safetensors, config.json)
  exit             saved -> the process has exited (printing the summary, interpreter teardown)
  teardown         of which: the CLI has returned -> the process has exited
  => after_last_step
  cpu_total        the process's CPU seconds, start to exit (every thread)
  cpu_*            its CPU seconds from the start to setup, in setup, the first step, the
                   other steps (and per step), the held-out evaluation, the save, and from the last step to the
                   CLI's return: on a shared machine these move less with the load than the wall times

``--big-rows N`` also times a store of N random rows (D 384, the demo's width) with ``--tokens`` set to a few
steps, to show which start-up costs grow with the store, and the same with ``--no-verify`` (no sha256 of the
shards, which every process checks once before reading a shard: the signal check and the shuffled first buffer
read from every shard). Without ``--store`` a random store of the demo's
shape (2,196 rows x 384) is imported to a temporary directory: the timings depend on shapes, not values.

    python bench/startup.py --store /tmp/w/demo/store --repeat 3 --big-rows 1000000 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
T = {"python": time.time()}
C = {"python": time.process_time()}  # the process's CPU seconds at the same stamps
import torch
T["torch"], C["torch"] = time.time(), time.process_time()
import conceptdict.saes.training as tr
import conceptdict.saes.artifact as art

def timed(owner, name, before=None, after=None, every=False):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        if before and (every or before not in T):
            T[before], C[before] = time.time(), time.process_time()
        out = fn(*a, **k)
        if after and (every or after not in T):
            T[after], C[after] = time.time(), time.process_time()
        return out
    setattr(owner, name, wrapper)

timed(tr, "open_training_data", before="data_start", after="data_end")
timed(tr, "setup", before="setup_start", after="setup_end")
timed(tr, "make_optimizer", before="opt_start", after="opt_end")
timed(tr, "step", after="first_step_end")
timed(tr, "step", after="last_step_end", every=True)
timed(tr, "_save", before="ckpt_start", after="ckpt_end")
timed(tr, "evaluate", before="eval_start", after="eval_end")
timed(art, "save_dictionary", before="save_start", after="saved")
import atexit
atexit.register(lambda path=sys.argv[1]: json.dump({"wall": T, "cpu": C}, open(path, "w")))
sys.argv = ["conceptdict"] + sys.argv[2:]
from conceptdict.cli.main import main
code = main()
T["main_end"], C["main_end"] = time.time(), time.process_time()
sys.exit(code)
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, help="a store to train on (default: a random one of the demo's shape)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--big-rows", type=int, default=0, help="also time a random store of this many rows")
    p.add_argument("--json", type=Path)
    p.add_argument("--work", type=Path, help="build the random stores here and keep them (default: a temporary dir)")
    return p.parse_args(argv)


def random_store(root: Path, rows: int, d: int = 384) -> Path:
    """A store of ``rows`` random float32 rows imported through the public API (chunked, so 1M rows fit)."""
    import numpy as np

    import conceptdict as cd

    out = root / f"store-{rows}"
    if (out / "manifest.json").exists():
        return out
    arr = root / f"rows-{rows}.npy"
    mm = np.lib.format.open_memmap(arr, mode="w+", dtype=np.float32, shape=(rows, d))
    rng = np.random.default_rng(0)
    for i in range(0, rows, 65536):
        mm[i:i + 65536] = rng.standard_normal((min(65536, rows - i), d), dtype=np.float32)
    mm.flush()
    del mm
    cd.import_array(arr, out=out)
    arr.unlink()
    return out


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(store: Path, out: Path, extra: list[str], python: str = sys.executable,
             shape: tuple[str, ...] = ("--latents", "1024", "--k", "16")) -> dict[str, float]:
    """One fresh ``conceptdict train`` process (``python``: its interpreter; ``shape``: the dictionary's flags);
    its phases in seconds."""
    stamps = out.with_suffix(".json")
    args = [python, "-c", CHILD, str(stamps), "train", "--store", str(store), *shape, "--out", str(out), "--overwrite",
            *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0, cpu0 = time.time(), children_cpu()
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    t_exit, cpu_total = time.time(), children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"conceptdict train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    stamped = json.loads(stamps.read_text())
    T, C = stamped["wall"], stamped["cpu"]
    steps = json.loads((out / "config.json").read_text())["training"]["steps"]
    cpu = {  # the process's CPU seconds in each phase (every thread): shares that a shared machine's load moves less
        "cpu_start": C["setup_start"], "cpu_setup": C["setup_end"] - C["setup_start"],
        "cpu_first_step": C["first_step_end"] - C["setup_end"], "cpu_steps": C["last_step_end"] - C["first_step_end"],
        "cpu_per_step_ms": 1000 * (C["last_step_end"] - C["first_step_end"]) / max(steps - 1, 1),
        "cpu_heldout_eval": C["eval_end"] - C["eval_start"], "cpu_save": C["saved"] - C["save_start"],
        "cpu_to_exit": C["main_end"] - C["last_step_end"]}
    return {
        "interpreter": T["python"] - t0,
        "import_torch": T["torch"] - T["python"],
        "cli": T["setup_start"] - T["torch"],
        "open_data": T["data_end"] - T["data_start"],
        "setup": T["setup_end"] - T["setup_start"],
        "optimizer": T["opt_end"] - T["opt_start"],
        "first_step": T["first_step_end"] - T["setup_end"],
        "to_first_step": T["first_step_end"] - t0,
        "steps": T["last_step_end"] - T["first_step_end"],
        "per_step_ms": 1000 * (T["last_step_end"] - T["first_step_end"]) / max(steps - 1, 1),
        "finish": T["saved"] - T["last_step_end"],
        "checkpoint": T["ckpt_end"] - T["ckpt_start"] if "ckpt_start" in T else 0.0,
        "heldout_eval": T["eval_end"] - T["eval_start"],
        "save": T["saved"] - T["save_start"],
        "exit": t_exit - T["saved"],
        "teardown": t_exit - T["main_end"],
        "after_last_step": t_exit - T["last_step_end"],
        "total": t_exit - t0,
        "cpu_total": cpu_total,
        "n_steps": steps,
        **cpu,
    }


def measure(store: Path, work: Path, name: str, repeat: int, extra: list[str]) -> dict[str, float]:
    runs = [run_once(store, work / f"{name}-{i}", extra) for i in range(repeat)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cd-startup-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        store = args.store or random_store(work, 2196)
        results = {"demo": measure(store, work, "demo", args.repeat, [])}
        if args.big_rows:
            big = random_store(work, args.big_rows)
            short = ["--tokens", str(20 * 4096)]
            results[f"{args.big_rows}_rows"] = measure(big, work, "big", args.repeat, short)
            # the same without the sha256 of every shard (the first buffer reads from all of them)
            results[f"{args.big_rows}_no_verify"] = measure(big, work, "big-nv", args.repeat, [*short, "--no-verify"])
    keys = list(results["demo"])
    print(f"{'phase (s, median of ' + str(args.repeat) + ')':<28}" + "".join(f"{k:>16}" for k in results))
    for key in keys:
        print(f"{key:<28}" + "".join(f"{r[key]:>16.3f}" for r in results.values()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
