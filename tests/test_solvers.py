"""The full-batch solvers of the concept bottleneck: same objective as the minibatch Adam they replace, at least
as low a value, the same accuracy, and the optimality (KKT) conditions met."""

from __future__ import annotations

import math

import pytest
import torch

from conceptdict.naming.bottleneck.solvers import fit_linear, fit_path, kkt_residual, objective

pytestmark = pytest.mark.unit


def _adam(x, y, C, *, bias, l1=0.0, l2=0.0, epochs=100, lr=1e-2, batch_size=64, seed=0):
    """The minibatch Adam fit that ``conceptdict cbm`` used before the full-batch solvers (the reference)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.zeros(C, x.shape[1], requires_grad=True)
    b = torch.zeros(C, requires_grad=True)
    opt = torch.optim.Adam([W, b] if bias else [W], lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch_size):
            logits = x[idx] @ W.T + (b if bias else 0)
            loss = torch.nn.functional.cross_entropy(logits, y[idx]) + l1 * W.abs().mean() + l2 * W.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return W.detach(), (b.detach() if bias else None)


def _noisy_problem(n=400, F=20, C=3, seed=0):
    """Overlapping classes (the optimum is finite even without a penalty): 3 informative features, the rest noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=gen)
    x = torch.randn(n, F, generator=gen)
    x[:, :C] += 1.2 * torch.nn.functional.one_hot(y, C).float()
    return x, y


def _acc(x, y, W, b):
    return float(((x @ W.T + (0 if b is None else b)).argmax(1) == y).float().mean())


@pytest.mark.parametrize("l1", [0.5, 3.0])
def test_fista_reaches_the_adam_objective_and_accuracy_and_meets_kkt(l1):
    x, y = _noisy_problem()
    xte, yte = _noisy_problem(seed=1)
    W_ref, _ = _adam(x, y, 3, bias=False, l1=l1)
    fit = fit_linear(x, y, 3, bias=False, l1=l1, tol=1e-6)
    assert objective(x, y, fit.weight, None, l1) <= objective(x, y, W_ref, None, l1) + 1e-4
    assert abs(_acc(xte, yte, fit.weight, None) - _acc(xte, yte, W_ref, None)) <= 0.02
    assert fit.residual < 1e-6
    assert kkt_residual(x, y, fit.weight, None, l1) < 1e-6
    # the conditions can fail: the Adam answer (never exactly zero) and the zero start violate them
    assert kkt_residual(x, y, torch.zeros(3, 20), None, l1) > 1e-3
    assert (fit.weight == 0).any()  # the soft threshold gives exact zeros on the noise features


@pytest.mark.parametrize("l2", [0.1, 1.0])
def test_lbfgs_probe_reaches_the_adam_objective_and_accuracy(l2):
    x, y = _noisy_problem()
    xte, yte = _noisy_problem(seed=1)
    W_ref, b_ref = _adam(x, y, 3, bias=True, l2=l2)
    fit = fit_linear(x, y, 3, bias=True, l2=l2, tol=1e-7)
    assert objective(x, y, fit.weight, fit.bias, 0.0, l2) <= objective(x, y, W_ref, b_ref, 0.0, l2) + 1e-4
    assert abs(_acc(xte, yte, fit.weight, fit.bias) - _acc(xte, yte, W_ref, b_ref)) <= 0.02
    assert kkt_residual(x, y, fit.weight, fit.bias, 0.0, l2) < 1e-5


def test_objective_is_ce_plus_mean_penalties():
    x, y = _noisy_problem(n=50, F=4)
    W, b = torch.randn(3, 4), torch.randn(3)
    ce = float(torch.nn.functional.cross_entropy(x @ W.T + b, y))
    assert objective(x, y, W, b, 0.7, 0.2) == pytest.approx(ce + 0.7 * float(W.abs().sum()) / 12
                                                            + 0.2 * float(W.pow(2).sum()) / 12, rel=1e-5)


def test_warm_started_path_matches_cold_fits():
    x, y = _noisy_problem()
    path = fit_path(x, y, 3, bias=False, l1=[0.3, 1.0, 3.0], tol=1e-7)
    for lam in (0.3, 1.0, 3.0):
        cold = fit_linear(x, y, 3, bias=False, l1=lam, tol=1e-7)
        warm = path[(lam, 0.0)]
        assert math.isclose(objective(x, y, warm.weight, None, lam), objective(x, y, cold.weight, None, lam),
                            rel_tol=1e-6)
        assert torch.allclose(warm.weight, cold.weight, atol=1e-3)


def test_negative_penalties_are_refused():
    x, y = _noisy_problem(n=20, F=3)
    with pytest.raises(ValueError, match="l1=-1"):
        fit_linear(x, y, 3, bias=False, l1=-1.0)
