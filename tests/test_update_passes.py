"""The passes of the update over the weights: the decoder-gradient projection (``kernels.project_rows``, one numba
pass) against its dense reference for every implementation, and the gradient clipping, which equals
``torch.nn.utils.clip_grad_norm_`` (its norm summed in another order: ``update.grad_norm``) and writes no gradient
when the norm is below the limit."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from conceptdict.saes import SparseCoder, kernels
from conceptdict.saes.comm import LOCAL
from conceptdict.saes.kernels import reference
from conceptdict.saes.update import clip_grads, grad_norm

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]

IMPLS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                                 reason="no numba"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(53, 19), (7, 768), (2, 3)])
def test_project_rows_matches_the_reference(impl, shape):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(shape, generator=g)
    W[0] = 0  # a zero row: its norm is clamped, its gradient kept
    G = torch.randn(shape, generator=g)
    want = G.clone()
    reference.project_rows(W, want)
    got = G.clone()
    kernels.project_rows(W, got, impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], G[0])
    nonzero = W.norm(dim=1) > 0
    assert torch.linalg.vecdot(W, got)[nonzero].abs().max() < 1e-4 * G.abs().max()  # nothing left along the rows


def test_project_rows_of_a_view_or_float64_takes_the_reference():
    g = torch.Generator().manual_seed(1)
    W, G = torch.randn(20, 9, generator=g), torch.randn(20, 9, generator=g)
    for w, grad in ((W.double(), G.double()), (W.t().contiguous().t(), G.t().contiguous().t())):
        want = grad.clone()
        reference.project_rows(w, want)
        got = grad.clone()
        kernels.project_rows(w, got)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [1e-3, 10.0])
def test_clip_grads_is_clip_grad_norm_and_writes_nothing_below_the_limit(scale):
    torch.manual_seed(0)
    model = SparseCoder(16, 64, 4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    other = copy.deepcopy(model)
    for p, q in zip(model.parameters(), other.parameters()):
        q.grad = p.grad.clone()
    versions = [p.grad._version for p in model.parameters()]
    clip_grads(model, 1.0, LOCAL, [])
    torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        assert scale > 1 or torch.equal(p.grad, q.grad)
    written = [p.grad._version != v for p, v in zip(model.parameters(), versions)]
    assert all(written) if scale > 1 else not any(written)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grad_norm_is_the_norm_of_every_gradient_in_any_layout(dtype):
    """Against the exact norm (float64 sums) and torch's get_total_norm: contiguous, transposed (W_enc's gradient
    is a view of latent-major storage) and strided gradients, a vector; NaN and inf propagate."""
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(300, 77, generator=g).to(dtype), torch.randn(64, 500, generator=g).to(dtype).t(),
             torch.randn(40, 30, generator=g).to(dtype)[:, ::3], torch.randn(513, generator=g).to(dtype)]
    exact = torch.cat([t.double().reshape(-1) for t in grads]).square().sum().sqrt()
    got = grad_norm(grads)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), exact, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    torch.testing.assert_close(got, torch.nn.utils.get_total_norm(grads), rtol=1e-5, atol=0)
    assert float(grad_norm([])) == 0.0
    for bad in (float("nan"), float("inf")):
        odd = [t.clone() for t in grads]
        odd[1][3, 5] = bad
        assert not torch.isfinite(grad_norm(odd))
