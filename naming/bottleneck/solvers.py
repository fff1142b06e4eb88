"""Full-batch solvers for the small convex fits of stage 3: multinomial logistic regression, penalised.

Objective, for inputs x [N, F], labels y [N] in 0..C-1, weights W [C, F] and an optional bias b [C]::

    CE(x W^T + b, y) + l1 * mean|W| + l2 * mean(W^2)

(means over all C*F weights; the bias is never penalised). It is convex, and on a few thousand rows the
gradient is a pair of [N, F] x [F, C] matmuls, so full-batch methods converge in seconds:

- ``l1 == 0``: L-BFGS (strong Wolfe line search) on the smooth objective (the raw-activation probe).
- ``l1 > 0``: FISTA (Beck & Teboulle 2009) with backtracking that may also grow the step, and adaptive
  restart (O'Donoghue & Candes 2015); the proximal step is the soft threshold at ``step * l1 / (C*F)``, so
  weights are exactly zero, not merely small. A path of penalties is solved from the largest down, each
  fit warm-started from the previous one (:func:`fit_path`).

:func:`kkt_residual` measures how far a fit is from optimal: the largest violation of the subgradient
conditions (0 at the exact optimum). Shapes: N rows, F features, C classes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch import Tensor


class LinearFit(NamedTuple):
    weight: Tensor  # [C, F]
    bias: Tensor | None  # [C]
    iterations: int = 0
    """FISTA iterations, or L-BFGS function evaluations."""
    residual: float = float("nan")
    """The KKT residual at the returned weights (see :func:`kkt_residual`)."""


def _smooth(x: Tensor, y: Tensor, W: Tensor, b: Tensor | None, l2: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """(CE + l2 * mean W^2, its gradient wrt W, wrt b) in closed form."""
    logits = x @ W.T
    if b is not None:
        logits = logits + b
    logp = torch.log_softmax(logits, dim=1)
    n = x.shape[0]
    loss = -logp[torch.arange(n, device=x.device), y].mean() + l2 * W.pow(2).mean()
    g = logp.exp()
    g[torch.arange(n, device=x.device), y] -= 1.0
    g /= n
    gW = g.T @ x + (2 * l2 / W.numel()) * W
    return loss, gW, (g.sum(0) if b is not None else None)


def objective(x: Tensor, y: Tensor, W: Tensor, b: Tensor | None = None, l1: float = 0.0, l2: float = 0.0) -> float:
    """CE(x W^T + b, y) + l1 * mean|W| + l2 * mean(W^2)."""
    return float(_smooth(x, y, W, b, l2)[0] + l1 * W.abs().mean())


def kkt_residual(x: Tensor, y: Tensor, W: Tensor, b: Tensor | None = None, l1: float = 0.0, l2: float = 0.0) -> float:
    """Largest violation of the optimality conditions of the objective at (W, b): with g the smooth
    gradient and t = l1 / (C*F), |g + t sign(w)| where w != 0, max(|g| - t, 0) where w == 0, |g_b| for the bias."""
    _, gW, gb = _smooth(x, y, W, b, l2)
    t = l1 / W.numel()
    r = torch.where(W != 0, (gW + t * W.sign()).abs(), (gW.abs() - t).clamp_min(0))
    out = float(r.max()) if r.numel() else 0.0
    return max(out, float(gb.abs().max())) if gb is not None else out


def fit_lbfgs(x: Tensor, y: Tensor, n_classes: int, *, bias: bool, l2: float = 0.0, init: LinearFit | None = None,
              max_iter: int = 500, tol: float = 1e-6) -> LinearFit:  # fmt: skip
    """Minimise CE + l2 * mean(W^2) by full-batch L-BFGS (stops when the largest gradient entry is below ``tol``,
    or after ``max_iter`` iterations: without L2 on separable data the optimum is at infinity)."""
    W = (init.weight.clone() if init else x.new_zeros(n_classes, x.shape[1])).requires_grad_(True)
    b = (init.bias.clone() if init and init.bias is not None else x.new_zeros(n_classes)).requires_grad_(True)
    params = [W, b] if bias else [W]
    opt = torch.optim.LBFGS(params, lr=1, max_iter=max_iter, tolerance_grad=tol, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")  # fmt: skip

    evals = [0]

    def closure():
        evals[0] += 1
        loss, gW, gb = _smooth(x, y, W.detach(), b.detach() if bias else None, l2)
        W.grad = gW
        if bias:
            b.grad = gb
        return loss

    opt.step(closure)
    Wd, bd = W.detach(), (b.detach() if bias else None)
    return LinearFit(Wd, bd, evals[0], kkt_residual(x, y, Wd, bd, 0.0, l2))


def fit_fista(x: Tensor, y: Tensor, n_classes: int, *, l1: float, l2: float = 0.0, bias: bool = False,
              init: LinearFit | None = None, max_iter: int = 5000, tol: float = 1e-5) -> LinearFit:  # fmt: skip
    """Minimise CE + l1 * mean|W| + l2 * mean(W^2) by FISTA with backtracking and adaptive restart; stops when
    :func:`kkt_residual` (checked every 10 iterations) is below ``tol`` or after ``max_iter`` iterations."""
    W = init.weight.clone() if init else x.new_zeros(n_classes, x.shape[1])
    b = (init.bias.clone() if init and init.bias is not None else x.new_zeros(n_classes)) if bias else None
    t = l1 / W.numel()
    # a safe first step: the CE Hessian is at most 0.5 * lambda_max(x^T x / N) (+1 for the bias column)
    lip = 0.5 * (float(torch.linalg.matrix_norm(x, ord=2)) ** 2 / x.shape[0] + (1.0 if bias else 0.0))
    step = 1.0 / (lip + 2 * l2 / W.numel())
    V, Vb, mom = W, b, 1.0
    f_prev = math.inf
    residual = float("nan")
    it = 0
    for it in range(1, max_iter + 1):
        f_v, gV, gVb = _smooth(x, y, V, Vb, l2)
        step *= 1.5
        while True:
            W_new = V - step * gV
            W_new = W_new.sign() * (W_new.abs() - step * t).clamp_min(0)
            b_new = Vb - step * gVb if b is not None else None
            d = W_new - V
            quad = f_v + (gV * d).sum() + d.pow(2).sum() / (2 * step)
            if b_new is not None:
                db = b_new - Vb
                quad = quad + (gVb * db).sum() + db.pow(2).sum() / (2 * step)
            f_new = _smooth(x, y, W_new, b_new, l2)[0]
            if f_new <= quad + 1e-12 * abs(float(quad)) or step < 1e-12:
                break
            step *= 0.5
        F_new = float(f_new) + t * float(W_new.abs().sum())
        restart = F_new > f_prev  # adaptive restart: drop the momentum when the objective goes up
        mom_new = 1.0 if restart else (1 + math.sqrt(1 + 4 * mom * mom)) / 2
        beta = 0.0 if restart else (mom - 1) / mom_new
        V = W_new + beta * (W_new - W)
        Vb = b_new + beta * (b_new - b) if b is not None else None
        W, b, mom, f_prev = W_new, b_new, mom_new, F_new
        if it % 10 == 0:
            residual = kkt_residual(x, y, W, b, l1, l2)
            if residual < tol:
                break
    if it % 10:
        residual = kkt_residual(x, y, W, b, l1, l2)
    return LinearFit(W, b, it, residual)


def fit_linear(x: Tensor, y: Tensor, n_classes: int, *, bias: bool, l1: float = 0.0, l2: float = 0.0,
               init: LinearFit | None = None, max_iter: int = 5000, tol: float = 1e-5) -> LinearFit:  # fmt: skip
    """Minimise CE + l1 * mean|W| + l2 * mean(W^2): L-BFGS when ``l1 == 0``, FISTA otherwise. Solved in
    float64 (float32 rounding stalls the objective near 1e-7, above useful tolerances); returns x's dtype."""
    if l1 < 0 or l2 < 0:
        raise ValueError(f"l1={l1}, l2={l2}: penalties must be >= 0")
    x64, dtype = x.double(), x.dtype
    if init is not None:
        init = LinearFit(init.weight.double(), None if init.bias is None else init.bias.double())
    if l1 == 0:
        fit = fit_lbfgs(x64, y, n_classes, bias=bias, l2=l2, init=init, max_iter=max_iter, tol=tol)
    else:
        fit = fit_fista(x64, y, n_classes, l1=l1, l2=l2, bias=bias, init=init, max_iter=max_iter, tol=tol)
    return fit._replace(weight=fit.weight.to(dtype), bias=None if fit.bias is None else fit.bias.to(dtype))


def fit_path(x: Tensor, y: Tensor, n_classes: int, *, bias: bool, l1: Sequence[float] = (0.0,),
             l2: Sequence[float] = (0.0,), max_iter: int = 5000, tol: float = 1e-5) -> dict[tuple[float, float], LinearFit]:  # fmt: skip
    """Fits for every (l1, l2) pair, solved from the strongest penalty down, each warm-started from the last."""
    out: dict[tuple[float, float], LinearFit] = {}
    prev = None
    for a in sorted(set(l1), reverse=True):
        for c in sorted(set(l2), reverse=True):
            prev = fit_linear(x, y, n_classes, bias=bias, l1=a, l2=c, init=prev, max_iter=max_iter, tol=tol)
            out[(a, c)] = prev
    return out
