"""``TrainConfig.precision``: the fused encoder's matmul in bf16 chooses the latents, the kept values, loss, gradients,
weights and Adam stay float32; fp16 is refused off CUDA; a bf16 run resumes bit for bit and cannot resume as float32."""

from __future__ import annotations

import functools

import pytest
import torch

from conceptdict.saes import TrainConfig, train, train_config
from conceptdict.saes import kernels
from conceptdict.saes.flat import flat_for_kind
from crashing import Crash, crashing
from generators.synthetic import SyntheticSpec, synthetic_batches

SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=14, seed=3)


def _cfg(**kw):
    base = dict(latents=32, k=3, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu", init_rows=64,
                kernel_impl="numba", precision="bf16")
    return train_config(**flat_for_kind(base | kw, kw.get("kind", "topk")))


@pytest.mark.unit
@pytest.mark.parametrize("impl", ["numba", "torch"])
@pytest.mark.parametrize("batch", [False, True])
def test_a_bf16_matmul_chooses_the_entries_and_their_values_are_float32(impl, batch):
    torch.manual_seed(0)
    x = torch.randn(300, 64)
    W = (torch.randn(512, 64) / 8).t().requires_grad_()  # latent-major, as SparseCoder keeps it
    b = torch.randn(512) * 0.01
    enc = kernels.encode(x, W, b, 8, batch=batch, impl=impl, mm_dtype=torch.bfloat16)
    exact = torch.relu(x @ W.detach() + b).gather(1, enc.indices)
    assert enc.values.dtype == torch.float32
    torch.testing.assert_close(enc.values.detach(), exact * (enc.values > 0), rtol=0, atol=1e-5)
    if batch:  # BatchTopK's threshold estimate: the smallest kept float32 value
        assert enc.smallest == enc.values[enc.values > 0].min()
    full = kernels.encode(x, W, b, 8, batch=batch, impl=impl)
    assert not torch.equal(enc.values.detach(), full.values.detach())  # rounded scores choose some other entries
    enc.values.sum().backward()
    assert W.grad.dtype == torch.float32 and W.grad.abs().sum() > 0


@pytest.mark.unit
def test_precision_refusals_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="precision='fp16' needs a CUDA device, not cpu; on CPU use precision bf16"):
        TrainConfig(latents=32, k=4, device="cpu", precision="fp16")
    with pytest.raises(ValueError, match="precision='half': use one of"):
        TrainConfig(latents=32, k=4, precision="half")
    with pytest.raises(ValueError, match="precision='bf16': kind 'relu' trains in float32 only"):
        train_config(latents=32, k=4, kind="relu", precision="bf16")
    with pytest.raises(ValueError, match="needs a fast kernel, not kernel_impl='reference'"):
        train(_cfg(kernel_impl="reference"), functools.partial(synthetic_batches, SPEC))
    if not torch.cuda.is_available():  # device auto resolves to the CPU: refused when the run starts
        with pytest.raises(ValueError, match="precision='fp16' needs a CUDA device, not cpu"):
            train(_cfg(device="auto", precision="fp16"), functools.partial(synthetic_batches, SPEC))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_a_bf16_run_resumes_bit_identically_and_not_as_float32(tmp_path, kind):
    cfg = _cfg(kind=kind, threshold_start_step=2)
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 6 and ck["config"]["precision"] == "bf16"
    with pytest.raises(ValueError, match=r"differ from the checkpoint.*'precision': \('bf16', 'float32'\)"):
        train(_cfg(kind=kind, threshold_start_step=2, precision="float32"), functools.partial(synthetic_batches, SPEC),
              out=tmp_path / "cut", resume=True)
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    as_float32 = train(_cfg(kind=kind, threshold_start_step=2, precision="float32"),
                       functools.partial(synthetic_batches, SPEC))
    assert not torch.equal(as_float32.W_dec, full.W_dec)  # the setting reached the step


PLANTED = SyntheticSpec(n_atoms=64, d=32, active=3, noise=0.02, batch_size=256, n_batches=150, seed=0)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_a_planted_bf16_run_reaches_float32_heldout_fvu(kind):
    """Held-out FVU of bf16 within 2% (relative) of float32's on a planted store (146 steps of 256 rows, L = 128,
    k = 6); measured 0.1280 against 0.1269 (topk) and 0.1059 against 0.1057 (batchtopk)."""
    fvu = {}
    for precision in ("float32", "bf16"):
        cfg = TrainConfig(latents=128, k=6, kind=kind, tokens=146 * 256, kernel_impl="numba", device="cpu",
                          log_every=1000, precision=precision)
        fvu[precision] = train(cfg, functools.partial(synthetic_batches, PLANTED)).training_summary["heldout_eval"]["fvu"]
    assert fvu["float32"] < 0.15, fvu
    assert abs(fvu["bf16"] - fvu["float32"]) <= 0.02 * fvu["float32"], fvu


@pytest.mark.unit
@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_that_emulates_it_is_warned_about(monkeypatch, caplog, native):
    from conceptdict.saes import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    monkeypatch.setattr(precision, "_warned", set())  # once per process: this test's process starts afresh
    monkeypatch.setattr(precision, "emulated_bf16_cost", lambda: 4.25)  # what the warning says it measured
    with caplog.at_level("WARNING", logger="conceptdict.saes.precision"):
        for _ in range(2):
            precision.check_precision("bf16", torch.device("cpu"))
            precision.check_precision("float32", torch.device("cpu"))
    warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if native else 1), warned
    assert native or "4.2x slower than float32 here" in warned[0]


@pytest.mark.unit
def test_the_flag_reaches_the_config_and_a_checkpoint_from_before_it_resumes_as_float32(tmp_path):
    from conceptdict.cli.args import settings_from
    from conceptdict.cli.main import build_parser
    from conceptdict.train_api import LiveConfig, TrainCommand, train_configs, train_settings

    args = build_parser().parse_args(["train", "--store", "s", "--latents", "32", "--k", "4", "--precision", "bf16"])
    assert train_configs(**settings_from(args, TrainCommand, LiveConfig, train_settings()))[1].precision == "bf16"
    cfg = _cfg(precision="float32")
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    path = tmp_path / "cut" / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    del ck["config"]["precision"]  # written before the setting existed
    torch.save(ck, path)
    with pytest.raises(ValueError, match=r"'precision': \('float32', 'bf16'\)"):
        train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    assert torch.equal(resumed.W_dec, full.W_dec)


@pytest.mark.unit
def test_float64_trains_in_float64_on_an_implementation_that_computes_it_and_saves_float32(tmp_path):
    """precision float64: every kind takes it (relu too), ``auto`` resolves to an implementation that computes in
    float64 (numba and triton round to float32 and are refused by name), the checkpoint holds float64 weights and
    the saved dictionary is float32."""
    cpu = torch.device("cpu")
    assert kernels.resolve_impl("encode", "auto", cpu, torch.float64) == "torch"
    assert kernels.resolve_impl("encode", "auto", cpu, torch.float32) in ("numba", "torch")
    with pytest.raises(ValueError, match="kernel_impl='numba' computes in float32; precision float64 needs"):
        train_config(latents=32, k=4, precision="float64", kernel_impl="numba")
    with pytest.raises(ValueError, match="kernel_impl='numba' computes in float32 and would round float64"):
        kernels.resolve_impl("encode", "numba", cpu, torch.float64)
    for kind in ("relu", "batchtopk"):
        model = train(_cfg(kind=kind, kernel_impl="auto", precision="float64"), functools.partial(synthetic_batches, SPEC),
                      out=tmp_path / kind)
        assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
        ck = torch.load(tmp_path / kind / "checkpoint.pt", weights_only=True)
        assert ck["model"]["W_enc"].dtype == torch.float64
