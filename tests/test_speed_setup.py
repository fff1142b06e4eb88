"""Issue 38: what a process gets for speed on CPU (the OpenMP wait policy set by ``import conceptdict``) and the
multi-source rows of bench/train_step.py (each against its own encoder-matmul floor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOW = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code + "; " + SHOW], env={**base, **env}, capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return out.stdout.strip()


@pytest.mark.unit
def test_import_sets_passive_wait_policy_before_torch():
    assert _policy("import conceptdict") == "PASSIVE"
    assert _policy("import conceptdict.saes.kernels") == "PASSIVE"


@pytest.mark.unit
def test_user_policy_kept_and_torch_first_left_alone():
    assert _policy("import conceptdict", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    # torch's OpenMP runtime read the environment already: setting it now would only mislead
    assert _policy("import torch, conceptdict") == "None"


@pytest.mark.unit
def test_bench_multi_source_rows_pair_each_step_with_its_floor():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import train_step
    finally:
        sys.path.pop(0)
    p = dict(D=16, L=64, k=4, B=32, steps=1, warmup=1, device="cpu")
    for name, matmuls in (("kind-crosscoder", 2), ("kind-transcoder", 1), ("kind-skip-transcoder", 1), ("kind-clt", 2)):
        r = train_step._measure(name, p)
        assert r["floor_matmuls"] == matmuls
        assert r["step_s"] > 0 and r["floor_s"] > 0 and r["step_over_floor"] > 0
        assert r["latents"] == (64 * 2 if name == "kind-clt" else 64)  # a clt: L latents per layer, 2 layers
        json.dumps(r)
    rat = train_step.ratios({"kind-crosscoder": {"step_over_floor": 1.25}}, p)
    assert rat["crosscoder_over_its_floor (goal <= 1.5)"] == 1.25
