"""``activations.summary.check_signal`` (run by every ``train`` on a store before its first batch) reads each sampled
run once and stops the zero / constant tests at the first run that passes: the refusals and their counts are those
of checking every sampled row, wherever in the store the NaN, the signal or the one differing row is."""

from __future__ import annotations

import pytest
import torch
from conceptdict.activations import StoreError, integrity
from conceptdict.activations.summary import check_signal
from test_store import make_store

pytestmark = pytest.mark.unit

HP = "h"
N, D, MAX = 320, 4, 64  # 16 runs of 4 rows sampled out of 320 (max_rows 64)


def _sampled(n: int = N, max_rows: int = MAX) -> list[int]:
    """The rows check_signal samples (its 16 evenly spaced runs)."""
    per = max(1, min(n, max_rows) // 16)
    starts = sorted({(n - per) * i // 15 for i in range(16)}) if n > max_rows else [0]
    return [r for a in starts for r in range(a, min(n, a + (per if n > max_rows else n)))]


def _check(tmp_path, rows: torch.Tensor, dtype="float32"):
    store = make_store(tmp_path / "s", {HP: rows}, dtype=dtype, shard_rows=50)
    check_signal(store, HP, max_rows=MAX)


def test_a_nan_in_the_last_run_is_refused_with_every_bad_value_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity.POLICY, "verify_hash", False)  # (the shards' check refuses it first otherwise)
    rows = torch.randn(N, D)
    last = _sampled()[-1]
    rows[last, 1], rows[_sampled()[0], 0], rows[last - 1, 2] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(StoreError, match=r"holds NaN/Inf \(3 values in 64 sampled rows\)"):
        _check(tmp_path, rows)


def test_rows_whose_sum_overflows_are_finite_and_pass(tmp_path):
    _check(tmp_path, torch.full((N, D), 3e38) * torch.tensor([1.0, 0.5, 1.0, 0.25]) + torch.arange(N)[:, None] * 1e32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_signal_only_in_the_last_sampled_run_is_signal(tmp_path, dtype):
    rows = torch.zeros(N, D)
    rows[_sampled()[-1], 3] = 1.0
    _check(tmp_path, rows, dtype)
    rows = torch.full((N, D), 2.0)
    rows[_sampled()[-1], 0] = -2.0  # one row differs, in the last run: not constant
    _check(tmp_path / "b", rows, dtype)


@pytest.mark.parametrize("n", [N, 40])  # sampled in runs, and read whole
def test_zero_and_constant_stores_are_refused_with_the_sampled_count(tmp_path, n):
    count = len(_sampled(n))
    with pytest.raises(StoreError, match=f"is all zeros \\({count} sampled rows\\)"):
        _check(tmp_path, torch.zeros(n, D))
    rows = torch.zeros(n, D)
    rows[[r for r in range(n) if r not in set(_sampled(n))]] = 5.0  # signal only where nothing is sampled
    if n > MAX:
        with pytest.raises(StoreError, match="is all zeros"):
            _check(tmp_path / "b", rows)
    with pytest.raises(StoreError, match=f"holds the same row {count} times"):
        _check(tmp_path / "c", torch.tensor([1.0, -2.0, 0.0, 3.0]).repeat(n, 1))
