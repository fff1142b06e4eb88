"""Issue 38: one prepared script for a lent GPU: every GPU figure this project needs, in one run, into one JSON.

    python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 bench/gpu.py --json $OUT/gpu.json
    .venv/bin/python bench/gpu.py --dry-run --json /tmp/gpu-dry.json   # the same steps on CPU at tiny shapes

Steps, each a subprocess with its own time limit (a step that fails or runs out of time is recorded with the end
of its output, and the next one runs; the limits add up to ``--budget`` seconds, 480 by default, the 8 minutes of
issue 38):

  env          torch, CUDA, the GPU's name and memory, numba/triton versions
  gpu-tests    ``pytest -m gpu``: the gpu tier (Triton kernels against the dense reference, crosscoder, cache)
  train-step   ``bench/train_step.py --device cuda`` at its default shapes (D 768, L 16384, B 4096), float32:
               the matmul floor, TopK, BatchTopK, the whole train step, the crosscoder (2 sources), and sparsify
               and SAELens when ``--bench-python`` has them (a side environment: carry their wheels, see below)
  train-bf16   the same rows with ``--precision bf16`` (the encoder matmul in bf16) and train-topk-bf16
  stream       ``bench/stream_throughput.py --device cuda``: does the store stream keep a GPU step fed?
  sharding     ``bench/sharding.py --small --shards 1 2``: latent shards over NCCL, one GPU per shard, with the
               plan beside the measured peaks; on one GPU it is skipped and the JSON says why
  distributed  ``bench/distributed.py --nproc 2``: NCCL with one GPU per process when there are two GPUs; on one
               GPU, NCCL refuses two processes on the same device, so both processes share the GPU over gloo
               (which reduces CUDA tensors through the host): recorded as ``backend`` in the JSON

``--dry-run`` runs the same steps on the CPU at tiny shapes (``train_step.py --tiny``, small stream and
distributed presets, the gpu tier, which skips without CUDA): it checks that the script and every command it
runs work, and measures nothing. It is run by ``make test`` (tests/test_bench_gpu.py).

sparsify and SAELens on the GPU machine, which has no network: on a machine with one, ``pip download`` their wheels
(``eai-sparsify``, ``sae-lens`` and what they need beyond the machine's packages) into a folder of the repository
that git ignores, carry it, install them with ``pip install --no-index --target /tmp/bench-site``, and pass
``--bench-python`` a wrapper that sets ``PYTHONPATH=/tmp/bench-site``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARE = {"gpu-tests": 0.20, "train-step": 0.28, "train-bf16": 0.14, "stream": 0.14, "distributed": 0.12,
         "sharding": 0.12}
"""Each step's share of ``--budget``: what they took is in the JSON, to resize them after a first run."""


ONE_GPU = ("one GPU: a 2-shard step needs two (NCCL refuses two processes on one device); bench/distributed.py's "
           "gloo run covers two processes here")


def env_info() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    bf16=torch.cuda.is_bf16_supported())
    for name in ("numba", "triton", "safetensors"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def steps(args: argparse.Namespace, gpus: int, tmp: Path) -> list[tuple[str, list[str] | None, Path | None]]:
    """(name, command, the JSON it writes) for every step, on CUDA or, with --dry-run, on the CPU at tiny sizes."""
    py, dev = sys.executable, "cpu" if args.dry_run else "cuda"
    shape = ["--tiny"] if args.dry_run else []
    rows = ["matmul", "ours-topk", "ours-batchtopk", "train-topk", "kind-topk", "kind-batchtopk", "kind-crosscoder"]
    bf16_rows = ["matmul", "train-topk", "train-topk-bf16", "kind-topk", "kind-batchtopk", "kind-crosscoder"]
    stream = (["--rows", "8192", "--d", "64", "--shard-rows", "2048", "--batch-size", "512", "--buffer-rows", "2048",
               "--repeats", "1", "--step-latents", "128", "--step-k", "8", "--steps", "4", "--scale-d", "64",
               "--scale-latents", "256,512", "--scale-batch", "64"] if args.dry_run else
              ["--rows", "131072", "--repeats", "2", "--scale-latents", "4096,16384,65536,262144"])
    nccl = gpus >= 2
    dist = ["--small", "--nproc", "2", "--device", dev, "--backend", "nccl" if nccl else "gloo"]
    bench_python = ["--bench-python", args.bench_python] if args.bench_python else []
    return [
        ("gpu-tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(ROOT / "tests")], None),
        ("train-step", [py, str(ROOT / "bench/train_step.py"), "--device", dev, *shape, "--only", *rows,
                        *(["sparsify", "saelens"] if args.bench_python else []), *bench_python,
                        "--json", str(tmp / "train-step.json")], tmp / "train-step.json"),
        ("train-bf16", [py, str(ROOT / "bench/train_step.py"), "--device", dev, *shape, "--precision", "bf16",
                        "--only", *bf16_rows, "--json", str(tmp / "train-bf16.json")], tmp / "train-bf16.json"),
        ("stream", [py, str(ROOT / "bench/stream_throughput.py"), "--device", dev, "--dir", str(tmp), *stream,
                    "--json", str(tmp / "stream.json")], tmp / "stream.json"),
        ("distributed", [py, str(ROOT / "bench/distributed.py"), *dist, "--json", str(tmp / "distributed.json")],
         tmp / "distributed.json"),
        ("sharding", [py, str(ROOT / "bench/sharding.py"), "--small", "--shards", "1", "2", "--device", dev,
                      "--backend", "nccl" if nccl else "gloo", "--json", str(tmp / "sharding.json")]
         if nccl or args.dry_run else None, tmp / "sharding.json"),
    ]


def run_step(name: str, cmd: list[str], result: Path | None, limit: float) -> dict:
    """Run one step within ``limit`` seconds; its JSON (if it writes one), exit code, time and output's end."""
    t = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        out = "".join(s.decode() if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr))
    record = {"command": " ".join(cmd), "returncode": code, "seconds": round(time.perf_counter() - t, 1),
              "limit_s": round(limit), "output_tail": out[-3000:]}
    if result is not None and result.exists():
        record["result"] = json.loads(result.read_text())
    print(f"[gpu.py] {name}: exit {code} in {record['seconds']} s (limit {record['limit_s']} s)", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="where the one JSON goes")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU at tiny shapes: checks, measures nothing")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    p.add_argument("--bench-python", help="an interpreter with eai-sparsify and sae-lens (their rows are skipped without)")
    p.add_argument("--only", nargs="*", choices=list(SHARE), help="run only these steps")
    args = p.parse_args(argv)
    info = env_info()
    if not args.dry_run and not info["cuda_available"]:
        p.error("no CUDA device here: run on a GPU machine, or pass --dry-run to check the script on the CPU")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.parent / f".{args.json.stem}-work"
    tmp.mkdir(exist_ok=True)
    report = {"dry_run": args.dry_run, "budget_s": args.budget, "env": info, "steps": {}}
    t0 = time.perf_counter()
    for name, cmd, result in steps(args, info["gpus"], tmp):
        if args.only and name not in args.only:
            continue
        if cmd is None:  # a step this machine cannot run: said, not failed
            report["steps"][name] = {"returncode": 0, "skipped": ONE_GPU}
            print(f"[gpu.py] {name}: skipped: {ONE_GPU}", flush=True)
            continue
        report["steps"][name] = run_step(name, cmd, result, SHARE[name] * args.budget)
        if name == "distributed":
            report["steps"][name]["backend"] = cmd[cmd.index("--backend") + 1]
        args.json.write_text(json.dumps(report, indent=1))  # after every step: a killed run keeps what it had
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["failed"] = [n for n, r in report["steps"].items() if r["returncode"] != 0]
    args.json.write_text(json.dumps(report, indent=1))
    print(f"[gpu.py] {len(report['steps'])} steps in {report['seconds']} s; failed: {report['failed'] or 'none'}; "
          f"-> {args.json}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
