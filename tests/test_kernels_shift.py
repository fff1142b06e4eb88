"""``kernels.encode(shift=)``: the encoder of ``x - shift`` (the kinds' ``x - b_dec``), whose fast backward makes the
shift's gradient from b_enc's (minus W_enc times it) instead of x's gather-sum and a sum over the rows.

Against the dense reference (values and gradients of W_enc, b_enc and the shift, every implementation), and against
the same implementation given ``x - shift`` (the form before ``shift=``): the code and the gradients of W_enc and
b_enc equal bit for bit, the shift's gradient equal within float32 summation order.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton_impl

from conceptdict.saes import kernels
from conceptdict.saes.kernels import sparse

pytestmark = pytest.mark.unit

IMPLS = [
    "torch",
    pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")),
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="triton not installed")),
]


@pytest.fixture(autouse=True)
def _small_row_chunks(monkeypatch):
    monkeypatch.setattr(sparse, "ROW_CHUNK", 16)


def _inputs(B, D, L, latent_major, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g)
    W = torch.randn(L, D, generator=g).t() if latent_major else torch.randn(D, L, generator=g)
    W = (W / D**0.5).requires_grad_()
    b = (0.1 * torch.randn(L, generator=g)).requires_grad_()
    s = (0.3 * torch.randn(D, generator=g)).requires_grad_()
    return x, W, b, s


def _run(impl, x, W, b, s, k, shifted, x_grad=False, **kw):
    """(dense code, dense aux code, grads of (x, W, b, s)) of a random linear function of both codes; ``shifted``:
    through ``shift=s``, else through ``x - s`` as the kinds passed it before."""
    x = x.clone().requires_grad_(x_grad)
    enc = (kernels.encode(x, W, b, k, impl=impl, shift=s, **kw) if shifted
           else kernels.encode(x - s, W, b, k, impl=impl, **kw))
    L = W.shape[1]
    g = torch.Generator().manual_seed(7)
    R, R_aux = torch.randn(x.shape[0], L, generator=g), torch.randn(x.shape[0], L, generator=g)
    dense = torch.zeros(x.shape[0], L).scatter_add(1, enc.indices, enc.values.float())
    dense_aux = torch.zeros(x.shape[0], L).scatter_add(1, enc.aux_indices, enc.aux_values.float())
    loss = (dense * R).sum() + (dense_aux * R_aux).sum()
    grads = torch.autograd.grad(loss, (x, W, b, s) if x_grad else (W, b, s), allow_unused=True)
    return dense.detach(), dense_aux.detach(), (None,) * (not x_grad) + grads


def _close(a, b, what):
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a / scale, b / scale, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,D,L,k", [(37, 19, 53, 5), (11, 11, 23, 1), (1, 5, 9, 3)])
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("latent_major", [False, True])
@pytest.mark.parametrize("n_dead,aux_form", [(0, "auto"), (1, "auto"), (1, "sparse"), (17, "sparse")])
def test_shift_against_the_reference_and_the_shifted_rows(impl, B, D, L, k, batch, latent_major, n_dead, aux_form,
                                                          monkeypatch):
    if aux_form == "sparse":
        monkeypatch.setattr(sparse, "DENSE_AUX_FACTOR", 0)
    x, W, b, s = _inputs(B, D, L, latent_major)
    dead = torch.zeros(L, dtype=torch.bool)
    dead[torch.randperm(L, generator=torch.Generator().manual_seed(2))[:min(n_dead, L)]] = True
    kw = {"batch": batch, "dead": dead, "k_aux": 3 if n_dead else 0}
    ref = _run("reference", x, W, b, s, k, shifted=True, **kw)
    got = _run(impl, x, W, b, s, k, shifted=True, **kw)
    before = _run(impl, x, W, b, s, k, shifted=False, **kw)
    for what, a, r in zip(("code", "aux code", "grad W_enc", "grad b_enc", "grad shift"),
                          (*got[:2], *got[2][1:]), (*ref[:2], *ref[2][1:])):
        _close(a, r, what)
    # against the same implementation on x - shift: equal, but for the shift's gradient (another summation order)
    for what, a, r in zip(("code", "aux code", "grad W_enc", "grad b_enc"), (*got[:2], *got[2][1:3]),
                          (*before[:2], *before[2][1:3])):
        assert torch.equal(a, r), what
    _close(got[2][3], before[2][3], "grad shift against x - shift")


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
def test_shift_with_rows_that_take_a_gradient(impl):
    """x with a gradient of its own: x - shift through autograd, as before; every gradient the reference's."""
    x, W, b, s = _inputs(29, 13, 41, True, seed=3)
    ref = _run("reference", x, W, b, s, 4, shifted=True, x_grad=True)
    got = _run(impl, x, W, b, s, 4, shifted=True, x_grad=True)
    for what, a, r in zip(("code", "grad x", "grad W_enc", "grad b_enc", "grad shift"),
                          (got[0], *got[2]), (ref[0], *ref[2])):
        _close(a, r, what)


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", ["torch", pytest.param("numba", marks=IMPLS[1].marks)])
def test_shift_with_a_bf16_matmul(impl):
    """A bf16 encoder matmul (grad_x reads W_enc rounded to bf16): x - shift stays in autograd, so every number is
    the one through x - shift, bit for bit."""
    x, W, b, s = _inputs(40, 24, 64, True, seed=4)
    got = _run(impl, x, W, b, s, 5, shifted=True, mm_dtype=torch.bfloat16)
    before = _run(impl, x, W, b, s, 5, shifted=False, mm_dtype=torch.bfloat16)
    for what, a, r in zip(("code", "grad W_enc", "grad b_enc", "grad shift"), (got[0], *got[2][1:]),
                          (before[0], *before[2][1:])):
        assert torch.equal(a, r), what


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("latent_major", [False, True])
@pytest.mark.parametrize("x_grad", [False, True])
def test_encode_above_with_a_shift(impl, latent_major, x_grad):
    """JumpReLU's encoder (every entry carries its gradient, the padding's included): against the reference, and
    against the same implementation on x - shift (equal but for the shift's gradient)."""
    x, W, b, s = _inputs(45, 17, 61, latent_major, seed=5)
    floor = 0.2 * torch.rand(61, generator=torch.Generator().manual_seed(6))
    wanted = (x, W, b, s)
    res = {}
    for name, shifted in (("reference", True), (impl, True), (impl, False)):
        rows = x.clone().requires_grad_(x_grad)
        z, idx, kept = (kernels.encode_above(rows, W, b, floor, 3, impl=name, shift=s) if shifted
                        else kernels.encode_above(rows - s, W, b, floor, 3, impl=name))
        dense = torch.zeros(45, 61).scatter_add(1, idx, z * kept)
        weight = torch.randn(z.shape, generator=torch.Generator().manual_seed(8))
        # (the padding's values and gradients are not defined: the loss reads the kept entries only)
        loss = (dense * torch.randn(45, 61, generator=torch.Generator().manual_seed(7))).sum() + \
            (z * kept * weight).sum()
        res[name, shifted] = (dense.detach(), *torch.autograd.grad(loss, (rows, *wanted[1:]) if x_grad else wanted[1:]))
    names = ("code", "grad x", "grad W_enc", "grad b_enc", "grad shift") if x_grad else \
        ("code", "grad W_enc", "grad b_enc", "grad shift")
    for what, a, r in zip(names, res[impl, True], res["reference", True]):
        _close(a, r, what)
    for what, a, r in list(zip(names, res[impl, True], res[impl, False]))[:-1]:
        assert torch.equal(a, r), what
    _close(res[impl, True][-1], res[impl, False][-1], "grad shift against x - shift")


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("n_dead,aux_form", [(0, "auto"), (2, "auto"), (7, "sparse")])
def test_shift_with_a_row_scale(impl, batch, n_dead, aux_form, monkeypatch):
    """The row-relative rule's rows (x - shift) / s(x), s differentiable in the shift (as ``kinds.common.row_scale``):
    the gradients of W_enc, b_enc and the shift (through the rows and through s) against the reference, and against
    the same implementation given the divided rows."""
    if aux_form == "sparse":
        monkeypatch.setattr(sparse, "DENSE_AUX_FACTOR", 0)
    B, D, L, k = 37, 19, 53, 4
    x, W, b, s = _inputs(B, D, L, True, seed=9)
    x = x * torch.linspace(0.5, 3.0, B)[:, None]  # rows of different norms
    dead = torch.zeros(L, dtype=torch.bool)
    dead[:n_dead] = True
    kw = {"batch": batch, "dead": dead, "k_aux": 3 if n_dead else 0}
    weight = torch.randn(B, L, generator=torch.Generator().manual_seed(7))
    res = {}
    for name, shifted in (("reference", True), (impl, True), (impl, False)):
        scale = (x - s).norm(dim=1, keepdim=True) / D**0.5
        enc = (kernels.encode(x, W, b, k, impl=name, shift=s, row_scale=scale, **kw) if shifted
               else kernels.encode((x - s) / scale, W, b, k, impl=name, **kw))
        dense = torch.zeros(B, L).scatter_add(1, enc.indices, enc.values * scale)
        dense = dense.scatter_add(1, enc.aux_indices, enc.aux_values * scale)
        res[name, shifted] = (dense.detach(), *torch.autograd.grad((dense * weight).sum(), (W, b, s)))
    names = ("code", "grad W_enc", "grad b_enc", "grad shift")
    for what, a, r in zip(names, res[impl, True], res["reference", True]):
        _close(a, r, what)
    for what, a, r in list(zip(names, res[impl, True], res[impl, False]))[:-1]:
        assert torch.equal(a, r), what
    _close(res[impl, True][-1], res[impl, False][-1], "grad shift against the divided rows")
