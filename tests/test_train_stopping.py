"""The stopping rule (saes/stopping.py): a run stops once its held-out FVU has stopped improving, after a final
learning-rate decay; deterministic, and a resumed run stops at the same step with the same weights."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from conceptdict.saes import train, train_config
from conceptdict.saes.checkpoint import TrainState
from conceptdict.saes.config import DEFAULT_STOP_PATIENCE, TrainConfig, fit_to_store
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.stopping import due, end_step, observe
from conceptdict.saes.update import lr_at
from crashing import Crash, crashing
from generators.synthetic import SyntheticSpec, synthetic_batches

pytestmark = pytest.mark.unit

SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=60, seed=3)
UPPER = 58  # training steps of the 60 batches less the 2 held out (tokens below)


def _cfg(**kw):
    base = dict(latents=32, k=3, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu", init_rows=64,
                kernel_impl="reference", tokens=UPPER * 64, stop_patience=2, stop_every=3, stop_threshold=0.05,
                calibration_batches=0)
    return train_config(**flat_for_kind(base | kw, kw.get("kind", "topk")))


def test_observe_fires_after_patience_evaluations_without_a_relative_gain():
    cfg = TrainConfig(latents=8, k=2, stop_patience=2, stop_threshold=0.1)
    st = TrainState()
    for step, fvu, fired in [(10, 1.0, False), (20, 0.85, False), (30, 0.80, False), (40, 0.78, True)]:
        st.step = step
        assert observe(cfg, st, fvu, 100) is fired, step
    # 0.80 and 0.78 are within 10% of 0.85: the best stays 0.85, two evaluations without a gain
    assert st.stop.best == 0.85 and st.stop.fired_at == 40 and st.stop.end_step == 49
    assert [h[0] for h in st.stop.history] == [10, 20, 30, 40]
    slow = TrainState()  # 6% per evaluation: every second one gains more than 10% on the best, so it never fires
    for i in range(8):
        slow.step = 10 * (i + 1)
        assert not observe(cfg, slow, 0.94 ** i, 1000)


def test_end_step_continues_the_schedule_into_its_final_decay():
    e = end_step(40, 0.2, 100)
    assert e == 49 and 49 - int(49 * 0.2) == 40 and 48 - int(48 * 0.2) < 40  # the first whose decay starts at 40
    assert [lr_at(s, 1.0, 0, e, 0.2) for s in (39, 40, 46, 48)] == pytest.approx([1.0, 1.0, 3 / 9, 1 / 9])
    assert end_step(90, 0.2, 100) == 100 and end_step(7, 0.0, 100) == 7


def test_due_only_before_the_upper_bounds_own_decay():
    cfg = TrainConfig(latents=8, k=2, stop_patience=2, stop_every=10)
    st = TrainState()
    st.step = 70
    assert due(cfg, st, 100) and not due(cfg, st, 80)  # 80 steps: its decay begins at step 64
    st.step = 75
    assert not due(cfg, st, 100)
    assert not due(TrainConfig(latents=8, k=2), st, 100)  # off by default outside a store run


def test_a_store_run_leaving_tokens_out_stops_by_default_and_one_that_sets_them_does_not():
    auto = fit_to_store(TrainConfig(latents=8, k=2), 20_000)
    assert auto.tokens is not None and auto.stop_patience == DEFAULT_STOP_PATIENCE
    assert fit_to_store(TrainConfig(latents=8, k=2, tokens=5000), 20_000).stop_patience is None
    assert fit_to_store(TrainConfig(latents=8, k=2, stop_patience=0), 20_000).stop_patience == 0
    with pytest.raises(ValueError, match="stop_threshold=1.5"):
        TrainConfig(latents=8, k=2, stop_threshold=1.5)


def test_the_rule_stops_before_the_upper_bound_and_off_it_runs_to_it():
    stopped = train(_cfg(), functools.partial(synthetic_batches, SPEC))
    rule = stopped.training_summary["stopping"]
    assert rule["fired_at"] is not None and stopped.training_summary["steps"] == rule["end_step"] < UPPER
    assert rule["upper_bound"] == UPPER and all(h[0] % 3 == 0 for h in rule["history"])
    full = train(_cfg(stop_patience=0), functools.partial(synthetic_batches, SPEC))
    assert full.training_summary["steps"] == UPPER and full.training_summary["stopping"] is None


@pytest.mark.parametrize("kind,crash_at", [("topk", 10), ("topk", 15), ("batchtopk", 15)])
def test_a_resumed_run_stops_at_the_same_step_with_the_same_weights(tmp_path, kind, crash_at):
    """Crash before the rule fires (checkpoint at step 6) or after (step 12 carries the end step)."""
    cfg = _cfg(kind=kind, threshold_start_step=2, calibration_batches=1 if kind == "batchtopk" else 0)
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=crash_at), out=tmp_path / "cut")
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    fired = full.training_summary["stopping"]["fired_at"]
    assert fired is not None and (ck["stop"]["end_step"] is not None) == (ck["step"] >= fired)
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    summary = lambda d: json.loads((d / "config.json").read_text())["training"]  # noqa: E731
    assert summary(tmp_path / "cut")["stopping"] == summary(tmp_path / "full")["stopping"]
    assert summary(tmp_path / "cut")["steps"] == summary(tmp_path / "full")["steps"] < UPPER


def test_a_checkpoint_from_before_the_rule_resumes_with_the_rule_off(tmp_path, caplog):
    """A checkpoint that records no stop_* settings (written before the rule existed) resumes under a config with the
    rule on, runs to its recorded length with the rule off (and says so), and ends as an uninterrupted run without
    the rule does."""
    off = train(_cfg(stop_patience=0), functools.partial(synthetic_batches, SPEC))
    with pytest.raises(Crash):
        train(_cfg(), crashing(functools.partial(synthetic_batches, SPEC), at=5), out=tmp_path)
    path = tmp_path / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    assert ck["step"] == 3 and ck["stop"]["history"]  # written after the first evaluation
    for key in ("stop_patience", "stop_threshold", "stop_every"):
        del ck["config"][key]
    del ck["stop"]
    torch.save(ck, path)
    with caplog.at_level("INFO", logger="conceptdict.saes.checkpoint"):
        resumed = train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path, resume=True)
    assert "written before the stopping rule existed" in caplog.text and "stop_patience=0" in caplog.text
    assert resumed.training_summary["steps"] == UPPER and resumed.training_summary["stopping"] is None
    for name, t in off.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    again = torch.load(path, weights_only=True)  # its next checkpoints record the rule off: they resume as they are
    assert again["config"]["stop_patience"] == 0
    with pytest.raises(ValueError, match="settings that differ"):  # one that records the rule is held to it
        ck["config"]["stop_patience"] = 0
        torch.save(ck, path)
        train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path, resume=True)
