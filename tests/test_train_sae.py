"""Training: refusals, schedule, AuxK, BatchTopK threshold, checkpoints and exact resume, metrics."""

from __future__ import annotations

import functools
import importlib
import json

import pytest
import torch

from conceptdict.saes import SparseCoder, TrainConfig, load_dictionary, train, train_config
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.kernels import SparseCode
from conceptdict.saes.training import (TrainState, aux_loss, calibrate_threshold, default_dead_tokens, lr_at,
                                       update_threshold)
from generators.synthetic import SyntheticSpec, synthetic_batch, synthetic_batches
from conceptdict.saes.config import calibration_batch_count
from crashing import Crash, crashing

pytestmark = pytest.mark.unit

SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=14, seed=3)


def _cfg(**kw):
    base = dict(latents=32, k=3, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu", init_rows=64,
                kernel_impl="reference")
    return train_config(**flat_for_kind(base | kw, kw.get("kind", "topk")))


# -- refusals -----------------------------------------------------------------------------------

def test_config_refusals():
    with pytest.raises(ValueError, match="k=32 must be at least 1 and below latents=32"):
        TrainConfig(latents=32, k=32)
    with pytest.raises(ValueError, match="unknown dictionary kind 'matryoshka-nested'"):
        TrainConfig(latents=32, k=4, kind="matryoshka-nested")
    with pytest.raises(ValueError, match="kind 'gated' is imported for inference only"):
        TrainConfig(latents=32, k=4, kind="gated")
    with pytest.raises(ValueError, match="decay_fraction"):
        TrainConfig(latents=32, k=4, decay_fraction=2.0)


def test_nan_batch_is_refused_with_its_index_and_count():
    batches = [torch.randn(8, 4) for _ in range(5)]
    batches[3][0, :3] = float("nan")
    batches[3][1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"batch 3 from the training batches holds 4 NaN/inf values of 32"):
        train(_cfg(latents=8, k=2, eval_batches=1), batches)


def test_empty_data_and_all_held_out_are_refused():
    with pytest.raises(ValueError, match="holds no rows"):
        train(_cfg(), [], source="store runs/empty, hookpoint h")
    with pytest.raises(ValueError, match="all held out"):
        train(_cfg(eval_batches=4), [torch.randn(8, 4)] * 3)


def test_width_mismatch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config d_in=16 but store runs/x, hookpoint h has D=12"):
        train(_cfg(d_in=16), functools.partial(synthetic_batches, SPEC), source="store runs/x, hookpoint h")
    train(_cfg(), functools.partial(synthetic_batches, SPEC), out=tmp_path)
    other = SyntheticSpec(n_atoms=48, d=10, batch_size=64, n_batches=14)
    with pytest.raises(ValueError, match=r"checkpoint has \(sources, d_in\)=\(1, 12\) but store B has \(1, 10\)"):
        train(_cfg(), functools.partial(synthetic_batches, other), out=tmp_path, resume=True, source="store B")
    with pytest.raises(ValueError, match="settings that differ from the checkpoint"):
        train(_cfg(k=4), functools.partial(synthetic_batches, SPEC), out=tmp_path, resume=True)


# -- pieces -------------------------------------------------------------------------------------

def test_lr_schedule_warmup_constant_decay():
    lrs = [lr_at(s, 1.0, warmup=4, total=20, decay_fraction=0.25) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:15] == [1.0] * 11
    assert lrs[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert lr_at(10_000, 1.0, warmup=4, total=None, decay_fraction=0.25) == 1.0


def test_aux_loss_is_normalised_and_ignores_b_dec():
    m = SparseCoder(2, 3, 1, "topk", kernel_impl="reference")
    with torch.no_grad():
        m.W_dec.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        m.b_dec.fill_(5.0)
    e = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    code = SparseCode(torch.tensor([[1.0], [2.0]]), torch.tensor([[1], [0]]))  # e_hat = [[0, 1], [2, 0]]
    # ||e - e_hat||^2 = 1 + 1 + 1 = 3; ||e - mean(e)||^2 = 4
    assert float(aux_loss(code, m, e)) == pytest.approx(3 / 4)
    assert float(aux_loss(SparseCode(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.long)), m, e)) == 0.0


def test_threshold_running_estimate():
    m = SparseCoder(4, 8, 2, "batchtopk")
    st = TrainState()
    update_threshold(m, 2.0, 0.5, st)
    assert torch.all(m.threshold == 2.0)
    update_threshold(m, 4.0, 0.5, st)  # n=1: mean of the first two (m' = min(0.5, 1/2))
    assert torch.all(m.threshold == 3.0)
    update_threshold(m, 5.0, 0.5, st)  # n=2: m' = min(0.5, 2/3) = 0.5
    assert torch.all(m.threshold == 4.0)


def test_default_dead_window_is_in_tokens_and_follows_the_run():
    # unknown run length: 5000 firing periods (L / k rows) in [100k, 10M]
    assert default_dead_tokens(4096, 32) == 640_000
    assert default_dead_tokens(2**20, 8) == 10_000_000
    assert default_dead_tokens(64, 8) == 100_000
    # a known run: a tenth of it, at least 50 and at most 5000 periods, at most 10M
    assert default_dead_tokens(4096, 16, 2_000_000) == 200_000  # the former window (1.28M) never engaged here
    assert default_dead_tokens(4096, 16, 100_000) == 50 * 256
    assert default_dead_tokens(4096, 32, 10**9) == 640_000
    assert default_dead_tokens(2**20, 8, 10**10) == 10_000_000


def test_calibrated_threshold_gives_mean_l0_k_on_its_rows():
    m = SparseCoder(6, 20, 3, "batchtopk")
    m.reset_parameters(torch.Generator().manual_seed(0))
    rows = [torch.randn(50, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    theta, n = calibrate_threshold(m, rows, chunk=16)
    assert n == 150 and theta > 0 and torch.all(m.threshold == theta)
    l0 = torch.cat([(m.encode(x) > 0).sum(dim=1) for x in rows]).float().mean()
    assert float(l0) == pytest.approx(3.0)


@pytest.mark.parametrize("kind", ["jumprelu", "jumprelu-relative"])
def test_calibration_scales_learned_thresholds_by_one_factor(kind):
    """A kind with a threshold per latent keeps their ratios: one factor on all of them sets the mean L0 to k."""
    m = SparseCoder(6, 20, 3, kind)
    m.reset_parameters(torch.Generator().manual_seed(0))
    learned = torch.rand(20, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.05
    m.threshold.copy_(learned)
    rows = [torch.randn(50, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    factor, n = calibrate_threshold(m, rows, chunk=16)
    assert n == 150 and factor > 0
    torch.testing.assert_close(m.threshold, learned * factor, rtol=2e-6, atol=0)
    l0 = torch.cat([(m.encode(x) > 0).sum(dim=1) for x in rows]).float().mean()
    assert float(l0) == pytest.approx(3.0)


def test_jumprelu_is_calibrated_only_when_its_penalty_targets_k():
    assert calibration_batch_count(TrainConfig(latents=8, k=2, kind="jumprelu")) == 2
    # the paper's linear penalty sets the L0 through its coefficient, not k: nothing to calibrate to
    assert calibration_batch_count(train_config(latents=8, k=2, kind="jumprelu", jumprelu_penalty="linear")) == 0
    assert calibration_batch_count(TrainConfig(latents=8, k=2, kind="topk")) == 0


def test_training_calibrates_the_threshold_on_rows_it_never_trained_on():
    cfg = _cfg(kind="batchtopk", checkpoint_every=0)
    model = train(cfg, functools.partial(synthetic_batches, SPEC))
    info = model.training_summary["threshold"]
    assert info["calibrated_on_rows"] == 2 * SPEC.batch_size
    calib = [synthetic_batch(SPEC, i) for i in (2, 3)]  # after the 2 eval batches
    l0 = torch.cat([(model.encode(x) > 0).sum(dim=1) for x in calib]).float().mean()
    assert float(l0) == pytest.approx(cfg.k)
    assert model.training_summary["rows"] == (SPEC.n_batches - 4) * SPEC.batch_size


def test_auxk_revives_dead_latents():
    """Latents made dead at init (encoder columns shrunk 50x, so never in the top k) come back through AuxK only."""
    spec = SyntheticSpec(n_atoms=32, d=16, active=3, batch_size=128, n_batches=40, seed=1)

    def run(alpha):
        cfg = _cfg(latents=32, k=3, aux_alpha=alpha, dead_tokens=256, checkpoint_every=0, eval_batches=0, lr=3e-3,
                   warmup_steps=2)
        gen = torch.Generator().manual_seed(0)
        killed = torch.randperm(32, generator=gen)[:16]

        def batches(start):
            yield from synthetic_batches(spec, start)

        tr = importlib.import_module("conceptdict.saes.training")
        original = tr.build_model

        def build(*a, **kw):
            model, g = original(*a, **kw)
            with torch.no_grad():
                model.W_enc[:, killed] *= 0.02
            return model, g

        tr.build_model = build
        try:
            model = train(cfg, batches)
        finally:
            tr.build_model = original
        x = torch.cat(list(synthetic_batches(spec, 30)))
        return float((model.encode(x)[:, killed] > 0).any(dim=0).float().mean())

    assert run(0.0) < 0.25
    assert run(1 / 32) > 0.6


# -- checkpoints and resume -----------------------------------------------------------------------



@pytest.mark.equivalence
@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_resume_gives_bit_identical_weights(tmp_path, kind):
    cfg = _cfg(kind=kind, threshold_start_step=2)
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        # checkpoints at steps 3 and 6 (batches 5, 8)
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    held = 2 + (2 if kind == "batchtopk" else 0)  # eval_batches, + calibration_batches for a thresholded kind
    assert ck["step"] == 6 and ck["position"] == held + 6
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    strip = lambda p: [{k: v for k, v in json.loads(ln).items() if k != "tok_s"} for ln in p.read_text().splitlines()]
    assert strip(tmp_path / "cut" / "metrics.jsonl") == strip(tmp_path / "full" / "metrics.jsonl")
    assert [json.loads(ln)["step"] for ln in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()] == list(
        range(2, SPEC.n_batches - held + 1, 2))


@pytest.mark.equivalence
def test_resume_from_a_plain_iterable(tmp_path):
    batches = list(synthetic_batches(SPEC))
    full = train(_cfg(), batches, out=tmp_path / "a")  # 12 training batches (a list has a length)
    with pytest.raises(Crash):
        # a generator: length unknown
        train(_cfg(), crashing(functools.partial(synthetic_batches, SPEC), at=9)(0), out=tmp_path / "b")
    with pytest.raises(ValueError, match="pass the same tokens="):
        train(_cfg(), batches, out=tmp_path / "b", resume=True)
    full = train(_cfg(tokens=12 * 64), batches, out=tmp_path / "a")
    with pytest.raises(Crash):
        train(_cfg(tokens=12 * 64), crashing(functools.partial(synthetic_batches, SPEC), at=9)(0), out=tmp_path / "b")
    resumed = train(_cfg(tokens=12 * 64), batches, out=tmp_path / "b", resume=True)
    assert torch.equal(resumed.W_dec, full.W_dec) and torch.equal(resumed.b_enc, full.b_enc)


def test_artifact_written_and_works_on_raw_activations(tmp_path):
    """Training normalises (here: inputs 50x larger than sqrt(D)); the saved dictionary takes raw inputs."""
    batches = [x * 50 for x in synthetic_batches(SPEC)]
    model = train(_cfg(latents=48, tokens=10 * 64), batches, out=tmp_path, meta={"hookpoints": ["h"]})
    loaded = load_dictionary(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hookpoints"] == ["h"] and cfg["training"]["steps"] == 10 and cfg["training"]["rows"] == 640
    assert cfg["normalisation"]["folded_into_weights"]
    assert cfg["normalisation"]["scale_per_source"][0] == pytest.approx(1 / 50 * 12**0.5 / float(
        torch.cat(batches[2:3]).div(50).norm(dim=1).mean()), rel=0.2)
    held = cfg["training"]["heldout_eval"]
    from conceptdict.saes import evaluate
    again = evaluate(loaded, batches[:2])
    assert again.fvu == pytest.approx(held["fvu"], rel=1e-5) and again.fvu < 0.9
    assert torch.equal(loaded.W_dec, model.W_dec)


def test_a_dictionary_that_memorises_a_small_store_says_so_and_one_on_fresh_rows_does_not(caplog):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(32, 12, generator=gen)  # 32 rows of noise, read 300 times by 64 latents
    held = [torch.randn(32, 12, generator=gen) for _ in range(2)]
    cfg = _cfg(latents=64, k=3, init_rows=32, stop_patience=0)
    with caplog.at_level("WARNING", logger="conceptdict.saes.stopping"):
        small = train(cfg, held + [rows[torch.randperm(32, generator=gen)] for _ in range(300)])
    gap = small.training_summary["fit_gap"]
    assert gap["memorised"] and gap["ratio"] > 10
    assert gap["heldout_fvu"] == small.training_summary["heldout_eval"]["fvu"]
    assert "memorised the store's rows" in caplog.text and "train fewer latents" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="conceptdict.saes.stopping"):
        fresh = train(cfg, [torch.randn(32, 12, generator=gen) for _ in range(302)])
    assert not fresh.training_summary["fit_gap"]["memorised"] and "memorised" not in caplog.text
