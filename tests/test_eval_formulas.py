"""evaluate() and the spliced-loss scores against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from conceptdict.saes import SparseCoder, ce_loss_recovered, evaluate, format_table, kl_score, with_splice_scores
from conceptdict.saes.evaluation import density_histogram

pytestmark = pytest.mark.unit


def _hand_model():
    """ReLU dictionary with W_enc = I, zero biases, W_dec = diag(0.5, 1): f = relu(x), x_hat = (0.5 f0, f1)."""
    m = SparseCoder(2, 2, 1, "relu")
    with torch.no_grad():
        m.W_enc.copy_(torch.eye(2))
        m.W_dec.copy_(torch.diag(torch.tensor([0.5, 1.0])))
        m.b_enc.zero_()
        m.b_dec.zero_()
    return m


X = torch.tensor([[1.0, 2.0], [3.0, 0.0]])  # x_hat = [[0.5, 2], [1.5, 0]]


def test_formulas_match_hand_computation():
    r = evaluate(_hand_model(), [X])
    # errors [[0.5, 0], [1.5, 0]] -> sum 2.5; mean x = (2, 1) -> sum ||x - mean||^2 = 4
    assert r.n_tokens == 2
    assert r.l0 == pytest.approx(1.5)
    assert r.mse == pytest.approx(2.5 / 4)
    assert r.fvu == pytest.approx(2.5 / 4)
    assert r.explained_variance == pytest.approx(1 - 2.5 / 4)
    # SAEBench: 1 - E||x - x_hat||^2 / (E||x||^2 - (mean of x^2 over elements)^2) = 1 - 1.25 / (7 - 3.5^2)
    assert r.explained_variance_saebench == pytest.approx(1 - 1.25 / (7 - 12.25))
    cos1 = 4.5 / math.sqrt(5 * 4.25)
    assert r.cos_sim == pytest.approx((cos1 + 1.0) / 2)
    assert r.l2_ratio == pytest.approx((math.sqrt(4.25 / 5) + 0.5) / 2)
    assert r.rel_recon_bias == pytest.approx(6.5 / 9)  # sum ||x_hat||^2 / sum <x, x_hat>
    assert r.density == pytest.approx((1.0, 0.5))
    assert r.dead_fraction == 0 and r.dense_fraction == 1.0
    assert r.per_source_fvu == pytest.approx((2.5 / 4,))
    assert r.density_histogram == (0, 0, 0, 0, 0, 0, 0, 0, 0, 2)


def test_batching_does_not_change_the_numbers():
    a = evaluate(_hand_model(), [X])
    b = evaluate(_hand_model(), [X[:1], X[1:]])
    da, db = a.to_dict(), b.to_dict()
    assert da.keys() == db.keys()
    for key in da:
        if isinstance(da[key], float):
            assert da[key] == pytest.approx(db[key], rel=1e-12), key
        else:
            assert da[key] == db[key], key


def test_dead_dense_and_histogram():
    density = torch.tensor([0.0, 1e-9, 5e-4, 0.05, 0.5, 1.0])
    # bins: never, [-inf,-8), [-8,-7), ..., [-2,-1), [-1, 0]
    assert density_histogram(density) == (1, 1, 0, 0, 0, 0, 1, 0, 1, 2)
    m = _hand_model()
    r = evaluate(m, [torch.tensor([[1.0, -1.0], [2.0, -3.0]])])
    assert r.dead_fraction == 0.5 and r.dense_fraction == 0.5


def test_per_source_fvu_for_crosscoders():
    m = SparseCoder(2, 4, 1, "relu", n_sources=2)
    with torch.no_grad():
        m.W_enc.copy_(torch.eye(4))
        m.W_dec.copy_(torch.diag(torch.tensor([1.0, 1.0, 0.0, 0.0])))  # source 1 never reconstructed
        m.b_enc.zero_()
        m.b_dec.zero_()
    x = torch.rand(16, 2, 2) + 0.1
    r = evaluate(m, [x])
    assert r.per_source_fvu[0] == pytest.approx(0.0, abs=1e-12)
    var1 = (x[:, 1] - x[:, 1].mean(0)).pow(2).sum()
    assert r.per_source_fvu[1] == pytest.approx(float(x[:, 1].pow(2).sum() / var1))


def test_spliced_scores():
    assert ce_loss_recovered(ce_clean=2.0, ce_zero=10.0, ce_sae=3.0) == pytest.approx(7 / 8)
    assert kl_score(kl_zero=4.0, kl_sae=1.0) == pytest.approx(0.75)
    assert math.isnan(kl_score(0.0, 0.0))
    r = with_splice_scores(evaluate(_hand_model(), [X]), 2.0, 10.0, 3.0, 4.0, 1.0)
    assert r.ce_loss_recovered == pytest.approx(7 / 8) and r.kl_score == pytest.approx(0.75)
    assert "CE loss recovered" in format_table(r) and "FVU (textbook)" in format_table(r)
    assert "ill-conditioned" not in format_table(r)


@pytest.mark.parametrize("clean,zero,spliced,why", [
    (3.10, 3.15, 3.02, "changes the LM's loss by only +0.05 nats"),  # zero-ablation barely hurts: 1.6 recovered
    (3.00, 5.00, 2.50, "below the clean model's"),  # 1.25: the spliced model beats the clean one
    (3.00, 5.00, 5.50, "above the zero-ablated model's"),  # -0.25
])
def test_an_ill_conditioned_ce_loss_recovered_says_why_and_points_at_the_kl_score(clean, zero, spliced, why):
    r = with_splice_scores(evaluate(_hand_model(), [X]), clean, zero, spliced, 4.0, 1.0)
    table = format_table(r)
    note = table.splitlines()[-1]
    assert note.startswith("note: CE loss recovered") and "ill-conditioned" in note and why in note
    assert note.endswith("read the KL score (0.75)")


def test_empty_input_is_refused():
    with pytest.raises(ValueError, match="no rows"):
        evaluate(_hand_model(), [])
