"""The prefetching training stream: a background thread reads and shuffles the next buffer fill, and the
batches are exactly the ones the sequential stream (``prefetch=0``) yields, in every mode (epochs, held-out
rows, resume, ranks, several sources, dtypes); a failure in the thread reaches the caller, and a training run
that crashes and resumes on the prefetching stream ends with the weights of an uninterrupted sequential run."""

from __future__ import annotations

import threading

import pytest
import torch

from conceptdict.activations import ActivationStore, stream_batches
from conceptdict.activations.stream import prefetched
from conceptdict.saes import train, train_config
from crashing import Crash, crashing
from test_store import make_store, row_ids

pytestmark = pytest.mark.unit


def _both(store, hps, batch_size, **kw) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return (list(stream_batches(store, hps, batch_size, prefetch=0, **kw)),
            list(stream_batches(store, hps, batch_size, prefetch=2, **kw)))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"batch {i} differs"


@pytest.mark.parametrize("kw", [
    dict(seed=3, buffer_rows=40, epochs=3),
    dict(seed=2, buffer_rows=48, epochs=4, holdout_batches=3),
    dict(seed=2, buffer_rows=48, epochs=4, holdout_batches=3, start_batch=29),  # resume mid-fill, later epoch
    dict(seed=1, buffer_rows=64, epochs=2, start_batch=13, part=(1, 2)),
    dict(seed=1, buffer_rows=16, epochs=1, part=(0, 3)),
])
def test_prefetching_stream_yields_the_sequential_batches(tmp_path, kw):
    store = make_store(tmp_path / "s", {"h": row_ids(203), "g": -row_ids(203)}, shard_rows=20)
    _same(*_both(store, "h", 8, **kw))
    _same(*_both(store, ["h", "g"], 8, **kw))
    if "start_batch" in kw and "part" not in kw:  # resuming: exactly the tail of the stream from batch 0
        _same(list(stream_batches(store, "h", 8, **{**kw, "start_batch": 0}))[kw["start_batch"]:],
              list(stream_batches(store, "h", 8, **kw)))


def test_rows_travel_in_the_store_dtype(tmp_path):
    x = torch.randn(150, 6) * 3
    store = make_store(tmp_path / "s", {"h": x.bfloat16()}, dtype="bfloat16", shard_rows=16)
    raw = list(stream_batches(store, "h", 10, seed=0, buffer_rows=40, dtype=None))
    as_f32 = list(stream_batches(store, "h", 10, seed=0, buffer_rows=40))
    assert all(b.dtype == torch.bfloat16 for b in raw) and all(b.dtype == torch.float32 for b in as_f32)
    _same([b.float() for b in raw], as_f32)
    _same(raw, list(stream_batches(store, "h", 10, seed=0, buffer_rows=40, dtype=None, prefetch=0)))
    kept = {tuple(r.tolist()) for b in raw for r in b.float()}
    assert kept <= {tuple(r.tolist()) for r in x.bfloat16().float()}  # every row is a stored row, unrounded


def test_a_failure_in_the_reading_thread_reaches_the_caller(tmp_path, monkeypatch):
    """A store read that fails on the third call raises in the consumer, promptly, with its own error."""
    store = make_store(tmp_path / "s", {"h": row_ids(400)}, shard_rows=20)
    calls, original = [0], ActivationStore.rows

    def rows(self, *args):
        calls[0] += 1
        if calls[0] == 30:
            raise OSError("disk went away")
        return original(self, *args)

    monkeypatch.setattr(ActivationStore, "rows", rows)
    seen: dict = {}

    def consume():
        try:
            seen["n"] = sum(1 for _ in stream_batches(store, "h", 8, seed=0, buffer_rows=32, epochs=None))
        except OSError as exc:
            seen["error"] = exc

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the stream hung after its reading thread failed"
    assert "disk went away" in str(seen.get("error"))


def test_closing_the_stream_stops_its_thread(tmp_path):
    store = make_store(tmp_path / "s", {"h": row_ids(400)}, shard_rows=20)
    it = stream_batches(store, "h", 8, seed=0, buffer_rows=32, epochs=None, prefetch=3)
    next(it)
    assert any(t.name == "stream-prefetch" for t in threading.enumerate())
    it.close()
    assert not any(t.name == "stream-prefetch" for t in threading.enumerate())


def test_prefetched_keeps_order_and_raises_where_the_item_was():
    def items():
        yield from range(5)
        raise KeyError("sixth")

    got = []
    with pytest.raises(KeyError, match="sixth"):
        for v in prefetched(items(), 2):
            got.append(v)
    assert got == [0, 1, 2, 3, 4]
    assert list(prefetched(iter(range(7)), 0)) == list(range(7))


@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_crash_and_resume_on_the_prefetching_stream_is_bit_exact(tmp_path, kind):
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(24, 10, generator=g)
    codes = torch.rand(900, 24, generator=g) * (torch.rand(900, 24, generator=g) < 0.15)
    store = make_store(tmp_path / "s", {"h": codes @ atoms}, shard_rows=64)
    cfg = train_config(kind=kind, latents=32, k=3, batch_size=32, tokens=32 * 14, eval_batches=2, init_rows=64,
                       checkpoint_every=3, log_every=1, kernel_impl="torch", device="cpu", seed=1,
                       **({"threshold_start_step": 2} if kind == "batchtopk" else {}))

    def batches(prefetch: int):
        return lambda start: stream_batches(store, "h", 32, seed=1, buffer_rows=96, epochs=None, start_batch=start,
                                            holdout_batches=2, prefetch=prefetch)

    full = train(cfg, batches(0), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(batches(2), at=11), out=tmp_path / "cut")
    resumed = train(cfg, batches(2), out=tmp_path / "cut", resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
