"""bf16 inside the kernels of a bf16 step: the selection reads the bf16 matmul's chunks as they are, and the gathers
read bf16 copies of the weights (``kernels.copies``), remade after each update. Each is checked against the float32
computation on the same rounded values: the selection exactly, the gathers and their gradients against the dense
reference (``reference.rounded_rows``) for every implementation."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conceptdict.saes import kernels
from conceptdict.saes.adam import Adam
from conceptdict.saes.kernels import copies, reference, sparse

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]

HAS_NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="no numba")
IMPLS = ["torch", pytest.param("numba", marks=needs_numba)]
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _small_row_chunks(monkeypatch):
    """Encode in chunks of 16 rows, so the chunked selection runs at test shapes."""
    monkeypatch.setattr(sparse, "ROW_CHUNK", 16)


def _numba():
    from conceptdict.saes.kernels import numba_impl

    return numba_impl


@needs_numba
@pytest.mark.parametrize("scaled", [False, True])
def test_the_row_primitives_read_bf16_rows_as_the_float32_numbers_they_are(scaled):
    nb = _numba()
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(37, 301, generator=g).to(BF16)  # 301 columns: the scan's tail after its 32-column blocks
    bias = torch.randn(301, generator=g) * 0.1
    scale = torch.rand(301, generator=g) + 0.5 if scaled else None
    wide = pre.float()
    for floor in (float("-inf"), 0.5):
        got, want = nb.row_topk(pre, 7, None, bias, scale, floor), nb.row_topk(wide, 7, None, bias, scale, floor)
        assert got[0].dtype == torch.float32  # the scores pre + bias, in the bias's float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cols = torch.tensor([3, 50, 7, 300, 120, 9, 11, 12])
    got, want = nb.row_topk(pre, 3, cols, bias), nb.row_topk(wide, 3, cols, bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(nb.row_above(pre, 1.0, 40, bias, scale), nb.row_above(wide, 1.0, 40, bias, scale)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    floor = torch.rand(301, generator=g)
    got, want = nb.row_above_floor(pre, bias, floor, 50), nb.row_above_floor(wide, bias, floor, 50)
    assert torch.equal(got[0].float(), want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@needs_numba
def test_the_gathers_read_bf16_rows_as_the_float32_numbers_they_are():
    nb = _numba()
    g = torch.Generator().manual_seed(1)
    W = torch.randn(53, 19, generator=g).to(BF16)
    idx = torch.randint(0, 53, (11, 5), generator=g)
    val = torch.randn(11, 5, generator=g)
    G = torch.randn(11, 19, generator=g)
    out = nb.gather_sum(idx, val, W, None)
    assert out.dtype == torch.float32 and torch.equal(out, nb.gather_sum(idx, val, W.float(), None))
    assert torch.equal(nb.gather_dot(idx, G, W, val), nb.gather_dot(idx, G, W.float(), val))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("skip_zero_grads", [False, True])
def test_sparse_decode_with_bf16_rows_matches_the_reference_in_values_and_gradients(impl, skip_zero_grads):
    g = torch.Generator().manual_seed(2)
    W = torch.randn(53, 19, generator=g)
    b = torch.randn(19, generator=g)
    v = torch.randn(37, 5, generator=g)
    v[::4, 1] = 0  # zeros: padding / ReLU zeros, whose gradient skip_zero_grads drops
    idx = torch.randint(0, 53, (37, 5), generator=g)
    grad = torch.randn(37, 19, generator=g)
    results = []
    for fn in (lambda *a: kernels.sparse_decode(*a, impl=impl, skip_zero_grads=skip_zero_grads, rows_dtype=BF16),
               lambda *a: reference.sparse_decode(*a, skip_zero_grads=skip_zero_grads, rows_dtype=BF16),
               lambda *a: reference.sparse_decode(*a, skip_zero_grads=skip_zero_grads)):
        ts = [t.clone().requires_grad_() for t in (v, W, b)]
        out = fn(ts[0], idx, ts[1], ts[2])
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in ts)))
    fast, ref, unrounded = results
    assert fast[0].dtype == torch.float32
    for what, a, e in zip(("x_hat", "values' grad", "W_dec's grad", "b_dec's grad"), fast, ref):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, w=what: f"{w}: {m}")
    assert (fast[0] - unrounded[0]).abs().max() > 1e-4  # the rows were read rounded
    torch.testing.assert_close(fast[2], unrounded[2], rtol=1e-5, atol=1e-5)  # W_dec's gradient reads no weights


@needs_numba
@pytest.mark.parametrize("batch", [False, True])
def test_a_bf16_encode_selects_on_its_bf16_chunks_as_on_their_float32_copies(batch):
    nb = _numba()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 24, generator=g)
    W = (torch.randn(300, 24, generator=g) / 5).t()  # latent-major, as SparseCoder keeps it
    b = torch.randn(300, generator=g) * 0.05
    dead = torch.zeros(300, dtype=torch.bool)
    dead[::7] = True
    copying = nb.BACKEND._replace(reads_bf16=False)  # the chunk copied to float32 first, as before
    kw = dict(batch=batch, dead=dead, k_aux=6, dense_aux_ok=False, mm_dtype=BF16)
    direct, copied = sparse.encode(x, W, b, 5, nb.BACKEND, **kw), sparse.encode(x, W, b, 5, copying, **kw)
    for a, e in zip(direct, copied):
        assert torch.equal(a, e)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_bf16_encode_reads_w_enc_rounded_for_the_gradient_of_x_only(impl):
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(70, 24, generator=g)
    W0 = (torch.randn(300, 24, generator=g) / 5).t()
    b0 = torch.randn(300, generator=g) * 0.05
    x, W, b = (t.clone().requires_grad_() for t in (x0, W0, b0))
    enc = kernels.encode(x, W, b, 5, impl=impl, mm_dtype=BF16)
    weight = torch.randn(enc.values.shape, generator=g)
    (enc.values * weight).sum().backward()
    # dense reference: the values at the chosen entries are float32's; x's gradient reads W rounded, W's reads x
    xr, Wr, br = (t.clone().requires_grad_() for t in (x0, W0, b0))
    rounded = Wr.detach().to(BF16).float()
    pre = xr.detach() @ Wr + br + xr @ rounded - (xr @ rounded).detach()
    want = (torch.relu(pre).gather(1, enc.indices) * (enc.values.detach() > 0) * weight).sum()
    want.backward()
    torch.testing.assert_close(enc.values.detach(), torch.relu(x0 @ W0 + b0).gather(1, enc.indices) *
                               (enc.values.detach() > 0), rtol=0, atol=1e-5)
    for what, a, e in (("x", x.grad, xr.grad), ("W_enc", W.grad, Wr.grad), ("b_enc", b.grad, br.grad)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, w=what: f"{w}: {m}")
    S = torch.zeros(70, 300).scatter(1, enc.indices, weight * (enc.values.detach() > 0))
    assert (x.grad - S @ W0.t()).abs().max() > 1e-5  # not the float32 weights' gradient


def test_a_rounded_copy_is_made_once_per_update_and_never_stale():
    p = torch.nn.Parameter(torch.randn(40, 8))
    W = p.t()  # a transposed view: the copy is of the storage, handed out in the view's layout
    first = copies.rounded(W, BF16)
    assert first.dtype == BF16 and first.shape == W.shape and first.stride() == W.stride()
    assert torch.equal(first, W.detach().to(BF16))
    again = copies.rounded(W, BF16)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, first)  # not copied again
    assert copies.rounded(p, BF16).data_ptr() == first.data_ptr()  # the parameter and its view share it
    opt = Adam([p.detach().t()], lr=0.5)  # the training loop's Adam, on the storage-order alias it steps
    opt.params[0].grad = torch.ones_like(W)
    opt.step()  # torch's fused kernel writes without a version bump; Adam bumps it
    assert torch.equal(copies.rounded(W, BF16), W.detach().to(BF16))
    with torch.no_grad():
        p /= p.norm(dim=1, keepdim=True)  # as the decoder renormalisation writes
    assert torch.equal(copies.rounded(W, BF16), W.detach().to(BF16))
    copies.release_copies()
    assert torch.equal(copies.rounded(W, BF16), W.detach().to(BF16))


def test_the_encoder_parameter_a_transposed_matrix_gets_one_copy_per_update():
    from conceptdict.saes import SparseCoder

    model = SparseCoder(8, 40, 4)  # W_enc: a [D, L] parameter over latent-major [L, D] storage
    W = model.W_enc
    first = copies.rounded(W, BF16)
    assert first.stride() == W.stride() and torch.equal(first, W.detach().to(BF16))
    assert copies.rounded(model.W_enc, BF16).data_ptr() == first.data_ptr()
    with torch.no_grad():
        model.W_enc.mul_(2)
    assert torch.equal(copies.rounded(model.W_enc, BF16), model.W_enc.detach().to(BF16))
