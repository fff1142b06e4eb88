"""bench/gpu.py, the one prepared GPU script: runs end to end on the CPU with --dry-run, and refuses a real run
without CUDA with a clear message (no GPU is ever lent to CI)."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _run(*args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_dry_run_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run("--dry-run", "--json", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["failed"] == []
    steps = report["steps"]
    assert list(steps) == ["gpu-tests", "train-step", "train-bf16", "stream", "distributed", "sharding"]
    assert all(s["returncode"] == 0 for s in steps.values())
    for name, precision in (("train-step", "float32"), ("train-bf16", "bf16")):
        result = steps[name]["result"]
        assert result["params"]["precision"] == precision and result["params"]["device"] == "cpu"
        rows = result["results"]
        assert {"matmul", "train-topk", "kind-topk", "kind-batchtopk", "kind-crosscoder"} <= set(rows)
        assert not [r["error"] for r in rows.values() if "error" in r]
        assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "train-topk-bf16" in steps["train-bf16"]["result"]["results"]
    assert steps["stream"]["result"]["stream"] and steps["stream"]["result"]["fed"]
    assert steps["distributed"]["backend"] == "gloo"
    assert [r["processes"] for r in steps["distributed"]["result"]["runs"]][:2] == [1, 2]
    shards = steps["sharding"]["result"]["runs"]
    assert [r["shards"] for r in shards] == [1, 2] and all(r["plan_mib_per_rank"] > 0 for r in shards)


def _gpu_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench/gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sharded_step_needs_two_gpus_and_says_so(tmp_path):
    """The 2-shard NCCL step runs with a GPU per shard; on one GPU it is skipped with the reason, not failed."""
    gpu = _gpu_script()
    args = argparse.Namespace(dry_run=False, bench_python=None)
    by_name = {name: cmd for name, cmd, _ in gpu.steps(args, 2, tmp_path)}
    assert by_name["sharding"][by_name["sharding"].index("--backend") + 1] == "nccl"
    assert "--device" in by_name["sharding"] and "cuda" in by_name["sharding"]
    assert {name: cmd for name, cmd, _ in gpu.steps(args, 1, tmp_path)}["sharding"] is None
    assert "two" in gpu.ONE_GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_refuses_a_real_run_without_cuda(tmp_path):
    proc = _run("--json", str(tmp_path / "gpu.json"), tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "gpu.json").exists()
