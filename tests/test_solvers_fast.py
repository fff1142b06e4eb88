"""The fast paths of the CBM's solvers converge to the same fits: FISTA on a working set (checked on all features,
violators added) against the plain solve on every feature, and the sparse (CSR) products against the dense ones."""

from __future__ import annotations

import math

import pytest
import torch

from conceptdict.naming.bottleneck import solvers
from conceptdict.naming.bottleneck.solvers import Rows, fit_linear, fit_path, kkt_residual, objective

pytestmark = pytest.mark.unit

TOL = 1e-6


def _same_fit(a, b):
    """Two fits of one problem, both within TOL of its optimality conditions: the CE is flat along some directions
    (no bias, non-negative features), so weights agree to a small share of their size, not to TOL."""
    return float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())


def _mostly_inactive(n=300, F=400, C=3, informative=6, density=1.0, seed=0):
    """Non-negative activations of F features of which only the first ``informative`` carry the class, feature j
    class j % C with strength 1.5 / (1 + j / 3) (the others noise), each row's features active with probability
    ``density``: at the lambdas below most features are inactive, and more enter as lambda falls."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=gen)
    x = torch.rand(n, F, generator=gen)
    for j in range(informative):
        x[:, j] += 1.5 / (1 + j / 3) * (y == j % C).float()
    if density < 1:
        x = x * (torch.rand(n, F, generator=gen) < density)
    return x, y


@pytest.mark.parametrize("lam", [3.0, 10.0])
def test_working_set_fit_meets_the_full_kkt_and_equals_the_plain_fit(lam):
    x, y = _mostly_inactive()
    ws = fit_linear(x, y, 3, bias=False, l1=lam, tol=TOL)
    plain = fit_linear(x, y, 3, bias=False, l1=lam, tol=TOL, working_set=False)
    used = (ws.weight != 0).any(0)
    assert 0 < int(used.sum()) < 0.2 * x.shape[1]  # most features inactive: the working set is what is solved
    assert ws.residual < TOL
    assert kkt_residual(x, y, ws.weight, None, lam) < TOL  # on ALL features, not only the working set
    assert math.isclose(objective(x, y, ws.weight, None, lam), objective(x, y, plain.weight, None, lam), rel_tol=1e-7)
    assert torch.equal(used, (plain.weight != 0).any(0))
    assert _same_fit(ws.weight, plain.weight)


def test_working_set_adds_the_features_a_warm_start_misses():
    """Warm-started from a sparse fit at a much larger lambda, the start's working set lacks features the smaller
    lambda uses: they enter through the check on all features, and the fit is the plain one."""
    x, y = _mostly_inactive(F=300, informative=12)
    start = fit_linear(x, y, 3, bias=False, l1=60.0, tol=TOL)
    ws = fit_linear(x, y, 3, bias=False, l1=1.0, init=start, tol=TOL)
    plain = fit_linear(x, y, 3, bias=False, l1=1.0, tol=TOL, working_set=False)
    assert int((ws.weight != 0).any(0).sum()) > int((start.weight != 0).any(0).sum())
    assert kkt_residual(x, y, ws.weight, None, 1.0) < TOL
    assert _same_fit(ws.weight, plain.weight)


def test_working_set_adds_a_feature_that_only_matters_at_the_optimum():
    """A suppressor: feature 1 is the noise of feature 0 and carries nothing about the class alone, so at the zero
    start it meets its condition and is outside the working set; at the optimum it cancels feature 0's noise. Only
    the check on all features after the working set's solve brings it in."""
    gen = torch.Generator().manual_seed(0)
    n, F, lam = 400, 100, 8.0
    y = torch.randint(0, 2, (n,), generator=gen)
    x = 0.3 * torch.randn(n, F, generator=gen)
    z = torch.randn(n, generator=gen)
    x[:, 0], x[:, 1] = y.float() + z, z
    W = torch.zeros(2, F, requires_grad=True)
    torch.nn.functional.cross_entropy(x @ W.T, y).backward()
    assert float(W.grad[:, 1].abs().max()) < lam / W.numel()  # not a violator at the start
    ws = fit_linear(x, y, 2, bias=False, l1=lam, tol=TOL)
    plain = fit_linear(x, y, 2, bias=False, l1=lam, tol=TOL, working_set=False)
    assert (ws.weight[:, 1] != 0).all()
    assert kkt_residual(x, y, ws.weight, None, lam) < TOL
    assert _same_fit(ws.weight, plain.weight)


def test_working_set_keeps_the_bias_and_l2_terms():
    x, y = _mostly_inactive(n=200, F=150)
    ws = fit_linear(x, y, 3, bias=True, l1=4.0, l2=0.5, tol=TOL)
    plain = fit_linear(x, y, 3, bias=True, l1=4.0, l2=0.5, tol=TOL, working_set=False)
    assert kkt_residual(x, y, ws.weight, ws.bias, 4.0, 0.5) < TOL
    assert _same_fit(ws.weight, plain.weight) and _same_fit(ws.bias, plain.bias)


def test_sparse_products_equal_the_dense_ones_and_give_the_same_path(monkeypatch):
    x, y = _mostly_inactive(density=0.05)
    rows = Rows(x)
    assert rows.csr is not None  # 5% nonzero: multiplied as CSR
    W, g = torch.randn(3, x.shape[1], dtype=torch.float64), torch.randn(len(x), 3, dtype=torch.float64)
    assert torch.allclose(rows.logits(W), x.double() @ W.T, atol=1e-12)
    assert torch.allclose(rows.grad(g), g.T @ x.double(), atol=1e-12)
    sparse = fit_path(x, y, 3, bias=False, l1=[0.3, 3.0], tol=TOL)
    monkeypatch.setattr(solvers, "SPARSE_DENSITY", 0.0)
    assert Rows(x).csr is None
    dense = fit_path(x, y, 3, bias=False, l1=[0.3, 3.0], tol=TOL)
    for key in dense:
        assert sparse[key].weight.dtype == x.dtype
        assert torch.allclose(sparse[key].weight, dense[key].weight, atol=1e-5)
        assert kkt_residual(x, y, sparse[key].weight, None, key[0]) < TOL


def test_lbfgs_reads_sparse_inputs():
    """The relaxed refits (L-BFGS, L2 only) on CSR inputs: the same fit as on dense ones."""
    x, y = _mostly_inactive(F=60, density=0.1)
    fit = fit_linear(x, y, 3, bias=False, l2=1.0, tol=1e-7)
    assert kkt_residual(x, y, fit.weight, None, 0.0, 1.0) < 1e-6
    W = torch.zeros(3, 60, requires_grad=True)
    opt = torch.optim.LBFGS([W], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ W.T, y) + W.pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.allclose(fit.weight, W.detach(), atol=1e-3)
