"""The test run's own set-up (tests/conftest.py): under pytest-xdist (`make test`) the workers share the CPUs."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.unit


def test_an_xdist_worker_gets_its_share_of_the_threads(xdist_share):
    """N workers x T torch threads stay within the CPUs (on the 2-core machine: 1 thread a worker): each worker,
    and every process it starts, reads its share from OMP_NUM_THREADS. (Not torch.get_num_threads(): tests of
    conceptdict's own thread setting change it within the worker, in whatever order the files run.)"""
    workers, share = xdist_share
    if workers < 2:
        pytest.skip("runs only under pytest-xdist with several workers (make test)")
    got = os.environ.get("OMP_NUM_THREADS")
    if got is not None and got != str(share):
        pytest.skip(f"OMP_NUM_THREADS={got} was set before the run (kept as given)")
    assert got == str(share) and workers * share <= max(os.cpu_count() or 1, workers)
