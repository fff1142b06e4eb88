"""SpaDE's support search (``kernels.sparsemax_support``): every implementation against the dense reference (the
whole row sorted), support and size exactly, and ``encode_sparsemax`` with each search, values and gradients."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conceptdict.saes import kernels
from conceptdict.saes.kernels import kinds as kind_ops

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]

IMPLS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                                   reason="no numba"))]
# (rows, latents, scale, torch's candidates): supports from 1 to the whole row, widths that are and are not whole
# blocks of the numba scan (32), and rows whose support fills torch's candidates (its wider paths)
CASES = [(37, 50, 0.4, 6), (24, 400, 0.002, 4), (24, 400, 0.1, 16), (64, 1000, 0.01, 16), (5, 33, 0.001, 4),
         (8, 1, 1.0, 1), (40, 4096, 0.05, 64), (16, 2051, 0.0005, 8), (3, 64, 1e-6, 4)]


def _scores(n, L, seed=0):
    """Rows of L distinct scores: a random permutation of evenly spaced values over about [-6, 6], each row its own
    spread (the support's order is then unique)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(L, generator=g) for _ in range(n)]).float()
    return (perm - L / 2 + 0.37) * (12 / max(L, 1)) * (0.5 + torch.rand(n, 1, generator=g))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,L,scale,m", CASES)
def test_support_is_the_references(impl, n, L, scale, m):
    pre, s = _scores(n, L), torch.tensor(scale)
    assert all(row.unique().numel() == L for row in pre * s)
    want_idx, want_size = kernels.sparsemax_support(pre, s, m, impl="reference")
    idx, size = kernels.sparsemax_support(pre, s, m, impl=impl)
    assert torch.equal(size, want_size)
    assert torch.equal(idx, want_idx)  # by decreasing score, zero-padded after each row's support
    f = kernels.reference.sparsemax(pre * s)
    assert torch.equal(size, (f > 0).sum(dim=1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,L,scale,m", CASES)
def test_pack_is_the_references(impl, n, L, scale, m):
    """``sparsemax_pack`` (the support, its size and the scores there, 0 after each row's support) against the dense
    reference, exactly; it has no autograd (the scores' gradients come through ``gather_pre``)."""
    pre, s = _scores(n, L, seed=2) + 0.25, torch.tensor(scale)
    want = kernels.sparsemax_pack(pre, s, m, impl="reference")
    got = kernels.sparsemax_pack(pre, s, m, impl=impl)
    for a, r in zip(got, want):
        assert a.dtype == r.dtype and torch.equal(a, r)
    assert torch.equal(want[2], torch.where(torch.arange(want[0].shape[1]) < want[1][:, None], pre.gather(1, want[0]),
                                            0.0))
    assert bool((want[2] != 0).any())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 2])
def test_support_after_rows_of_other_thresholds(impl, threads):
    """Rows whose thresholds the earlier rows guess well (the numba search reads only the scores above the guess), then
    rows shifted far down (the guess is above their threshold: the row searched again) and far up (most scores above
    the guess), in runs longer than the search's history: the reference's supports exactly, on one thread and two."""
    import numba

    pre = torch.cat([_scores(8, 700, seed=s) * 0.2 + shift for s, shift in enumerate((0, 0, 0, -5, 0, 3, -1, 0))])
    pre = pre[torch.randperm(pre.shape[0], generator=torch.Generator().manual_seed(3))[:40]].contiguous()
    pre = torch.cat([_scores(24, 700, seed=9) * 0.2, pre, _scores(1, 700, seed=10) - 8])
    s = torch.tensor(0.5)
    want_idx, want_size = kernels.sparsemax_support(pre, s, 8, impl="reference")
    before = numba.get_num_threads() if impl == "numba" else None
    try:
        if before is not None:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        idx, size = kernels.sparsemax_support(pre, s, 8, impl=impl)
    finally:
        if before is not None:
            numba.set_num_threads(before)
    assert torch.equal(size, want_size) and torch.equal(idx, want_idx)
    assert int(size.min()) > 1 and int(size.max()) < 700


@pytest.mark.parametrize("impl", IMPLS)
def test_code_fired_is_the_references(impl):
    """``code_fired`` (the latents with a positive entry, each row's count) against the reference, exactly: a
    zero-padded code with duplicates, zeros, negative and NaN values (none fires), in float32 and bf16; an index
    outside the dictionary at a positive entry is refused by numba (torch's indexing refuses it too)."""
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 300, (70, 40), generator=g)
    vals = torch.randn(70, 40, generator=g) * (torch.rand(70, 40, generator=g) > 0.4)
    vals[0, :3] = float("nan")
    for values in (vals, vals.bfloat16()):
        want = kernels.code_fired(values, idx, 300, impl="reference")
        got = kernels.code_fired(values, idx, 300, impl=impl)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].dtype == torch.bool and got[1].dtype == torch.int64 and 0 < int(got[0].sum()) < 300
    bad = idx.clone()
    bad[5, 0], vals[5, 0] = 1000, 1.0
    with pytest.raises(IndexError):
        kernels.code_fired(vals, bad, 300, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_support_with_equal_scores(impl):
    """Rows of few distinct values (many equal scores): the same supports; the numba search orders equal scores by
    increasing column."""
    pre = torch.randint(0, 12, (30, 300), generator=torch.Generator().manual_seed(1)).float()
    s = torch.tensor(0.05)
    want_idx, want_size = kernels.sparsemax_support(pre, s, 8, impl="reference")
    idx, size = kernels.sparsemax_support(pre, s, 8, impl=impl)
    assert torch.equal(size, want_size)
    kept = torch.arange(idx.shape[1]) < size[:, None]
    assert torch.equal(idx.masked_fill(~kept, -1).sort(dim=1).values, want_idx.masked_fill(~kept, -1).sort(dim=1).values)
    if impl == "numba":
        z = (pre * s).gather(1, idx)
        later = (z[:, 1:] < z[:, :-1]) | ((z[:, 1:] == z[:, :-1]) & (idx[:, 1:] > idx[:, :-1]))
        assert bool((later | ~kept[:, 1:]).all())


def _grads(impl, x, W, b, lam, w, m):
    leaves = [t.clone().requires_grad_() for t in (x, W, b, lam)]
    f, idx, z, kept = kernels.encode_sparsemax(leaves[0], leaves[1].t(), leaves[2], leaves[3], m, impl=impl)
    dense = torch.zeros(x.shape[0], W.shape[0]).scatter_add(1, idx, f)
    penalty = (f * z * kept).sum()  # z carries gradient too (SpaDE's distance-weighted L1 reads it)
    ((dense * w).sum() + 0.1 * penalty).backward()
    return [dense.detach(), idx, kept] + [t.grad for t in leaves]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lam,m", [(0.002, 4), (0.02, 16), (0.4, 6)])
def test_encode_sparsemax_values_and_grads(impl, lam, m, monkeypatch):
    """encode_sparsemax with each search against the dense reference (values and the gradients of x, W_enc, b_enc
    and the scale), and against the same implementation with torch's search: bit for bit."""
    monkeypatch.setattr(kind_ops, "ROW_CHUNK", 16)  # several chunks and their join
    g = torch.Generator().manual_seed(3)
    x, W, b = torch.randn(40, 16, generator=g), torch.randn(400, 16, generator=g), 0.3 * torch.randn(400, generator=g)
    w, lam = torch.randn(40, 400, generator=g), torch.tensor(lam)
    want = _grads("reference", x, W, b, lam, w, m)
    got = _grads(impl, x, W, b, lam, w, m)
    for name, a, r in zip(["value", "x", "W_enc", "b_enc", "scale"], got[:1] + got[3:], want[:1] + want[3:]):
        scale = max(1.0, float(r.abs().max()))
        torch.testing.assert_close(a / scale, r / scale, rtol=1e-4, atol=1e-5, msg=lambda s, name=name: f"{name}: {s}")
    monkeypatch.setitem(kernels.IMPLS["sparsemax_pack"], impl, "torch_impl:sparsemax_pack")
    before = _grads(impl, x, W, b, lam, w, m)
    for a, r in zip(got, before):
        assert torch.equal(a, r)


@pytest.mark.parametrize("impl", IMPLS)
def test_square_norms_values_and_grads_are_the_references(impl):
    """``square_norms`` (SpaDE's prototype norms) against the reference's autograd, bit for bit: values, and the
    gradient of a transposed leaf (W_enc's layout) that also takes a second gradient (the encoder's), in its layout."""
    g = torch.Generator().manual_seed(5)
    storage = torch.randn(300, 48, generator=g)
    weights, other = torch.randn(300, generator=g), torch.randn(48, 300, generator=g)
    out = {}
    for which in ("reference", impl):
        W = storage.clone().t().requires_grad_()
        norms = kernels.square_norms(W, impl=which)
        ((norms * weights).sum() + (W * other).sum()).backward()
        out[which] = norms.detach(), W.grad
    assert torch.equal(out[impl][0], out["reference"][0])
    assert torch.equal(out[impl][1], out["reference"][1])
    assert out[impl][1].stride() == (1, 48)


def _spade_grads(impl, x, W, b, s, lam, w, m, unit=1.0):
    leaves = [t.clone().requires_grad_() for t in (x, W, b, s, lam)]
    rows = leaves[0].square().sum(dim=1)
    f, idx, _, total = kernels.encode_spade(leaves[0], leaves[1].t(), leaves[2], leaves[3], leaves[4], rows, m,
                                            impl=impl, value_scale=unit)
    dense = torch.zeros(x.shape[0], W.shape[0], dtype=x.dtype).scatter_add(1, idx, f)
    ((dense * w).sum() + 0.1 * total).backward()
    return [dense.detach(), total.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("s,m,unit", [(0.002, 4, 1.0), (0.02, 16, 27.7), (0.4, 6, 0.3)])
def test_encode_spade_values_and_grads(impl, s, m, unit, monkeypatch):
    """SpaDE's code and distance term (``encode_spade``; numba: the fused tail) against the dense reference: the
    code (times ``value_scale``), the term, and the gradients of x (through the scores and |x|^2), W_enc, b_enc, the
    scale and lambda."""
    monkeypatch.setattr(kind_ops, "ROW_CHUNK", 16)
    g = torch.Generator().manual_seed(3)
    x, W, b = torch.randn(40, 16, generator=g), torch.randn(400, 16, generator=g), 0.3 * torch.randn(400, generator=g)
    w, s, lam = torch.randn(40, 400, generator=g), torch.tensor(s), torch.tensor(0.7)
    want = _spade_grads("reference", x, W, b, s, lam, w, m, unit)
    got = _spade_grads(impl, x, W, b, s, lam, w, m, unit)
    for name, a, r in zip(["code", "distance term", "x", "W_enc", "b_enc", "scale", "lambda"], got, want):
        scale = max(1.0, float(r.abs().max()))
        torch.testing.assert_close(a / scale, r / scale, rtol=1e-4, atol=1e-5, msg=lambda t, name=name: f"{name}: {t}")
    assert float(want[1]) > 0 and float(want[-1].abs()) > 0  # the term and lambda's gradient are not trivially 0
