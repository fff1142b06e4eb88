"""numba's thread pool leaves torch's thread count alone: the pool's start (under numba's OpenMP layer) sets the
process's OpenMP thread count, which torch reads, to numba's. Started lazily by the first parallel kernel, it moved
a training run onto another torch thread count after its first step, and a second run of the same seed in the same
process did not move: the two could round differently (saes/kernels/numba_impl.py starts it at import, keeping
torch's count)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import torch
assert torch.get_num_threads() == 1, torch.get_num_threads()
from conceptdict.saes import kernels
x, W, b = torch.randn(64, 8, requires_grad=True), torch.randn(8, 300, requires_grad=True), torch.zeros(300)
code = kernels.encode_topk(x, W, b, 4, impl="numba")
kernels.sparse_decode(code.values, code.indices, torch.randn(300, 8), torch.zeros(8), impl="numba").sum().backward()
import numba
print(torch.get_num_threads(), numba.get_num_threads())
"""


def test_numba_kernels_keep_torchs_thread_count():
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "2"], out.stderr  # torch as OMP_NUM_THREADS gave it, numba with its own 2
