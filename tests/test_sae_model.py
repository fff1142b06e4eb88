"""SparseCoder: shapes, kinds, inference rules, decoder constraints, normalisation folding."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import KINDS, SparseCoder
from conceptdict.saes.batches import geometric_median, normalisation_scale

pytestmark = pytest.mark.unit


def _model(kind="topk", S=1, D=6, L=10, k=3, seed=0):
    m = SparseCoder(D, L, k, kind, n_sources=S)
    m.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        m.b_enc.normal_(0, 0.1)
        m.b_dec.normal_(0, 0.1)
    return m


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "batchtopk-absolute", "relu"])
@pytest.mark.parametrize("S", [1, 2])
def test_shapes_and_reconstruction(kind, S):
    m = _model(kind, S=S)
    x = torch.randn(5, 6) if S == 1 else torch.randn(5, S, 6)
    f = m.encode(x)
    assert f.shape == (5, 10) and (f >= 0).all()
    assert m(x).shape == x.shape
    assert m.decoder_directions().shape == ((10, 6) if S == 1 else (10, S, 6))
    assert m.W_enc.shape == (S * 6, 10) and m.W_dec.shape == (10, S * 6)


def test_topk_keeps_k_largest_relu_preactivations():
    m = _model("topk")
    x = torch.randn(7, 6)
    pre = torch.relu((x - m.b_dec) @ m.W_enc + m.b_enc)
    f = m.encode(x)
    assert ((f > 0).sum(dim=1) <= 3).all()
    top = pre.topk(3, dim=1)
    assert torch.allclose(f.gather(1, top.indices), top.values)


def test_batchtopk_absolute_inference_is_jumprelu_on_threshold():
    m = _model("batchtopk-absolute")
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(0))
    pre = torch.relu((x - m.b_dec) @ m.W_enc + m.b_enc)
    # halfway between two entries: the median itself is an entry, which a 1-row matmul can round to either side
    middle = pre.detach().flatten().sort().values[pre.numel() // 2 - 1: pre.numel() // 2 + 1]
    m.threshold.fill_(float(middle.mean()))
    f = m.encode(x)
    assert torch.equal(f, pre * (pre > m.threshold))
    # one row's code does not depend on its batch (up to the BLAS kernel a 1-row matmul takes: same support)
    one = m.encode(x[:1])
    assert torch.equal(one > 0, f[:1] > 0)
    torch.testing.assert_close(one, f[:1], rtol=1e-6, atol=1e-6)


def test_batchtopk_inference_is_relative_to_the_row_norm():
    """batchtopk: f = s relu(pre / s) where pre / s > theta, with s = |x - b_dec| / sqrt(D); so the code of
    b_dec + c v is c times the code of b_dec + v (a threshold that scales with the row, bias included)."""
    m = _model("batchtopk")
    x = torch.randn(9, 6)
    s = (x - m.b_dec).norm(dim=1, keepdim=True) / 6 ** 0.5
    rel = torch.relu(((x - m.b_dec) @ m.W_enc) / s + m.b_enc)
    values = rel.detach().flatten().sort().values
    mid = values.numel() // 2
    m.threshold.fill_(float(values[mid] + values[mid + 1]) / 2)  # between two scores: no rounding ties
    f = m.encode(x)
    torch.testing.assert_close(f, s * rel * (rel > m.threshold))
    assert 0 < int((f > 0).sum()) < f.numel()
    v = x - m.b_dec
    for c in (0.1, 7.0):
        torch.testing.assert_close(m.encode(m.b_dec + c * v), c * f, rtol=1e-5, atol=1e-6)


def test_kind_table_and_refusals():
    assert {"topk", "batchtopk", "batchtopk-absolute", "relu", "jumprelu", "gated"} <= set(KINDS)
    with pytest.raises(ValueError, match="unknown dictionary kind 'matryoshka-nested'"):
        SparseCoder(4, 8, 2, "matryoshka-nested")
    with pytest.raises(ValueError, match="k=8 must be at least 1 and below n_latents=8"):
        SparseCoder(4, 8, 8)
    with pytest.raises(ValueError, match=r"encode expects \[\.\.\., 2, 4\] \(2 sources x d_in 4 .*, got \[3, 8\]"):
        SparseCoder(4, 8, 2, n_sources=2).encode(torch.randn(3, 8))


def test_init_is_tied_and_unit_norm():
    m = SparseCoder(8, 16, 2)
    assert torch.allclose(m.W_dec.norm(dim=1), torch.ones(16))
    assert torch.equal(m.W_enc, m.W_dec.T)


def test_parallel_gradient_removed_and_rows_renormalised():
    m = _model()
    m.W_dec.grad = torch.randn_like(m.W_dec)
    m.remove_parallel_decoder_grad()
    assert torch.allclose((m.W_dec.grad * m.W_dec).sum(dim=1), torch.zeros(10), atol=1e-6)
    with torch.no_grad():
        m.W_dec.mul_(3.0)
    m.normalize_decoder()
    assert torch.allclose(m.W_dec.norm(dim=1), torch.ones(10))


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "batchtopk-absolute", "relu"])
def test_folding_the_input_scale_gives_the_same_codes_on_raw_inputs(kind):
    S, D = 2, 6
    m = _model(kind, S=S)
    m.threshold.fill_(0.05)
    x = torch.randn(8, S, D) * torch.tensor([3.0, 0.5])[None, :, None]
    c = normalisation_scale(m.flatten_input(x), S, D)
    xs = x * c[None, :, None]
    f_scaled, rec_scaled = m.encode(xs), m(xs)
    m.fold_input_scale(c)
    assert torch.allclose(m.encode(x), f_scaled, atol=1e-5)
    assert torch.allclose(m(x), rec_scaled / c[None, :, None], atol=1e-5)


def test_normalisation_scale_brings_mean_norm_to_sqrt_d():
    x = torch.randn(100, 2, 16) * torch.tensor([5.0, 0.1])[None, :, None]
    c = normalisation_scale(x.reshape(100, 32), 2, 16)
    norms = (x * c[None, :, None]).norm(dim=2).mean(dim=0)
    assert torch.allclose(norms, torch.full((2,), 4.0), rtol=1e-5)


def test_geometric_median():
    pts = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    assert torch.allclose(geometric_median(pts), torch.tensor([1.0, 1.0]), atol=1e-4)
    # robust to an outlier, unlike the mean
    pts = torch.cat([torch.zeros(9, 2) + torch.randn(9, 2) * 0.01, torch.tensor([[1000.0, 1000.0]])])
    assert geometric_median(pts).norm() < 1.0 < pts.mean(dim=0).norm()
