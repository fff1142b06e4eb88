"""A synthetic ground truth for dictionaries: planted unit atoms, sparse positive combinations, noise.

Each row is ``x = sum_i c_i a_i + offset + noise`` over a random sparse set of atoms a_i (each atom active
independently with probability ``active / n_atoms``), coefficients c_i ~ U[0.5, 1.5], a fixed random offset
(so b_dec matters) and Gaussian noise. A trained dictionary "recovers" an atom when some decoder direction
has cosine above a threshold with it. Used by the recovery tests and bench/synthetic_recovery.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class SyntheticSpec:
    """A planted-dictionary data set."""

    n_atoms: int = 4096
    """Number of planted unit atoms."""
    d: int = 256
    """Input width D."""
    active: float = 8.0
    """Mean number of atoms active per row."""
    noise: float = 0.02
    """Standard deviation of the Gaussian noise per coordinate."""
    offset: float = 1.0
    """Norm of the constant offset added to every row."""
    batch_size: int = 1024
    """Rows per batch."""
    n_batches: int = 200
    """Batches in one pass."""
    seed: int = 0
    """Seed of the atoms and of every batch (batch i uses seed + 1 + i)."""


def planted_atoms(spec: SyntheticSpec) -> Tensor:
    """The ground-truth atoms [n_atoms, D], unit norm."""
    g = torch.Generator().manual_seed(spec.seed)
    atoms = torch.randn(spec.n_atoms, spec.d, generator=g)
    return atoms / atoms.norm(dim=1, keepdim=True)


def _offset(spec: SyntheticSpec) -> Tensor:
    g = torch.Generator().manual_seed(spec.seed + 10_000_019)
    v = torch.randn(spec.d, generator=g)
    return spec.offset * v / v.norm()


def synthetic_batch(spec: SyntheticSpec, index: int, atoms: Tensor | None = None) -> Tensor:
    """Batch ``index`` [batch_size, D] (deterministic: the same index always gives the same rows)."""
    atoms = planted_atoms(spec) if atoms is None else atoms
    g = torch.Generator().manual_seed(spec.seed + 1 + index)
    B, A = spec.batch_size, spec.n_atoms
    mask = torch.rand(B, A, generator=g) < spec.active / A
    coef = torch.rand(B, A, generator=g) + 0.5
    x = (coef * mask) @ atoms + _offset(spec)
    return x + spec.noise * torch.randn(B, spec.d, generator=g)


def synthetic_batches(spec: SyntheticSpec, start: int = 0) -> Iterator[Tensor]:
    """Batches ``start`` .. n_batches - 1 (pass ``functools.partial(synthetic_batches, spec)`` to train())."""
    atoms = planted_atoms(spec)
    for i in range(start, spec.n_batches):
        yield synthetic_batch(spec, i, atoms)


class Recovery(NamedTuple):
    fraction: float  # share of atoms with best cosine above the threshold
    mean_best_cos: float  # mean over atoms of the best cosine with any decoder direction
    best_cos: Tensor  # [n_atoms]


def atom_recovery(directions: Tensor, atoms: Tensor, threshold: float = 0.9) -> Recovery:
    """directions [L, D] (any norms), atoms [A, D] unit -> how many atoms some direction matches (cos > threshold)."""
    d = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    best = torch.full((atoms.shape[0],), -1.0)
    for chunk in range(0, d.shape[0], 4096):
        best = torch.maximum(best, (atoms @ d[chunk:chunk + 4096].T).max(dim=1).values)
    return Recovery(float((best > threshold).float().mean()), float(best.mean()), best)
