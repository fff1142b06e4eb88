"""The sparse passes over a wide code (``numba_wide``: by latent, tiled over D; SpaDE's ~1,000 entries a row): the
sparse decode and the encoder backward on codes wide enough to take them, every implementation against the dense
reference, values and gradients. The sums run in another order than the reference's: they agree to float32
rounding (relative 1e-5 of the largest magnitude)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conceptdict.saes import kernels
from conceptdict.saes.kernels import kinds as kind_ops

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]

HAS_NUMBA = importlib.util.find_spec("numba") is not None
IMPLS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not HAS_NUMBA, reason="no numba"))]
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="no numba")


def _close(got, want, name):
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-5, msg=lambda s: f"{name}: {s}")


def _code(B, K, L, seed=0, zeros=0.3):
    """A code [B, K] of distinct latents per row, a share ``zeros`` of its entries 0 (padding at the row's end and
    scattered zeros), values of both signs."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, L, generator=g).argsort(dim=1)[:, :K].contiguous()
    val = torch.randn(B, K, generator=g)
    val[torch.rand(B, K, generator=g) < zeros] = 0.0
    size = torch.randint(K // 2, K + 1, (B,), generator=g)
    val = torch.where(torch.arange(K) < size[:, None], val, 0.0)
    return idx, val


def _decode_grads(impl, idx, val, W, b, G, skip, rows_dtype=None):
    leaves = [t.clone().requires_grad_() for t in (val, W, b)]
    out = kernels.sparse_decode(leaves[0], idx, leaves[1], leaves[2], impl=impl, skip_zero_grads=skip,
                                rows_dtype=rows_dtype)
    (out * G).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("B,K,L,D,packed", [(256, 24, 64, 40, None), (300, 40, 96, 100, 600), (128, 64, 200, 33, 256)])
def test_wide_decode_values_and_grads(impl, skip, B, K, L, D, packed, monkeypatch):
    """A wide code's decode (B * K / L >= 32 entries per latent): its value and the gradients of the values, W_dec and
    b_dec, against the reference; ``packed`` shrinks the scatter's tiles so that D is cut into several, a partial one
    last, and the gather-sum's and gather-dot's blocks so that B is (24 and 31 rows a block here)."""
    if packed is not None:
        from conceptdict.saes.kernels import numba_wide

        monkeypatch.setattr(numba_wide, "PACKED_FLOATS", packed * 16)
        monkeypatch.setattr(numba_wide, "ROW_FLOATS", packed * 4)
    g = torch.Generator().manual_seed(1)
    idx, val = _code(B, K, L)
    W, b, G = torch.randn(L, D, generator=g), torch.randn(D, generator=g), torch.randn(B, D, generator=g)
    want = _decode_grads("reference", idx, val, W, b, G, skip)
    got = _decode_grads(impl, idx, val, W, b, G, skip)
    for name, a, r in zip(["x_hat", "values", "W_dec", "b_dec"], got, want):
        _close(a, r, name)


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_decode_bf16_rows(impl):
    """With ``rows_dtype`` bf16 (the rows read rounded, the sums float32) a wide code's decode is the reference's."""
    g = torch.Generator().manual_seed(2)
    idx, val = _code(256, 32, 128, seed=2)
    W, b, G = torch.randn(128, 48, generator=g), torch.randn(48, generator=g), torch.randn(256, 48, generator=g)
    want = _decode_grads("reference", idx, val, W, b, G, True, torch.bfloat16)
    got = _decode_grads(impl, idx, val, W, b, G, True, torch.bfloat16)
    for name, a, r in zip(["x_hat", "values", "W_dec", "b_dec"], got, want):
        _close(a, r, name)


@pytest.mark.parametrize("impl", IMPLS)
def test_wide_gather_pre_grads(impl):
    """gather_pre on a wide code with latent-major W_enc (as SparseCoder stores it): its backward (grad_x, grad_W_enc),
    bucketed once for both, against the reference; zero gradients at some entries."""
    g = torch.Generator().manual_seed(3)
    idx, w = _code(256, 40, 80, seed=3)
    x, W_t = torch.randn(256, 36, generator=g), torch.randn(80, 36, generator=g)

    other = torch.randn(36, 80, generator=g)

    def grads(i):
        xl, Wl = x.clone().requires_grad_(), W_t.clone().requires_grad_()
        W = Wl.t()
        out = kernels.gather_pre(xl, W, idx, impl=i)
        ((out * w).sum() + (W * other).sum()).backward()  # a second term of W_enc's gradient (SpaDE's norms)
        return out.detach(), xl.grad, Wl.grad

    for name, a, r in zip(["values", "x", "W_enc"], grads(impl), grads("reference")):
        _close(a, r, name)


@needs_numba
def test_wide_encoder_backward_layout_and_dtypes():
    """numba's encoder backward on a wide code gives W_enc's gradient in W_enc's latent-major layout, for float32 rows
    x (a tensor of its own over the recycled array, so autograd adds into it in place) and bf16 ones (a transposed
    view of the converted gradient)."""
    from conceptdict.saes.kernels import numba_impl

    g = torch.Generator().manual_seed(4)
    idx, w = _code(256, 40, 80, seed=4)
    W = torch.randn(80, 36, generator=g).t()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(256, 36, generator=g).to(dtype)
        _, grad_W = numba_impl.encoder_backward(idx, w, x, W)
        assert grad_W.dtype == dtype and grad_W.shape == W.shape and grad_W.stride() == W.stride()
        assert grad_W._is_view() == (dtype != torch.float32)
        want = torch.zeros(256, 80).scatter_add(1, idx, w).t() @ x.float()  # [L, D]
        if dtype == torch.float32:
            _close(grad_W, want.t(), "W_enc")
        else:  # the float32 sums rounded to bf16 once: within a bf16 rounding of them
            torch.testing.assert_close(grad_W.float(), want.t(), rtol=2**-8, atol=1e-6)


@needs_numba
def test_wide_codes_take_the_latent_passes():
    """SpaDE-wide codes are bucketed by latent (the passes of ``numba_wide``); TopK's stay on the row kernels."""
    from conceptdict.saes.kernels import numba_impl

    idx, val = _code(256, 40, 80)
    code = numba_impl.by_latent(idx, val, 80)
    assert code is not None
    assert code.start[-1] == int((val != 0).sum())  # the nonzero entries only
    assert numba_impl.by_latent(*_code(4096, 32, 16384), 16384) is None  # the benchmark's TopK code: 8 a latent
    padded = torch.zeros(256, 40)
    padded[:, :4] = 1.0  # wide in its shape, 12.8 nonzero entries a latent
    assert numba_impl.by_latent(idx, padded, 80) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_spade_step_on_a_wide_code(impl, monkeypatch):
    """encode_sparsemax and the decode of its code as SpaDE's step runs them (the code wide: ~15 of 64 latents a row
    over 512 rows), against the reference: the reconstruction and every gradient."""
    monkeypatch.setattr(kind_ops, "ROW_CHUNK", 128)
    g = torch.Generator().manual_seed(4)
    x, W, b = torch.randn(512, 24, generator=g), torch.randn(64, 24, generator=g), 0.2 * torch.randn(64, generator=g)
    W_dec, target = torch.randn(64, 24, generator=g), torch.randn(512, 24, generator=g)
    lam = torch.tensor(0.05)

    def grads(i):
        leaves = [t.clone().requires_grad_() for t in (x, W, b, lam, W_dec)]
        f, idx, z, kept = kernels.encode_sparsemax(leaves[0], leaves[1].t(), leaves[2], leaves[3], 8, impl=i)
        x_hat = kernels.sparse_decode(f, idx, leaves[4], None, impl=i, skip_zero_grads=True)
        ((target - x_hat).pow(2).sum() + 0.1 * (f * z * kept).sum()).backward()
        return [x_hat.detach(), (kept.sum(dim=1).float().mean())] + [t.grad for t in leaves]

    got, want = grads(impl), grads("reference")
    assert float(got[1]) * 512 / 64 >= 32  # wide enough for the latent passes
    for name, a, r in zip(["x_hat", "l0", "x", "W_enc", "b_enc", "scale", "W_dec"], got, want):
        _close(a, r, name)


@needs_numba
def test_second_code_on_the_same_entries_reuses_the_bucketing():
    """``numba_impl.by_latent`` on a second code with the same indices and nonzero entries (SpaDE's decode code, then
    its encoder gradient) takes the first bucketing with the second's values: the arrays a fresh bucketing builds;
    a code with other nonzero entries, or indices changed in place, is bucketed afresh."""
    from conceptdict.saes.kernels import numba_impl, numba_wide

    idx, val = _code(160, 40, 48, seed=4)  # ~65 nonzero entries a latent: wide
    numba_impl.release_buffers()
    first = numba_impl.by_latent(idx, val, 48)
    other = torch.where(val != 0, torch.randn(val.shape, generator=torch.Generator().manual_seed(5)), 0.0)
    again = numba_impl.by_latent(idx, other, 48)
    fresh = numba_wide.bucket(idx.numpy(), other.numpy(), 48)
    assert again.start is first.start
    for got, want in zip(again[:4], fresh):
        assert (got == want).all()
    more = other.clone()
    more[0, -1] = 1.5 if val[0, -1] == 0 else 0.0  # one entry in or out of the set
    assert numba_impl.by_latent(idx, more, 48).start is not first.start
    last = numba_impl.by_latent(idx, other, 48)
    idx.add_(0)  # a new version of the indices
    assert numba_impl.by_latent(idx, other, 48).start is not last.start
    numba_impl.release_buffers()
