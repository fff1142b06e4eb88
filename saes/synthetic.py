"""A synthetic ground truth for dictionaries: planted unit atoms, sparse positive combinations, noise.

Each row is ``x = r * sum_i c_i a_i + offset + noise`` over a random sparse set of atoms a_i, a fixed random
offset (so b_dec matters) and Gaussian noise. A trained dictionary "recovers" an atom when some decoder
direction has cosine above a threshold with it. Used by the recovery tests and bench/synthetic_recovery.py.

The default spec is the easy problem (every atom equally frequent, independent random atoms, coefficients
c_i ~ U[0.5, 1.5], r = 1). The fields below the defaults make it look like real activations, which is where
training procedures differ (issue: BatchTopK lagged TopK only on such data):

- ``coef_sigma > 0``: c_i = exp(N(0, coef_sigma^2)) (log-normal, heavy-tailed coefficients);
- ``row_sigma > 0``: r = exp(N(0, row_sigma^2)) per row, so row norms vary by an order of magnitude;
- ``freq_exponent > 0``: atom i is active with probability proportional to (i + 1)^-freq_exponent (Zipf-like,
  rescaled so rows still hold ``active`` atoms on average; no probability exceeds ``max_prob``);
- ``correlated > 0``: that fraction of the atoms is built as a near neighbour of another atom (cosine
  ``correlation``), so decoder directions must separate similar atoms.
"""

from __future__ import annotations

import functools
import math
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
    coef_sigma: float = 0.0
    """0: coefficients U[0.5, 1.5]; > 0: log-normal exp(N(0, coef_sigma^2))."""
    row_sigma: float = 0.0
    """> 0: every row is multiplied by exp(N(0, row_sigma^2)) (heavy-tailed row norms)."""
    freq_exponent: float = 0.0
    """> 0: Zipf-like atom frequencies, p_i proportional to (i + 1)^-freq_exponent."""
    max_prob: float = 0.5
    """Cap on any atom's probability of being active in a row (with skewed frequencies)."""
    correlated: float = 0.0
    """Fraction of the atoms built as a near neighbour of another atom."""
    correlation: float = 0.7
    """Cosine between a correlated atom and the atom it was built from."""

    @property
    def plain(self) -> bool:
        """True for the easy problem (the original generator, whose batches every older test pins)."""
        return self.coef_sigma == 0 and self.row_sigma == 0 and self.freq_exponent == 0


def planted_atoms(spec: SyntheticSpec) -> Tensor:
    """The ground-truth atoms [n_atoms, D], unit norm."""
    g = torch.Generator().manual_seed(spec.seed)
    atoms = torch.randn(spec.n_atoms, spec.d, generator=g)
    atoms = atoms / atoms.norm(dim=1, keepdim=True)
    n_corr = int(round(spec.correlated * spec.n_atoms))
    if n_corr:
        # the last n_corr atoms become near neighbours of random earlier ones: cos = correlation exactly
        parents = torch.randint(0, spec.n_atoms - n_corr, (n_corr,), generator=g)
        base = atoms[parents]
        other = atoms[spec.n_atoms - n_corr:]
        other = other - (other * base).sum(dim=1, keepdim=True) * base
        other = other / other.norm(dim=1, keepdim=True)
        c = spec.correlation
        atoms[spec.n_atoms - n_corr:] = c * base + math.sqrt(1 - c * c) * other
    return atoms


@functools.lru_cache(maxsize=8)
def atom_probabilities(spec: SyntheticSpec) -> Tensor:
    """Probability [n_atoms] that each atom is active in a row; sums to ``active`` (up to the ``max_prob`` cap)."""
    if spec.freq_exponent == 0:
        return torch.full((spec.n_atoms,), spec.active / spec.n_atoms)
    w = torch.arange(1, spec.n_atoms + 1, dtype=torch.float64).pow(-spec.freq_exponent)
    p = torch.zeros_like(w)
    free = torch.ones_like(w, dtype=torch.bool)
    budget = float(spec.active)
    for _ in range(spec.n_atoms):  # water-filling: cap the largest, spread what they leave over the rest
        p[free] = budget * w[free] / w[free].sum()
        over = free & (p > spec.max_prob)
        if not over.any():
            break
        p[over] = spec.max_prob
        free &= ~over
        budget = spec.active - float(p[~free].sum())
    # a random order, so frequency is not tied to the atom index (and so to which atoms are correlated)
    perm = torch.randperm(spec.n_atoms, generator=torch.Generator().manual_seed(spec.seed + 20_000_003))
    return p[perm].float()


def _offset(spec: SyntheticSpec) -> Tensor:
    g = torch.Generator().manual_seed(spec.seed + 10_000_019)
    v = torch.randn(spec.d, generator=g)
    return spec.offset * v / v.norm()


def synthetic_batch(spec: SyntheticSpec, index: int, atoms: Tensor | None = None) -> Tensor:
    """Batch ``index`` [batch_size, D] (deterministic: the same index always gives the same rows)."""
    atoms = planted_atoms(spec) if atoms is None else atoms
    g = torch.Generator().manual_seed(spec.seed + 1 + index)
    B, A = spec.batch_size, spec.n_atoms
    if spec.plain:
        mask = torch.rand(B, A, generator=g) < spec.active / A
        coef = torch.rand(B, A, generator=g) + 0.5
        x = (coef * mask) @ atoms + _offset(spec)
        return x + spec.noise * torch.randn(B, spec.d, generator=g)
    mask = torch.rand(B, A, generator=g) < atom_probabilities(spec)
    if spec.coef_sigma > 0:
        coef = torch.exp(spec.coef_sigma * torch.randn(B, A, generator=g))
    else:
        coef = torch.rand(B, A, generator=g) + 0.5
    rows = torch.exp(spec.row_sigma * torch.randn(B, 1, generator=g)) if spec.row_sigma > 0 else 1.0
    x = rows * ((coef * mask) @ atoms) + _offset(spec)
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
