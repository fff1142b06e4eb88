"""Fresh probes that measure what an intervention leaves in a representation.

- :func:`linear_probe` — multinomial logistic regression with bias on standardised inputs (L-BFGS,
  ``naming.solvers``), its L2 weight chosen on a validation part of the training rows; what LEACE and SPLINCE
  guarantee against.
- :func:`mlp_probe` — a one-hidden-layer ReLU network (full-batch Adam), the epoch chosen on the same
  validation part; a nonlinear probe can still read a concept that no linear one can (Obliviator, TanGCE).
- :func:`majority_rate` — accuracy of always answering the training rows' most frequent class (chance).

Shapes: x [N, F] float, y [N] int64 in 0..C-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from conceptdict.naming.bottleneck.baseline import accuracy
from conceptdict.naming.bottleneck.solvers import fit_path


@dataclass(frozen=True)
class ProbeConfig:
    """How the fresh probes are fitted."""

    l2: tuple[float, ...] = field(default=(0.01, 0.1, 1.0, 10.0), metadata={
        "help": ("Candidate L2 weights (on mean W^2) of the linear probe; the best on validation wins (the CBM "
                 "baseline probe's earlier grid, naming/bottleneck/cbm.py, without 0: an unpenalised probe on a few "
                 "hundred rows overfits).")})
    val_fraction: float = field(default=0.2, metadata={
        "help": "Share of the training rows held out to choose the L2 weight and the MLP's epoch."})
    mlp_hidden: int = field(default=64, metadata={"help": "Hidden units of the MLP probe."})
    mlp_epochs: int = field(default=300, metadata={
        "help": "Full-batch Adam epochs of the MLP probe (validation accuracy checked every 10)."})
    mlp_lr: float = field(default=1e-2, metadata={"help": "Adam learning rate of the MLP probe."})
    max_iter: int = field(default=2000, metadata={"help": "L-BFGS iteration cap of the linear probe."})
    tol: float = field(default=1e-4, metadata={
        "help": ("Stop the linear probe's solver below this KKT residual (the CBM's default, naming/bottleneck/cbm.py: same "
                 "accuracy as 1e-5 in half the iterations).")})
    seed: int = 0


class Probe(NamedTuple):
    accuracy: float
    """On the test rows."""
    val_accuracy: float
    choice: float
    """The chosen L2 weight (linear) or epoch (MLP)."""


def majority_rate(y_train: Tensor, y_test: Tensor) -> float:
    """Test accuracy of predicting the most frequent training class."""
    top = int(torch.bincount(y_train).argmax())
    return float((y_test == top).float().mean())


def _standardise(train: Tensor, *others: Tensor) -> list[Tensor]:
    mu, sd = train.mean(0), train.std(0).clamp_min(1e-6)
    return [(t - mu) / sd for t in (train, *others)]


def _val_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(fraction * n))
    return perm[n_val:], perm[:n_val]


def linear_probe(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, n_classes: int,
                 cfg: ProbeConfig = ProbeConfig()) -> Probe:
    """A linear probe fitted on the training rows; its accuracy on the test rows."""
    tr, te = _standardise(x_train.float(), x_test.float())
    fit_idx, val_idx = _val_split(len(tr), cfg.val_fraction, cfg.seed)
    fits = fit_path(tr[fit_idx], y_train[fit_idx], n_classes, bias=True, l2=cfg.l2, max_iter=cfg.max_iter,
                    tol=cfg.tol)
    best = max(cfg.l2, key=lambda c: (accuracy(tr[val_idx] @ fits[(0.0, c)].weight.T + fits[(0.0, c)].bias,
                                           y_train[val_idx]), c))
    fit = fit_path(tr, y_train, n_classes, bias=True, l2=[best], max_iter=cfg.max_iter, tol=cfg.tol)[(0.0, best)]
    val = accuracy(tr[val_idx] @ fits[(0.0, best)].weight.T + fits[(0.0, best)].bias, y_train[val_idx])
    return Probe(accuracy(te @ fit.weight.T + fit.bias, y_test), val, best)


def linear_classifier(x_train: Tensor, y_train: Tensor, n_classes: int, l2: float = 0.1,
                      max_iter: int = 2000):
    """A fitted linear probe as a function x [N, F] -> predicted classes [N] (standardised on x_train)."""
    x_train = x_train.float()
    mu, sd = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    fit = fit_path((x_train - mu) / sd, y_train, n_classes, bias=True, l2=[l2], max_iter=max_iter)[(0.0, l2)]
    return lambda x: (((x.float() - mu) / sd) @ fit.weight.T + fit.bias).argmax(1)


def mlp_probe(x_train: Tensor, y_train: Tensor, x_test: Tensor, y_test: Tensor, n_classes: int,
              cfg: ProbeConfig = ProbeConfig()) -> Probe:
    """A one-hidden-layer MLP probe; test accuracy at the epoch with the best validation accuracy."""
    tr, te = _standardise(x_train.float(), x_test.float())
    fit_idx, val_idx = _val_split(len(tr), cfg.val_fraction, cfg.seed)
    torch.manual_seed(cfg.seed)
    net = torch.nn.Sequential(torch.nn.Linear(tr.shape[1], cfg.mlp_hidden), torch.nn.ReLU(),
                              torch.nn.Linear(cfg.mlp_hidden, n_classes))
    opt = torch.optim.Adam(net.parameters(), lr=cfg.mlp_lr)
    best = (-1.0, 0, float("nan"))
    for epoch in range(1, cfg.mlp_epochs + 1):
        loss = torch.nn.functional.cross_entropy(net(tr[fit_idx]), y_train[fit_idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if epoch % 10 == 0 or epoch == cfg.mlp_epochs:
            with torch.no_grad():
                val = accuracy(net(tr[val_idx]), y_train[val_idx])
                if val > best[0]:
                    best = (val, epoch, accuracy(net(te), y_test))
    return Probe(best[2], best[0], float(best[1]))
