"""``precision auto`` (TrainConfig's default): bf16 where the device computes it natively and the kind takes it,
float32 elsewhere; the run records what it resolved to; ``CONCEPTDICT_PRECISION`` pins it (the suite pins float32)."""

from __future__ import annotations

import functools

import pytest
import torch
from conceptdict.saes import TrainConfig, precision, train, train_config
from conceptdict.saes.flat import flat_for_kind
from crashing import Crash, crashing
from generators.synthetic import SyntheticSpec, synthetic_batches

pytestmark = pytest.mark.unit

SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=14, seed=3)
CPU = torch.device("cpu")


@pytest.fixture
def detected(monkeypatch):
    """Set what the bf16 detection answers (the suite's float32 pin removed): detected(True) / detected(False)."""
    monkeypatch.delenv(precision.PIN_ENV, raising=False)

    def answer(native: bool) -> None:
        monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    return answer


def _cfg(**kw):
    base = dict(latents=32, k=3, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu", init_rows=64,
                kernel_impl="numba")
    return train_config(**flat_for_kind(base | kw, kw.get("kind", "topk")))


def test_the_default_is_auto_and_the_suite_pins_it_to_float32():
    assert TrainConfig(latents=32, k=4).precision == "auto"
    assert precision.resolve_precision("auto", CPU, True, "auto") == "float32"  # tests/conftest.py's pin


@pytest.mark.parametrize("native", [False, True])
def test_auto_picks_bf16_only_where_it_is_native_and_the_kind_takes_it(detected, native):
    detected(native)
    want = "bf16" if native else "float32"
    assert precision.resolve_precision("auto", CPU, True, "auto") == want
    assert precision.resolve_precision("auto", CPU, True, "numba") == want
    assert precision.resolve_precision("auto", CPU, False, "auto") == "float32"  # relu, spade: float32 only
    assert precision.resolve_precision("auto", CPU, True, "reference") == "float32"  # bf16 needs a fast kernel
    assert precision.resolve_precision("auto", CPU, True, "auto", resumed="float32") == "float32"
    assert precision.resolve_precision("auto", CPU, True, "auto", resumed="bf16") == "bf16"
    for explicit in ("float32", "bf16", "float64"):
        assert precision.resolve_precision(explicit, CPU, True, "auto") == explicit


def test_the_pin_overrides_the_detection_and_a_bad_pin_is_named(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    monkeypatch.setenv(precision.PIN_ENV, "float32")
    assert precision.resolve_precision("auto", CPU, True, "auto") == "float32"
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    monkeypatch.setenv(precision.PIN_ENV, "bf16")
    assert precision.resolve_precision("auto", CPU, True, "auto") == "bf16"
    monkeypatch.setenv(precision.PIN_ENV, "half")
    with pytest.raises(ValueError, match="CONCEPTDICT_PRECISION='half': use one of \\['float32', 'bf16'\\]"):
        precision.resolve_precision("auto", CPU, True, "auto")


@pytest.mark.parametrize("native", [False, True])
def test_an_auto_run_trains_and_records_what_it_resolved_to(detected, tmp_path, native):
    detected(native)
    want = "bf16" if native else "float32"
    auto = train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path / "auto")
    assert auto.training_summary["config"]["precision"] == want
    assert torch.load(tmp_path / "auto" / "checkpoint.pt", weights_only=True)["config"]["precision"] == want
    explicit = train(_cfg(precision=want), functools.partial(synthetic_batches, SPEC))
    other = train(_cfg(precision="float32" if native else "bf16"), functools.partial(synthetic_batches, SPEC))
    assert torch.equal(auto.W_dec, explicit.W_dec)
    assert not torch.equal(auto.W_dec, other.W_dec)
    relu = train(_cfg(kind="relu"), functools.partial(synthetic_batches, SPEC))
    assert relu.training_summary["config"]["precision"] == "float32"


def test_an_auto_run_resumes_in_the_precision_it_started_in_whatever_the_machine(detected, tmp_path):
    detected(True)
    full = train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(_cfg(), crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    detected(False)  # resumed on a machine that would pick float32
    resumed = train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    assert resumed.training_summary["config"]["precision"] == "bf16"
    assert torch.equal(resumed.W_dec, full.W_dec)


def test_the_cli_flag_defaults_to_auto_and_takes_it():
    from conceptdict.cli.args import settings_from
    from conceptdict.cli.main import build_parser
    from conceptdict.train_api import (
        LiveConfig,
        TrainCommand,
        train_configs,
        train_settings,
    )

    for extra, want in (([], "auto"), (["--precision", "auto"], "auto"), (["--precision", "float32"], "float32")):
        args = build_parser().parse_args(["train", "--store", "s", "--latents", "32", "--k", "4", *extra])
        assert train_configs(**settings_from(args, TrainCommand, LiveConfig, train_settings()))[1].precision == want
