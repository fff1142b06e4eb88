"""The JumpReLU, Matryoshka BatchTopK and SpaDE kinds: their sparse operations against the dense references
(values and gradients), the straight-through estimators, a whole step with fast against reference kernels,
exact resume, the saved inference form, and (integration) recovery of planted atoms."""

from __future__ import annotations

import functools
import importlib.util
import math
import pytest
import torch

from conceptdict.saes import SparseCoder, TrainConfig, kernels, load_dictionary, train, train_config
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.kinds.jumprelu import THRESHOLD_RATE, JumpReLU, Step, threshold_of
from conceptdict.saes.kernels import kinds as kind_ops
from conceptdict.saes.kernels import sparse as sparse_ops
from conceptdict.saes.kinds.matryoshka import default_groups, prefix_bounds
from generators.synthetic import SyntheticSpec, alive_recovery, atom_recovery, planted_atoms, synthetic_batches
from crashing import Crash, crashing

pytestmark = pytest.mark.unit

FAST = ["torch", pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                                  reason="no numba"))]
NEW_KINDS = ["jumprelu", "jumprelu-relative", "matryoshka", "matryoshka-absolute", "spade"]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(kind_ops, "ROW_CHUNK", 16)  # the chunked selection and its joins at test shapes
    monkeypatch.setattr(sparse_ops, "ROW_CHUNK", 16)


def _inputs(seed=0, B=37, D=12, L=50):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g)
    W = torch.randn(L, D, generator=g)  # latent-major storage, as SparseCoder keeps W_enc
    b = 0.3 * torch.randn(L, generator=g)
    return x, W, b, torch.randn(B, L, generator=g)


def _grads(impl, fn, x, W, b, extra=()):
    leaves = [t.clone().requires_grad_() for t in (x, W, b, *extra)]
    out = fn(impl, leaves[0], leaves[1].t(), *leaves[2:])
    out.backward()
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _dense(values, indices, L):
    return torch.zeros(values.shape[0], L, dtype=values.dtype).scatter_add(1, indices, values)


def _assert_same(fn, impl, *args, extra=()):
    want = _grads("reference", fn, *args, extra=extra)
    got = _grads(impl, fn, *args, extra=extra)
    assert len(got) == len(want) == 4 + len(extra)
    for name, a, r in zip(["value", "x", "W_enc", "b_enc"] + [f"extra {i}" for i in range(len(extra))], got, want):
        scale = max(1.0, float(r.abs().max()))
        torch.testing.assert_close(a / scale, r / scale, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", FAST)
def test_gather_pre_values_and_grads(impl):
    x, W, b, w = _inputs()
    idx = torch.randint(0, W.shape[0], (x.shape[0], 7), generator=torch.Generator().manual_seed(1))
    coef = torch.randn(idx.shape)
    fn = lambda i, x, W_enc, b: (kernels.gather_pre(x, W_enc, idx, impl=i) * coef).sum() + 0 * b.sum()
    _assert_same(fn, impl, x, W, b)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("k", [1, 8])  # 1: most rows hold more entries than the first pass's slots
def test_encode_above_selects_the_dense_selection(impl, k):
    x, W, b, _ = _inputs(B=70, L=300)
    floor = 2.0 * torch.rand(W.shape[0], generator=torch.Generator().manual_seed(3))
    want = kernels.encode_above(x, W.t(), b, floor, k, impl="reference")
    got = kernels.encode_above(x, W.t(), b, floor, k, impl=impl)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0] * got[2], want[0] * want[2], rtol=1e-5, atol=1e-5)
    assert int(want[2].sum(dim=1).max()) > 4 * k  # the wider second pass ran


@pytest.mark.parametrize("impl", FAST)
def test_encode_above_values_and_grads(impl):
    x, W, b, w = _inputs()
    floor = 1.0 + torch.rand(W.shape[0], generator=torch.Generator().manual_seed(2))

    def fn(i, x, W_enc, b):
        z, idx, kept = kernels.encode_above(x, W_enc, b, floor, impl=i)
        assert bool((z.detach()[kept] > floor[idx[kept]]).all())
        return (_dense(z * kept, idx, W_enc.shape[1]) * w).sum()

    _assert_same(fn, impl, x, W, b)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("candidates", [2, 6, 50])  # 2: most rows need the whole-row fallback
def test_encode_sparsemax_values_and_grads(impl, candidates):
    x, W, b, w = _inputs()
    lam = torch.tensor(0.4)

    def fn(i, x, W_enc, b, lam):
        f, idx, z, kept = kernels.encode_sparsemax(x, W_enc, b, lam, candidates, impl=i)
        dense = _dense(f, idx, W_enc.shape[1])
        torch.testing.assert_close(dense.detach().sum(dim=1), torch.ones(x.shape[0]))
        assert bool((dense.detach() >= 0).all())
        return (dense * w).sum()

    _assert_same(fn, impl, x, W, b, extra=(lam,))


@pytest.mark.parametrize("impl", FAST)
# supports of 143-254 / 67-140 / 4-16 of the 400 latents: together they take every path (the whole row sorted, 4x
# the candidates, the scores above the lower bound sorted alone)
@pytest.mark.parametrize("lam", [0.002, 0.005, 0.1])
@pytest.mark.parametrize("candidates", [4, 16])
def test_encode_sparsemax_wide_supports(impl, lam, candidates):
    """Rows whose support exceeds the candidates: found from the scores above a lower bound of the threshold, from
    4x more candidates, or from the whole row; every path must give the reference's code and gradients."""
    x, W, b, _ = _inputs(seed=3, B=24, D=16, L=400)
    w = torch.randn(24, 400, generator=torch.Generator().manual_seed(4))
    lam = torch.tensor(lam)

    def fn(i, x, W_enc, b, lam):
        f, idx, z, kept = kernels.encode_sparsemax(x, W_enc, b, lam, candidates, impl=i)
        assert int(kept.sum(dim=1).max()) >= candidates  # some row filled its candidates: the wide path ran
        return (_dense(f, idx, W_enc.shape[1]) * w).sum()

    _assert_same(fn, impl, x, W, b, extra=(lam,))


@pytest.mark.parametrize("impl", FAST)
def test_prefix_decodes_values_and_grads(impl):
    x, W, b, w = _inputs()
    W_dec = torch.randn(W.shape[0], x.shape[1])
    bounds = [3, 10, 25, 50]

    def fn(i, x, W_enc, b):
        code = kernels.encode(x, W_enc, b, 5, batch=True, impl=i)
        recons = kernels.prefix_decodes(code.values, code.indices, W_dec, b_dec, bounds, impl=i)
        return sum((r - x).square().sum() * (g + 1) for g, r in enumerate(recons))

    b_dec = 0.1 * torch.randn(x.shape[1])
    _assert_same(fn, impl, x, W, b)


@pytest.mark.parametrize("impl", FAST)
def test_prefix_errors_values_and_grads(impl):
    """Matryoshka's fused loss terms against the reference (the reconstructions' squared errors), values and
    gradients in x (through the code), W_enc, b_enc, and in W_dec and b_dec."""
    x, W, b, w = _inputs()
    bounds = [3, 10, 25, 50]
    g = torch.Generator().manual_seed(5)
    W_dec, b_dec = torch.randn(W.shape[0], x.shape[1], generator=g), 0.1 * torch.randn(x.shape[1], generator=g)

    def fn(i, x, W_enc, b, W_dec, b_dec):
        code = kernels.encode(x, W_enc, b, 5, batch=True, impl=i)
        x_hat, inner = kernels.prefix_errors(code.values, code.indices, W_dec, b_dec, bounds, x.detach(), impl=i)
        return (x_hat - 0.5 * x.detach()).square().sum() + sum(e * (g + 1) for g, e in enumerate(inner))

    _assert_same(fn, impl, x, W, b, extra=(W_dec, b_dec))


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")
@pytest.mark.parametrize("bounds", [[3, 10, 25, 50], [50], [1, 50]])
def test_prefix_errors_from_the_code_equal_the_regrouped_decode(monkeypatch, bounds):
    """numba's prefix_errors (the residuals from the code as it is, ``numba_prefix``) gives the regrouped decode's
    numbers bit for bit: the loss terms and every gradient (the same float32 operations in the same order)."""
    x, W, b, _ = _inputs(seed=6, B=40, D=24, L=50)
    g = torch.Generator().manual_seed(7)
    W_dec, b_dec = torch.randn(W.shape[0], x.shape[1], generator=g), 0.1 * torch.randn(x.shape[1], generator=g)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, W, b, W_dec, b_dec)]
        code = kernels.encode(leaves[0], leaves[1].t(), leaves[2], 5, batch=True, impl="numba")
        x_hat, inner = kernels.prefix_errors(code.values, code.indices, leaves[3], leaves[4], bounds, x, impl="numba")
        loss = (x_hat - 0.5 * x).square().sum() + sum(e * (i + 2) for i, e in enumerate(inner))
        loss.backward()
        return [x_hat.detach(), *(e.detach() for e in inner)] + [t.grad for t in leaves]

    fused = run()
    monkeypatch.setattr(kind_ops, "_numba_float32", lambda *a: False)  # the regrouped decode, numba's kernels
    regrouped = run()
    assert len(fused) == len(regrouped) == len(bounds) + 5
    for a, r in zip(fused, regrouped):
        assert torch.equal(a, r)


def test_prefix_decodes_match_masked_dense_decodes():
    x, W, b, _ = _inputs()
    code = kernels.encode(x, W.t(), b, 4, batch=True, impl="torch")
    W_dec, b_dec = torch.randn(W.shape[0], x.shape[1]), torch.randn(x.shape[1])
    dense = _dense(code.values, code.indices, W.shape[0])
    for m, r in zip([7, 50], kernels.prefix_decodes(code.values, code.indices, W_dec, b_dec, [7, 50], impl="torch")):
        torch.testing.assert_close(r, dense[:, :m] @ W_dec[:m] + b_dec)


def test_jumprelu_straight_through_estimators():
    z = torch.tensor([0.5, 0.98, 1.02, 2.0], requires_grad=True)
    theta = torch.ones(4, requires_grad=True)
    eps = 0.1
    (JumpReLU.apply(z, theta, eps) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert z.grad.tolist() == [0.0, 0.0, 3.0, 4.0]  # H(z - theta), no STE on z
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, -20.0, -30.0, 0.0]))  # -(theta/eps) K((z-theta)/eps) g
    theta.grad = None
    Step.apply(z, theta, eps).sum().backward()
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, -10.0, -10.0, 0.0]))  # -(1/eps) K(...)


def test_matryoshka_groups():
    assert default_groups(256) == [16, 16, 32, 64, 128]
    assert prefix_bounds(256, None) == [16, 32, 64, 128, 256]
    assert prefix_bounds(10, [3, 7]) == [3, 10]
    with pytest.raises(ValueError, match="matryoshka_groups=\\[3, 3\\] must be positive sizes summing to latents=10"):
        train_config(latents=10, k=2, kind="matryoshka", matryoshka_groups=[3, 3])
    with pytest.raises(ValueError, match="matryoshka_inner_weight=-1.0 must be >= 0"):
        train_config(latents=10, k=2, kind="matryoshka", matryoshka_inner_weight=-1.0)


def test_matryoshka_inner_weight_scales_the_inner_prefix_losses():
    """The kind's extra loss is inner_weight times the summed FVUs of the inner prefixes; the whole dictionary's
    reconstruction (the loop's own FVU term) does not depend on it."""
    from conceptdict.saes.comm import local_inputs

    torch.manual_seed(0)
    model = SparseCoder(12, 64, 4, "matryoshka", kernel_impl="torch")
    model.add_train_params()
    x = torch.randn(96, 12)
    outs = {}
    for w in (1.0, 0.25, 0.0):
        cfg = train_config(latents=64, k=4, kind="matryoshka", matryoshka_inner_weight=w, code_l1=0.0)
        outs[w] = model.spec.train_forward(model, x, local_inputs(x)._replace(settings=cfg.settings))
    assert float(outs[1.0].sparsity_loss) > 0
    torch.testing.assert_close(outs[0.25].sparsity_loss, 0.25 * outs[1.0].sparsity_loss)
    assert float(outs[0.0].sparsity_loss) == 0.0
    torch.testing.assert_close(outs[0.25].x_hat, outs[1.0].x_hat)
    # the tie-break (TrainConfig.code_l1, docs/results/batchtopk.md) adds code_l1 x the lr schedule x the kept codes' L1
    # per row over the batch's RMS norm
    from conceptdict.saes.kinds.common import train_code

    cfg = train_config(latents=64, k=4, kind="matryoshka", matryoshka_inner_weight=0.0)
    inputs = local_inputs(x)._replace(settings=cfg.settings, schedule=0.5, code_l1=0.05)
    values = train_code(model, x, inputs, batch=True, relative=True).values
    expected = 0.05 * 0.5 * values.sum() / 96 / inputs.stats.row_var.sqrt()
    torch.testing.assert_close(model.spec.train_forward(model, x, inputs).sparsity_loss, expected)


SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=14, seed=3)


def _cfg(kind, **kw):
    base = dict(latents=32, k=3, kind=kind, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu",
                init_rows=64, kernel_impl="reference", threshold_start_step=2, matryoshka_groups=None)
    if kind.startswith("matryoshka"):
        base["matryoshka_groups"] = [4, 12, 16]
    return train_config(**flat_for_kind(base | kw, kind))


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_fast_kernels_train_like_the_reference(kind):
    """A few steps with the fast kernels end where the dense references do (float32 summation order aside)."""
    ref = train(_cfg(kind, checkpoint_every=0, tokens=4 * 64), functools.partial(synthetic_batches, SPEC))
    fast = train(_cfg(kind, checkpoint_every=0, tokens=4 * 64, kernel_impl="torch"),
                 functools.partial(synthetic_batches, SPEC))
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[name], t, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")




@pytest.mark.parametrize("kind", NEW_KINDS)
def test_resume_gives_bit_identical_weights(tmp_path, kind):
    cfg = _cfg(kind)
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 6
    if kind in ("jumprelu", "jumprelu-relative", "spade"):  # the kind's own parameters are in the checkpoint
        assert {"scaled_log_threshold", "spade_lambda_pre"} & set(ck["model"])
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    assert full.state_dict().keys() == resumed.state_dict().keys()
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    assert (tmp_path / "cut" / "metrics.jsonl").read_text().count("\n") == (tmp_path / "full" / "metrics.jsonl"
                                                                            ).read_text().count("\n")


def test_row_relative_jumprelu_holds_up_on_heavy_tailed_rows(tmp_path):
    """Absolute per-latent thresholds break on rows whose norms vary by an order of magnitude (docs/results/batchtopk.md);
    the row-relative variant reconstructs them, and its saved dictionary encodes exactly as the trained one."""
    heavy = SyntheticSpec(n_atoms=96, d=24, active=4, batch_size=128, n_batches=40, seed=4, coef_sigma=1.0,
                          row_sigma=0.5)
    fvu = {}
    for kind in ("jumprelu", "jumprelu-relative"):
        cfg = TrainConfig(latents=128, k=4, kind=kind, eval_batches=4, log_every=10**9, checkpoint_every=0,
                          device="cpu", init_rows=256, seed=0)
        model = train(cfg, functools.partial(synthetic_batches, heavy), out=tmp_path / kind)
        fvu[kind] = model.training_summary["heldout_eval"]["fvu"]
    # 34 steps: jumprelu 1.87, jumprelu-relative 0.68 (topk 0.54, batchtopk 0.65 on the same rows)
    assert fvu["jumprelu-relative"] < 0.5 * fvu["jumprelu"] and fvu["jumprelu-relative"] < 0.8, fvu
    back = load_dictionary(tmp_path / "jumprelu-relative")
    x = next(iter(synthetic_batches(heavy)))
    torch.testing.assert_close(back.encode(x), model.encode(x))
    assert back.training_summary["threshold"]["rule"].startswith("learned per latent")


def test_jumprelu_saves_its_learned_thresholds_and_exports_to_saelens(tmp_path):
    from conceptdict.saes import export_saelens

    model = train(_cfg("jumprelu", checkpoint_every=0), functools.partial(synthetic_batches, SPEC), out=tmp_path / "d")
    assert not hasattr(model, "scaled_log_threshold") and float(model.threshold.min()) > 0
    info = model.training_summary["threshold"]
    assert info["rule"].startswith("learned per latent") and info["calibrated_on_rows"] == 2 * SPEC.batch_size
    assert model.threshold.unique().numel() > 1  # one threshold per latent (times one factor), not one cut
    back = load_dictionary(tmp_path / "d")
    x = next(iter(synthetic_batches(SPEC)))
    torch.testing.assert_close(back.encode(x), model.encode(x))
    export_saelens(back, tmp_path / "sl")
    again = load_dictionary(tmp_path / "sl")
    assert again.kind == "jumprelu"
    torch.testing.assert_close(again.encode(x), model.encode(x), rtol=1e-5, atol=1e-5)


def test_spade_saves_its_affine_form_and_codes_lie_on_the_simplex(tmp_path):
    model = train(_cfg("spade", checkpoint_every=0), functools.partial(synthetic_batches, SPEC), out=tmp_path / "d")
    assert not hasattr(model, "spade_lambda_pre")
    x = next(iter(synthetic_batches(SPEC)))  # raw units: the normalisation is folded into the weights
    f = load_dictionary(tmp_path / "d").encode(x)
    torch.testing.assert_close(f.sum(dim=1), torch.ones(x.shape[0]))
    assert bool((f >= 0).all()) and len(set((f > 0).sum(dim=1).tolist())) > 1  # adaptive L0
    # the affine form is the distance form: sparsemax(-lambda |x - p|^2) with p = W_enc / (2 lambda)
    dense = SparseCoder(model.d_in, model.n_latents, model.k, "relu")
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if k in dense.state_dict()})
    pre = (x - model.b_dec) @ model.W_enc + model.b_enc
    torch.testing.assert_close(f, kernels.reference.sparsemax(pre), rtol=1e-5, atol=1e-6)


def _spade_at_start(L, seed=0, D=12):
    from conceptdict.saes.kinds import spade

    model = SparseCoder(D, L, 3, "spade", kernel_impl="torch")
    model.reset_parameters(generator=torch.Generator().manual_seed(seed))
    directions = model.W_dec.detach().clone()
    model.add_train_params()
    rows = torch.randn(100, D, generator=torch.Generator().manual_seed(7)) + 2
    with torch.no_grad():
        model.b_dec.copy_(rows.mean(dim=0))
        model.spec.init(model, rows)
    return model, rows, directions, spade


def test_spade_starts_at_data_rows_stored_in_row_units():
    """Prototype j and decoder row j start at the same row of the sample (evenly spaced), moved by PERTURB of its
    norm along latent j's random direction, and are stored divided by sqrt(D)."""
    model, rows, directions, spade = _spade_at_start(40)
    xc = rows[torch.arange(40) * 100 // 40] - model.b_dec
    want = xc + spade.PERTURB * xc.norm(dim=1, keepdim=True) * directions
    torch.testing.assert_close(model.W_enc.T * math.sqrt(12), want)
    torch.testing.assert_close(model.W_dec, model.W_enc.T)
    other, *_ = _spade_at_start(40, seed=1)
    assert not torch.equal(other.W_dec, model.W_dec)  # the start depends on the seed
    many, *_ = _spade_at_start(250)  # more latents than rows: rows repeat, the random directions part them
    assert torch.unique(many.W_dec, dim=0).shape[0] == 250


def test_spade_training_code_is_sparsemax_over_the_distances():
    """The training step's reconstruction is sparsemax(-lambda |x - b_dec - p_j|^2) decoded, with the prototypes
    and decoder rows in the data's units (sqrt(D) times the stored weights)."""
    from conceptdict.saes.comm import local_inputs

    model, rows, _, spade = _spade_at_start(40)
    x = rows[:30] + 0.3 * torch.randn(30, 12, generator=torch.Generator().manual_seed(3))
    c, lam = math.sqrt(12), spade.scale(model)
    out = model.spec.train_forward(model, x, local_inputs(x))
    dist = ((x - model.b_dec)[:, None, :] - c * model.W_enc.T[None]).square().sum(dim=-1)
    f = kernels.reference.sparsemax(-lam * dist)
    torch.testing.assert_close(out.x_hat, f @ (c * model.W_dec) + model.b_dec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.l0, (f > 0).sum(dim=1).float().mean())
    assert 1 < float(out.l0) < 40  # the support adapts: neither one prototype nor all


def test_cli_help_lists_the_new_kinds(capsys):
    from conceptdict.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for kind in ("jumprelu", "matryoshka", "spade"):
        assert kind in out, kind
    assert "--matryoshka-groups" in out and "--jumprelu-bandwidth" in out


RECOVERY = SyntheticSpec(n_atoms=256, d=128, active=3, noise=0.02, batch_size=1024, n_batches=120, seed=0)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["matryoshka", "spade", "jumprelu"])
def test_planted_atoms_are_recovered(kind):
    """The test-sized problem of tests/test_sae_recovery.py with default settings. SpaDE (measured 2026-12-01:
    93.8% at FVU 0.078, L0 22, 25% dead; it learned 0% before its prototypes started at data rows in row units,
    saes/kinds/spade.py) keeps more latents dead than the TopK kinds: with L = 2 x atoms and codes that sum to 1,
    the spare prototypes sit away from the rows. jumprelu (2026-12-02, with AuxK and its dead-latent rule): 97.7% at
    FVU 0.078, L0 6.08, 3.3% dead (34% dead before them), with its TopK start and the tie-break after it (87.5% without
    the tie-break, 84-88% before the start)."""
    cfg = TrainConfig(latents=512, k=6, kind=kind, tokens=116 * 1024, log_every=20)
    model = train(cfg, functools.partial(synthetic_batches, RECOVERY))
    rec = atom_recovery(model.decoder_directions(), planted_atoms(RECOVERY), threshold=0.9)
    held = model.training_summary["heldout_eval"]
    if kind == "spade":  # its L0 is its own (adaptive)
        assert rec.fraction >= 0.85, rec
        assert held["dead_fraction"] < 0.35 and held["fvu"] < 0.12, held
        return
    assert rec.fraction >= 0.9, rec
    # the 256 latents beyond the atoms have nothing to represent on these rows and may die (matryoshka with
    # batchtopk's short dead window: 12.5%, as batchtopk in tests/test_sae_recovery.py; jumprelu 3.3%, a third
    # before its dead-latent rule); the atoms' own latents must stay alive
    assert held["dead_fraction"] <= 1 - RECOVERY.n_atoms / cfg.latents
    assert alive_recovery(model, RECOVERY).fraction >= 0.9  # on the held-out batch
    assert held["fvu"] < 0.1
    assert 0.5 * 6 <= held["l0"] <= 1.5 * 6, held["l0"]
    assert math.isfinite(held["fvu"])


def test_jumprelu_threshold_gradient_matches_the_dense_estimator():
    """The packed step gives theta the same gradient as the dense formulas (SAELens / the paper), including the
    reconstruction's pull from entries just below the threshold, whose value is 0."""
    from conceptdict.saes.comm import local_inputs

    torch.manual_seed(0)
    model = SparseCoder(12, 40, 4, "jumprelu", kernel_impl="torch")
    model.add_train_params()
    x = torch.randn(64, 12)
    with torch.no_grad():
        model.scaled_log_threshold.copy_(torch.log(torch.rand(40) * 0.6 + 0.2) / THRESHOLD_RATE)
    cfg = train_config(latents=40, k=4, kind="jumprelu", jumprelu_bandwidth=0.3)
    inputs = local_inputs(x)._replace(settings=cfg.settings)
    out = model.spec.train_forward(model, x, inputs)
    ((x - out.x_hat).square().sum() / inputs.stats.total_var + out.sparsity_loss).backward()
    got = model.scaled_log_threshold.grad.clone() / THRESHOLD_RATE
    theta = threshold_of(model).detach().requires_grad_()
    z = (x - model.b_dec) @ model.W_enc + model.b_enc
    f = JumpReLU.apply(z, theta.expand_as(z), 0.3)
    l0 = Step.apply(z, theta.expand_as(z), 0.3).sum() / x.shape[0]
    loss = (x - (f @ model.W_dec + model.b_dec)).square().sum() / inputs.stats.total_var + (l0 / 4 - 1).square()
    loss.backward()
    torch.testing.assert_close(got, (theta.grad * theta).detach(), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_written_before_the_new_settings_still_resumes(tmp_path):
    """Checkpoints of runs started before TrainConfig grew the settings of these kinds resume (at their defaults)."""
    cfg = TrainConfig(latents=32, k=3, eval_batches=2, checkpoint_every=3, device="cpu", init_rows=64,
                      kernel_impl="reference", log_every=100)
    full = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(functools.partial(synthetic_batches, SPEC), at=10), out=tmp_path / "cut")
    path = tmp_path / "cut" / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    for name in ("l0_coeff", "jumprelu_penalty", "jumprelu_bandwidth", "sparsity_warmup_steps", "matryoshka_groups",
                 "spade_coeff"):
        del ck["config"][name]
    torch.save(ck, path)
    resumed = train(cfg, functools.partial(synthetic_batches, SPEC), out=tmp_path / "cut", resume=True)
    assert torch.equal(resumed.W_dec, full.W_dec)


def test_matryoshka_groups_from_the_command_line():
    from conceptdict.cli.args import settings_from
    from conceptdict.cli.main import build_parser
    from conceptdict.train_api import LiveConfig, TrainCommand, train_configs, train_settings

    args = build_parser().parse_args(["train", "--store", "s", "--latents", "32", "--k", "4", "--kind", "matryoshka",
                                      "--matryoshka-groups", "4", "--matryoshka-groups", "28"])
    _, cfg, _, _ = train_configs(**settings_from(args, TrainCommand, LiveConfig, train_settings()))
    assert cfg.settings.matryoshka_groups == [4, 28]


def test_fired_from_code_marks_only_the_latents_with_a_positive_value():
    """A zero-padded code (padding at index 0 with value 0, a kept entry that rounded to 0, duplicates): the latents
    that fired are exactly those with a positive value somewhere, latent 0 included only when it fired."""
    from conceptdict.saes.kinds.common import fired_from_code

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, 50, (64, 12), generator=g)
    vals = torch.rand(64, 12, generator=g) * (torch.rand(64, 12, generator=g) > 0.3)
    idx = torch.where(vals > 0, idx, 0)  # padding points at latent 0 with value 0
    fired, l0 = fired_from_code(vals, idx, 50)
    assert fired.shape == (50,) and not fired[0]
    assert set(fired.nonzero().flatten().tolist()) == set(idx[vals > 0].tolist())
    assert float(l0) == pytest.approx(float((vals > 0).sum(1).float().mean()))
    vals[3, 0], idx[3, 0] = 0.5, 0  # latent 0 fires once
    assert fired_from_code(vals, idx, 50)[0][0]
