"""The passes of the update over the weights: the decoder-gradient projection (``kernels.project_rows``, one numba
pass) against its dense reference for every implementation, and the gradient clipping, which equals
``torch.nn.utils.clip_grad_norm_`` bit for bit and writes no gradient when the norm is below the limit."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from conceptdict.saes import SparseCoder, kernels
from conceptdict.saes.comm import LOCAL
from conceptdict.saes.kernels import reference
from conceptdict.saes.update import clip_grads

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
        assert torch.equal(p.grad, q.grad)
    written = [p.grad._version != v for p, v in zip(model.parameters(), versions)]
    assert all(written) if scale > 1 else not any(written)
