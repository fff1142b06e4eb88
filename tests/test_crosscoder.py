"""Crosscoder selection and losses (saes/kinds/crosscoder.py), checked against hand computations."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import is_crosscoder
from conceptdict.saes.kinds import crosscoder as cc
from conceptdict.saes.kinds.relu import L1Settings
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.model import KINDS, SparseCoder

pytestmark = pytest.mark.unit


def test_source_norm_sum():
    W_dec = torch.tensor([[3.0, 4.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]])  # L=2, S=2, D=2
    assert cc.source_norm_sum(W_dec, 2).tolist() == pytest.approx([5.0, 3.0])
    assert cc.source_norm_sum(W_dec, 1).tolist() == pytest.approx([5.0, 5 ** 0.5])
    with pytest.raises(ValueError, match="n_sources=3"):
        cc.source_norm_sum(W_dec, 3)


def test_batchtopk_ranks_by_decoder_weight_but_keeps_unscaled_values():
    acts = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.0, 0.3]])
    # sum_s |d^s| per latent: 0.5, 1.0, 4.0 -> scaled acts [[0.5, 0.8, 0.4], [0.1, 0, 1.2]]
    W_dec = torch.tensor([[0.5, 0.0], [1.0, 0.0], [0.0, 4.0]])  # S=2, D=1
    sel = cc.batchtopk_crosscoder_select(acts, W_dec, n_sources=2, k=1, impl="reference")
    dense = torch.zeros(2, 3).scatter_add(1, sel.code.indices, sel.code.values)
    # top 2 scaled entries of the batch: 1.2 (row 1, latent 2) and 0.8 (row 0, latent 1); unscaled values kept
    assert torch.equal(dense, torch.tensor([[0.0, 0.8, 0.0], [0.0, 0.0, 0.3]]))
    assert sel.smallest.item() == pytest.approx(0.8)  # smallest kept SCALED value
    # plain BatchTopK would have kept latent 0 of row 0 (largest unscaled value)
    plain = cc.batchtopk_crosscoder_select(acts, torch.ones(3, 2) / 2 ** 0.5, 2, 1, impl="reference")
    assert int(plain.code.indices[0, 0]) == 0


def test_batchtopk_keeps_k_per_row_on_average():
    torch.manual_seed(0)
    acts = torch.relu(torch.randn(32, 50))
    W_dec = torch.randn(50, 2 * 6)
    sel = cc.batchtopk_crosscoder_select(acts, W_dec, n_sources=2, k=5, impl="reference")
    assert int((sel.code.values > 0).sum()) == 5 * 32
    weight = cc.source_norm_sum(W_dec, 2)
    kept_scaled = sel.code.values * weight[sel.code.indices]
    threshold = kept_scaled[sel.code.values > 0].min()
    assert threshold.item() == pytest.approx(sel.smallest.item())
    # every entry not kept ranks at or below the smallest kept one
    dense = torch.zeros_like(acts).scatter_add(1, sel.code.indices, sel.code.values)
    assert ((acts * weight)[dense == 0] <= threshold + 1e-6).all()


def test_threshold_codes_compare_the_scaled_activation():
    acts = torch.tensor([[0.5, 0.5, 2.0]])
    W_dec = torch.tensor([[1.0, 1.0], [0.1, 0.1], [0.1, 0.0]])  # weights 2.0, 0.2, 0.1 (S=2, D=1)
    codes = cc.crosscoder_threshold_codes(acts, W_dec, 2, torch.tensor(0.15))
    assert codes.tolist() == [[0.5, 0.0, 2.0]]


def test_l1_loss_matches_the_formula():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    x_hat = torch.tensor([[1.0, 1.0, 3.0, 2.0]])
    acts = torch.tensor([[2.0, 0.0, 1.0]])
    W_dec = torch.tensor([[3.0, 4.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 2.0]])  # S=2, D=2
    loss = cc.crosscoder_l1_loss(x, x_hat, acts, W_dec, n_sources=2, l1_coeff=0.5)
    # mse: 0 + 1 + 0 + 4 = 5; penalty: 0.5 * (2 * (5 + 1) + 1 * (0 + 2)) = 7
    assert loss.mse.item() == pytest.approx(5.0)
    assert loss.penalty.item() == pytest.approx(7.0)
    assert loss.total.item() == pytest.approx(12.0)
    same = cc.crosscoder_l1_loss(x.view(1, 2, 2), x_hat.view(1, 2, 2), acts, W_dec, 2, 0.5)
    assert same.total.item() == pytest.approx(12.0)


@pytest.mark.parametrize("kind", ["crosscoder", "crosscoder-l1"])
def test_kinds_are_registered_and_differentiable(kind):
    assert kind in KINDS and is_crosscoder(kind)
    torch.manual_seed(0)
    model = SparseCoder(d_in=6, n_latents=20, k=3, kind=kind, n_sources=2, kernel_impl="reference")
    x = torch.randn(16, 2, 6)
    flat = model.flatten_input(x)
    out = model.spec.train_forward(model, flat, local_inputs(flat, settings=L1Settings(l1_coeff=0.5)))
    assert out.x_hat.shape == (16, 12) and out.fired.shape == (20,)
    loss = (out.x_hat - x.flatten(1)).square().sum()
    if out.sparsity_loss is not None:
        loss = loss + out.sparsity_loss
    loss.backward()
    assert model.W_enc.grad.abs().sum() > 0 and model.W_dec.grad.abs().sum() > 0
    if kind == "crosscoder":
        assert out.l0.item() == pytest.approx(3.0) and out.smallest is not None and out.sparsity_loss is None
        assert model.spec.uses_aux and model.spec.uses_threshold
    else:
        assert out.sparsity_loss.item() > 0 and out.smallest is None
    assert model.encode(x).shape == (16, 20) and model(x).shape == (16, 2, 6)


def test_l1_kind_penalty_is_the_reference_lambda_over_the_batch_variance():
    torch.manual_seed(1)
    model = SparseCoder(d_in=4, n_latents=10, k=2, kind="crosscoder-l1", n_sources=2, kernel_impl="reference")
    x = torch.randn(8, 8)
    out = model.spec.train_forward(model, x, local_inputs(x, settings=L1Settings(l1_coeff=0.3)))
    acts = model.encode(x.view(8, 2, 4))
    var = (x - x.mean(0)).square().sum(1).mean()
    assert out.sparsity_loss.item() == pytest.approx(cc.crosscoder_l1_penalty(acts, model.W_dec, 2, 0.3).item()
                                                     / var.item(), rel=1e-5)


def test_inference_rule_survives_folding_the_input_scale():
    """Codes of a folded model on raw x equal the trained model's codes on scaled x when the model keeps the
    per-source factor in ``source_scale`` (see training_decoder)."""
    torch.manual_seed(2)
    model = SparseCoder(d_in=5, n_latents=12, k=2, kind="crosscoder", n_sources=2, kernel_impl="reference")
    with torch.no_grad():
        model.W_dec.mul_(torch.rand(12, 1) + 0.5)
        model.threshold.fill_(0.3)
    scale = torch.tensor([2.0, 0.5])
    x = torch.randn(10, 2, 5)
    before = model.encode(x * scale[None, :, None])
    model.fold_input_scale(scale)
    if not hasattr(model, "source_scale"):
        model.register_buffer("source_scale", scale.clone())
    assert torch.allclose(model.encode(x), before, atol=1e-5)
    assert torch.allclose(cc.training_decoder(model), (model.W_dec * scale.repeat_interleave(5)), atol=0)


@pytest.mark.parametrize("kind", ["crosscoder-absolute", "crosscoder"])
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_batchtopk_kind_training_pass_matches_the_standalone_selection(impl, kind):
    """crosscoder-absolute ranks f_j sum_s |d_j^s|; crosscoder ranks the same of relu(pre / s) for the row scale
    s = |x - b_dec| / sqrt(S D) and keeps s times the selected values."""
    torch.manual_seed(3)
    model = SparseCoder(d_in=6, n_latents=20, k=3, kind=kind, n_sources=2, kernel_impl=impl)
    with torch.no_grad():
        model.W_dec.mul_(torch.rand(20, 1) * 2 + 0.1)  # uneven decoder norms: the ranking differs from plain
    x = torch.randn(16, 12) * (torch.rand(16, 1) * 4 + 0.1)  # row norms that differ
    dead = torch.zeros(20, dtype=torch.bool)
    dead[:5] = True
    out = model.spec.train_forward(model, x, local_inputs(x, dead=dead, k_aux=2))
    s = (x - model.b_dec).norm(dim=1, keepdim=True) / 12 ** 0.5 if kind == "crosscoder" else torch.ones(16, 1)
    acts = torch.relu(cc.crosscoder_pre(x, model.W_enc, model.b_enc * s, model.b_dec) / s)
    sel = cc.batchtopk_crosscoder_select(acts, model.W_dec, 2, 3, impl="reference")
    dense = torch.zeros(16, 20).scatter_add(1, sel.code.indices, sel.code.values) * s
    assert torch.allclose(out.x_hat, dense @ model.W_dec + model.b_dec, atol=1e-5)
    assert out.smallest.item() == pytest.approx(sel.smallest.item(), rel=1e-5)
    assert out.aux is not None and set(out.aux.indices[out.aux.values > 0].tolist()) <= set(range(5))


@pytest.mark.gpu
def test_crosscoder_training_pass_on_cuda_matches_the_cpu_reference():
    import copy

    torch.manual_seed(4)
    cpu = SparseCoder(d_in=40, n_latents=300, k=8, kind="crosscoder", n_sources=2, kernel_impl="reference")
    with torch.no_grad():
        cpu.W_dec.mul_(torch.rand(300, 1) + 0.5)
    gpu = copy.deepcopy(cpu).cuda()
    gpu.kernel_impl = "auto"
    x = torch.randn(256, 80)
    out_c = cpu.spec.train_forward(cpu, x, local_inputs(x))
    out_g = gpu.spec.train_forward(gpu, x.cuda(), local_inputs(x.cuda()))
    assert torch.allclose(out_g.x_hat.cpu(), out_c.x_hat, atol=1e-4)
    assert out_g.smallest.item() == pytest.approx(out_c.smallest.item(), rel=1e-4)
    with torch.no_grad():
        cpu.threshold.fill_(out_c.smallest.item())
        gpu.threshold.fill_(out_c.smallest.item())
    assert torch.allclose(gpu.encode(x.view(256, 2, 40).cuda()).cpu(), cpu.encode(x.view(256, 2, 40)), atol=1e-4)
