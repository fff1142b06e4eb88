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
from conceptdict.saes.checkpoint import load_sharded
from conceptdict.saes.stopping import due, end_step, observe, schedule
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


def test_a_rule_that_fires_after_a_rise_goes_back_to_the_weights_at_the_low():
    cfg = TrainConfig(latents=8, k=2, stop_patience=2, stop_threshold=0.05)
    model = torch.nn.Linear(3, 2)
    st = TrainState()
    at_20 = None
    for step, fvu, fired in [(10, 1.0, False), (20, 0.9, False), (30, 1.1, False), (40, 1.2, True)]:
        st.step = step
        with torch.no_grad():
            model.weight.add_(1.0)  # the steps before the evaluation
        at_20 = {k: v.clone() for k, v in model.state_dict().items()} if step == 20 else at_20
        assert observe(cfg, st, fvu, 100, model, train_fvu=0.2) is fired, step  # held-out 5-6x the training FVU
    s = st.stop
    assert (s.low, s.low_step, s.back_to, s.fired_at) == (0.9, 20, 20, 40) and s.weights is None
    assert s.end_step == end_step(20, 0.2, 100) + 20 == 44  # the decay of a run that fired at step 20
    assert all(torch.equal(model.state_dict()[k], v) for k, v in at_20.items())
    rates = []
    for st.step in (40, 42, 43):  # read as steps 20, 22, 23 of a 24-step run: its final decay, to 0 at step 44
        at, length = schedule(st, 100)
        rates.append(lr_at(at, 1.0, 0, length, 0.2))
    assert schedule(st, 100) == (23, 24) and rates == pytest.approx([1.0, 0.5, 0.25])
    assert "weights" not in s.to_dict() and json.dumps(s.to_dict())


@pytest.mark.parametrize("fvus,train_fvu", [
    ([1.0, 0.9, 0.89, 0.91], 0.1),  # 0.91 is within 5% of the low 0.89, though 9x the training FVU
    ([1.0, 0.9, 0.95, 1.0], 0.3),   # 11% above the low, but only 3.3x the training FVU: a noisy held-out set
    ([1.0, 0.9, 0.95, 1.0], None),  # no training FVU: no evidence of memorising
])
def test_a_rule_that_fires_without_memorising_goes_on_from_the_weights_it_has(fvus, train_fvu):
    cfg = TrainConfig(latents=8, k=2, stop_patience=2, stop_threshold=0.05)
    model = torch.nn.Linear(3, 2)
    st = TrainState()
    for step, fvu in zip((10, 20, 30, 40), fvus):
        st.step = step
        fired = observe(cfg, st, fvu, 100, model, train_fvu)
    assert fired and st.stop.low_step == (30 if fvus[2] < fvus[1] else 20) and st.stop.back_to is None
    assert st.stop.end_step == end_step(40, 0.2, 100) and schedule(st, 100) == (40, st.stop.end_step)
    assert st.stop.weights is None
    none = TrainState()  # without a model (the rule's own tests, old callers) nothing is kept
    for step, fvu in [(10, 1.0), (20, 2.0), (30, 3.0)]:
        none.step = step
        observe(cfg, none, fvu, 100)
    assert none.stop.back_to is None and none.stop.weights is None and none.stop.low is None


def _memorising(start: int = 0):
    """2 held-out batches of noise, then 298 batches that are the same 32 noise rows (which 64 latents memorise)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, 12, generator=gen)
    held = [torch.randn(32, 12, generator=gen) for _ in range(2)]
    yield from (held + [rows[torch.randperm(32, generator=gen)] for _ in range(298)])[start:]


def _memorise_cfg():
    return _cfg(latents=64, k=3, init_rows=32, tokens=298 * 32, stop_patience=3, stop_every=10, stop_threshold=0.01,
                checkpoint_every=5, log_every=50)


def test_a_run_that_memorises_goes_back_to_its_lowest_held_out_fvu_and_a_resumed_one_does_alike(tmp_path):
    """The held-out FVU (0.59, 0.37, 0.367, 0.39, 0.41 every 10 steps) rises once the latents memorise: the rule
    fires at 50, goes back to step 30's weights and decays over 7 steps; the dictionary ends below its low, and a run
    resumed from a checkpoint between the low and the firing (it carries the weights) or after it ends the same."""
    cfg = _memorise_cfg()
    full = train(cfg, _memorising, out=tmp_path / "full")
    s = full.training_summary
    rule = s["stopping"]
    assert (rule["low_step"], rule["back_to"], rule["fired_at"]) == (30, 30, 50)
    assert s["steps"] == rule["end_step"] == end_step(30, cfg.decay_fraction, 298) + 20
    assert s["heldout_eval"]["fvu"] < rule["low"] < rule["history"][-1][1]
    for crash_at, carries in [(2 + 44, True), (2 + 54, False)]:  # last checkpoints: step 40 (low 30, fires 50), 55
        out = tmp_path / f"cut-{crash_at}"
        with pytest.raises(Crash):
            train(cfg, crashing(_memorising, at=crash_at), out=out)
        ck = torch.load(out / "checkpoint.pt", weights_only=True)
        assert (ck["stop_weights"] is not None) == carries and ck["stop"]["low_step"] == 30
        resumed = train(cfg, _memorising, out=out, resume=True)
        for name, t in full.state_dict().items():
            assert torch.equal(resumed.state_dict()[name], t), (crash_at, name)
        assert resumed.training_summary["stopping"] == rule


def test_the_weights_at_the_low_are_cut_into_latent_shards_with_the_model(tmp_path):
    with pytest.raises(Crash):
        train(_memorise_cfg(), crashing(_memorising, at=2 + 44), out=tmp_path)
    whole = load_sharded(tmp_path, "checkpoint.pt", 0, 1)
    halves = [load_sharded(tmp_path, "checkpoint.pt", i, 2) for i in range(2)]
    for name, t in whole["stop_weights"].items():
        axis = whole["latent_axes"]["model"].get(name)
        got = [h["stop_weights"][name] for h in halves]
        assert torch.equal(torch.cat(got, axis) if axis is not None else got[0], t), name
        assert axis is None or got[0].shape[axis] == t.shape[axis] // 2


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
