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
conditions (0 at the exact optimum).

Speed, without changing what a fit converges to (``bench/cbm_profile.py``; docs/results/cbm.md):

- :class:`Rows`: the inputs in float64, multiplied as CSR (x and x^T) where at most :data:`SPARSE_DENSITY` of them
  is nonzero (concept activations: ~3%), the same two products ~15x faster than dense; the first step's bound
  (x's largest singular value, a dense SVD) is computed once per inputs, not once per lambda.
- A working set (``fit_fista``'s default where the start uses under :data:`WORKING_SET_SHARE` of the features):
  FISTA on the features the start uses or whose zero weights violate the optimality conditions there; then the
  conditions are checked on *all* features (:func:`kkt_residual`'s terms), the violators added and FISTA resumed,
  until none is left. The inactive features' weights are exactly zero and meet their conditions within ``tol``,
  so the fit meets the full problem's KKT residual below ``tol``, as the plain solve does.

Shapes: N rows, F features, C classes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


SPARSE_DENSITY = 0.25
"""Inputs with at most this share of nonzero entries are multiplied as CSR on the CPU (:class:`Rows`)."""
WORKING_SET_SHARE = 0.5
"""FISTA solves on a working set when the start's active features are under this share of all (:func:`fit_fista`)."""


class Rows:
    """The inputs x [N, F] of a fit in float64, for the solvers' two products ``x @ W.T`` and ``g.T @ x``: as CSR
    (x and x^T) on the CPU where at most :data:`SPARSE_DENSITY` of x is nonzero, else dense."""

    def __init__(self, x: Tensor):
        self.dtype = x.dtype
        """The given inputs' dtype: the fits' weights are returned in it."""
        self.x = x.double()
        self.shape = self.x.shape
        self.device = self.x.device
        self._lipschitz: float | None = None
        sparse = self.x.device.type == "cpu" and self.x.numel() > 0 and (
            int(torch.count_nonzero(self.x)) <= SPARSE_DENSITY * self.x.numel())
        with warnings.catch_warnings():  # "sparse CSR support is in beta": the two products used here are tested
            warnings.simplefilter("ignore", UserWarning)
            self.csr = self.x.to_sparse_csr() if sparse else None
            self.csr_t = self.x.T.contiguous().to_sparse_csr() if sparse else None

    def logits(self, W: Tensor) -> Tensor:
        """x @ W.T, [N, C]."""
        return self.csr @ W.T if self.csr is not None else self.x @ W.T

    def grad(self, g: Tensor) -> Tensor:
        """g.T @ x for g [N, C], [C, F]."""
        return (self.csr_t @ g).T.contiguous() if self.csr_t is not None else g.T @ self.x

    def columns(self, keep: Tensor) -> Rows:
        """The inputs of the features ``keep`` ([F] bool)."""
        out = Rows(self.x[:, keep])
        out.dtype = self.dtype
        return out

    def lipschitz(self, bias: bool) -> float:
        """A bound on the CE's curvature: 0.5 * (lambda_max(x^T x / N) + 1 for the bias column)."""
        if self._lipschitz is None:
            self._lipschitz = float(torch.linalg.matrix_norm(self.x, ord=2)) ** 2 / self.shape[0] if self.x.numel() else 0.0
        return 0.5 * (self._lipschitz + (1.0 if bias else 0.0))


def as_rows(x: Tensor | Rows) -> Rows:
    return x if isinstance(x, Rows) else Rows(x)


class LinearFit(NamedTuple):
    weight: Tensor  # [C, F]
    bias: Tensor | None  # [C]
    iterations: int = 0
    """FISTA iterations, or L-BFGS function evaluations."""
    residual: float = float("nan")
    """The KKT residual at the returned weights (see :func:`kkt_residual`)."""


def _smooth(x: Rows, y: Tensor, W: Tensor, b: Tensor | None, l2: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """(CE + l2 * mean W^2, its gradient wrt W, wrt b) in closed form."""
    return _from_logits(x, y, x.logits(W), W, b, l2)


def _from_logits(x: Rows, y: Tensor, z: Tensor, W: Tensor, b: Tensor | None, l2: float,
                 grad: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """:func:`_smooth` at W given its logits z = x @ W.T (without the bias); without ``grad``, the loss alone."""
    logits = z if b is None else z + b
    logp = logits - torch.logsumexp(logits, dim=1, keepdim=True)  # log_softmax, ~3x faster over 10 classes on CPU
    n = x.shape[0]
    rows = torch.arange(n, device=x.device)
    loss = -logp[rows, y].mean() + l2 * W.pow(2).mean()
    if not grad:
        return loss, None, None
    g = logp.exp()
    g[rows, y] -= 1.0
    g /= n
    gW = x.grad(g) + (2 * l2 / W.numel()) * W
    return loss, gW, (g.sum(0) if b is not None else None)


def objective(x: Tensor | Rows, y: Tensor, W: Tensor, b: Tensor | None = None, l1: float = 0.0,
              l2: float = 0.0) -> float:  # fmt: skip
    """CE(x W^T + b, y) + l1 * mean|W| + l2 * mean(W^2)."""
    x = as_rows(x)
    return float(_smooth(x, y, W.to(x.x), None if b is None else b.to(x.x), l2)[0] + l1 * W.double().abs().mean())


def kkt_residual(x: Tensor | Rows, y: Tensor, W: Tensor, b: Tensor | None = None, l1: float = 0.0,
                 l2: float = 0.0) -> float:  # fmt: skip
    """Largest violation of the optimality conditions of the objective at (W, b): with g the smooth
    gradient and t = l1 / (C*F), |g + t sign(w)| where w != 0, max(|g| - t, 0) where w == 0, |g_b| for the bias."""
    x = as_rows(x)
    W, b = W.to(x.x), None if b is None else b.to(x.x)
    _, gW, gb = _smooth(x, y, W, b, l2)
    return _violations(W, gW, gb, l1 / W.numel())[0]


def _violations(W: Tensor, gW: Tensor, gb: Tensor | None, t: float) -> tuple[float, Tensor]:
    """(the KKT residual, [F] each feature's largest violation) from the smooth gradient (gW, gb) at (W, b) and the
    soft threshold t = l1 / (C*F)."""
    r = torch.where(W != 0, (gW + t * W.sign()).abs(), (gW.abs() - t).clamp_min(0))
    out = float(r.max()) if r.numel() else 0.0
    return (max(out, float(gb.abs().max())) if gb is not None else out), r.amax(0) if r.numel() else r.sum(0)


def fit_lbfgs(x: Tensor | Rows, y: Tensor, n_classes: int, *, bias: bool, l2: float = 0.0,
              init: LinearFit | None = None, max_iter: int = 500, tol: float = 1e-6) -> LinearFit:  # fmt: skip
    """Minimise CE + l2 * mean(W^2) by full-batch L-BFGS (stops when the largest gradient entry is below ``tol``,
    or after ``max_iter`` iterations: without L2 on separable data the optimum is at infinity)."""
    x = as_rows(x)
    W = (init.weight.clone() if init else x.x.new_zeros(n_classes, x.shape[1])).requires_grad_(True)
    b = (init.bias.clone() if init and init.bias is not None else x.x.new_zeros(n_classes)).requires_grad_(True)
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


def fit_fista(x: Tensor | Rows, y: Tensor, n_classes: int, *, l1: float, l2: float = 0.0, bias: bool = False,
              init: LinearFit | None = None, max_iter: int = 5000, tol: float = 1e-5,
              working_set: bool = True) -> LinearFit:  # fmt: skip
    """Minimise CE + l1 * mean|W| + l2 * mean(W^2) by FISTA with backtracking and adaptive restart; stops when
    :func:`kkt_residual` (checked every 10 iterations) is below ``tol`` or after ``max_iter`` iterations. With
    ``working_set``, where the start (``init``, else zero) has fewer than :data:`WORKING_SET_SHARE` of the features
    active or violating their conditions, FISTA runs on those, then on those plus every feature whose zero weight
    violates its condition by more than ``tol``, until none does (module docstring); ``iterations`` sums the rounds,
    and ``max_iter`` caps each."""
    x = as_rows(x)
    F = x.shape[1]
    W = init.weight.clone() if init else x.x.new_zeros(n_classes, F)
    b = (init.bias.clone() if init and init.bias is not None else x.x.new_zeros(n_classes)) if bias else None
    t = l1 / W.numel()
    if not working_set or F == 0:
        return _fista(x, y, W, b, t, l2 / W.numel(), max_iter, tol)
    _, gW, gb = _smooth(x, y, W, b, l2)
    residual, by_feature = _violations(W, gW, gb, t)
    active = (W != 0).any(0) | (by_feature > 0)
    if not active.any() and b is None:  # zero weights meet every condition: the start is the optimum
        return LinearFit(W, b, 0, residual)
    iterations = 0
    while True:
        if int(active.sum()) >= WORKING_SET_SHARE * F or not active.any():  # most features in play: the plain solve, on all of them
            fit = _fista(x, y, W, b, t, l2 / W.numel(), max_iter, tol)
            return fit._replace(iterations=iterations + fit.iterations)
        sub = _fista(x.columns(active), y, W[:, active], b, t, l2 / W.numel(), max_iter, tol)
        iterations += sub.iterations
        W = torch.zeros_like(W)
        W[:, active] = sub.weight
        b = sub.bias
        _, gW, gb = _smooth(x, y, W, b, l2)
        residual, by_feature = _violations(W, gW, gb, t)
        enter = ~active & (by_feature > tol)
        if not enter.any() or sub.residual >= tol:  # optimal on all features (or the round ran out of iterations)
            return LinearFit(W, b, iterations, residual)
        active |= enter


def _fista(x: Rows, y: Tensor, W: Tensor, b: Tensor | None, t: float, l2_each: float, max_iter: int,
           tol: float) -> LinearFit:  # fmt: skip
    """FISTA from (W, b) on the features of x, with soft threshold ``t`` and L2 ``l2_each`` per squared weight (the
    full problem's l1 / (C*F) and l2 / (C*F), so that a fit on some of the features solves the full objective
    restricted to them)."""
    l2 = l2_each * W.numel()  # _smooth's mean over W's entries
    step = 1.0 / (x.lipschitz(b is not None) + 2 * l2_each)  # a safe first step (CE Hessian bound)
    zW = x.logits(W)  # logits are linear in W: the extrapolated point's follow from its two ends'
    V, Vb, zV, mom = W, b, zW, 1.0
    f_prev = math.inf
    residual = float("nan")
    it = 0
    for it in range(1, max_iter + 1):
        f_v, gV, gVb = _from_logits(x, y, zV, V, Vb, l2)
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
            zW_new = x.logits(W_new)
            f_new = _from_logits(x, y, zW_new, W_new, b_new, l2, grad=False)[0]
            if f_new <= quad + 1e-12 * abs(float(quad)) or step < 1e-12:
                break
            step *= 0.5
        F_new = float(f_new) + t * float(W_new.abs().sum())
        restart = F_new > f_prev  # adaptive restart: drop the momentum when the objective goes up
        mom_new = 1.0 if restart else (1 + math.sqrt(1 + 4 * mom * mom)) / 2
        beta = 0.0 if restart else (mom - 1) / mom_new
        V = W_new + beta * (W_new - W)
        zV = zW_new + beta * (zW_new - zW)
        Vb = b_new + beta * (b_new - b) if b is not None else None
        W, zW, b, mom, f_prev = W_new, zW_new, b_new, mom_new, F_new
        if it % 10 == 0:
            residual = _violations(W, *_from_logits(x, y, zW, W, b, l2)[1:], t)[0]
            if residual < tol:
                break
    if it % 10:
        residual = _violations(W, *_from_logits(x, y, zW, W, b, l2)[1:], t)[0]
    return LinearFit(W, b, it, residual)


def fit_linear(x: Tensor | Rows, y: Tensor, n_classes: int, *, bias: bool, l1: float = 0.0, l2: float = 0.0,
               init: LinearFit | None = None, max_iter: int = 5000, tol: float = 1e-5,
               working_set: bool = True) -> LinearFit:  # fmt: skip
    """Minimise CE + l1 * mean|W| + l2 * mean(W^2): L-BFGS when ``l1 == 0``, FISTA otherwise (``working_set``: see
    :func:`fit_fista`). Solved in float64 (float32 rounding stalls the objective near 1e-7, above useful
    tolerances); returns x's dtype (a :class:`Rows`' given dtype)."""
    if l1 < 0 or l2 < 0:
        raise ValueError(f"l1={l1}, l2={l2}: penalties must be >= 0")
    x = as_rows(x)
    if init is not None:
        init = LinearFit(init.weight.double(), None if init.bias is None else init.bias.double())
    if l1 == 0:
        fit = fit_lbfgs(x, y, n_classes, bias=bias, l2=l2, init=init, max_iter=max_iter, tol=tol)
    else:
        fit = fit_fista(x, y, n_classes, l1=l1, l2=l2, bias=bias, init=init, max_iter=max_iter, tol=tol,
                        working_set=working_set)  # fmt: skip
    return fit._replace(weight=fit.weight.to(x.dtype), bias=None if fit.bias is None else fit.bias.to(x.dtype))


def fit_path(x: Tensor | Rows, y: Tensor, n_classes: int, *, bias: bool, l1: Sequence[float] = (0.0,),
             l2: Sequence[float] = (0.0,), max_iter: int = 5000, tol: float = 1e-5,
             working_set: bool = True) -> dict[tuple[float, float], LinearFit]:  # fmt: skip
    """Fits for every (l1, l2) pair, solved from the strongest penalty down, each warm-started from the last (the
    inputs converted to :class:`Rows` once)."""
    rows = as_rows(x)
    out: dict[tuple[float, float], LinearFit] = {}
    prev = None
    for a in sorted(set(l1), reverse=True):
        for c in sorted(set(l2), reverse=True):
            prev = fit_linear(rows, y, n_classes, bias=bias, l1=a, l2=c, init=prev, max_iter=max_iter, tol=tol,
                              working_set=working_set)  # fmt: skip
            out[(a, c)] = prev
    return out
