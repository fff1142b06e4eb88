"""Planted concepts of heterogeneous geometry (Hindupur, Lubana, Fel, Ba 2025, "Projecting Assumptions", arXiv
2503.01822): which concepts does a dictionary see? Used by bench/concept_geometry.py and its tests.

Concepts (in D dimensions, mutually orthogonal: every basis vector and centre is a row of one random orthogonal
matrix drawn from ``seed + ATOM_SEED_OFFSET``, so a dictionary initialised from the same seed does not start at
them):

- ray (1-d): ``c u``, a unit direction u, c ~ LogNormal(0, 0.3) (a planted atom);
- subspace (2-d or 3-d, alternately): ``U a``, an orthonormal basis U [d, D], a ~ N(0, I_d) (every direction of
  the subspace, either sign);
- core: ``m + core_width r V g``, a centre m of norm r = ``radius``, V an orthonormal 2-d basis orthogonal to m,
  g ~ N(0, I_2): a small disk around m;
- shell: ``m + r V e``, e a uniform unit vector of the plane: the ring of radius r around the SAME centre as its
  core. Core and shell lie on the same hyperplane x.m = r^2 and the core is inside the shell's convex hull, so no
  half-space holds the core without an arc of the shell: they are separable only by a curved boundary.

Every row is the sum of ``per_row`` distinct concepts' samples (1: the paper's toy setting, one concept per row)
plus Gaussian noise.

Scoring (:func:`score_concepts`), on held-out rows, per concept j: its *concept latents* are the latents that fire
on at least 1% of j's rows with precision >= 0.9 (90% of their firings on rows holding j) and, for rays and
subspaces, whose decoder direction lies in j's span (its projection there is >= 0.9 of its norm). F1 is that of
"some concept latent fires" against "the row holds j". A ray or a region (core, shell) is recovered when F1 >=
0.8; a d-dimensional subspace also needs its concept latents' decoders to span it (d singular values of their
projected unit directions >= 0.3): a single direction cannot stand for a 3-d concept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from generators.synthetic import ATOM_SEED_OFFSET

TYPES = ("ray", "subspace", "core", "shell")
MIN_F1 = 0.8
MIN_PRECISION = 0.9
MIN_INSIDE = 0.9


@dataclass(frozen=True)
class GeometrySpec:
    """A planted concept-geometry data set."""

    d: int = 64
    """Input width D."""
    rays: int = 16
    """1-d concepts."""
    subspaces: int = 6
    """Subspace concepts, alternately 2-d and 3-d."""
    regions: int = 8
    """Core/shell pairs (two concepts each)."""
    per_row: int = 1
    """Concepts summed in every row (1: the paper's toy setting)."""
    noise: float = 0.02
    """Standard deviation of the Gaussian noise per coordinate."""
    radius: float = 1.5
    """Norm of a region's centre and radius of its shell."""
    core_width: float = 0.25
    """Standard deviation of a core around its centre, relative to ``radius``."""
    seed: int = 0
    """Concepts from seed + ATOM_SEED_OFFSET; batch i from seed + 1 + i."""

    def __post_init__(self) -> None:
        need = self.rays + sum(2 + i % 2 for i in range(self.subspaces)) + 3 * self.regions
        if need > self.d:
            raise ValueError(f"{need} orthogonal directions (rays + subspace dims + 3 per region) do not fit in "
                             f"d={self.d}; lower the counts or raise d")
        n = self.rays + self.subspaces + 2 * self.regions
        if not 1 <= self.per_row <= n:
            raise ValueError(f"per_row={self.per_row} must lie in [1, {n}] (the number of concepts)")


class Concepts(NamedTuple):
    types: list[str]
    """One of TYPES per concept."""
    bases: list[Tensor]
    """ray: [1, D] direction; subspace: [d, D] orthonormal; core / shell: [2, D] the plane."""
    centres: list[Tensor | None]
    """core / shell: [D] centre, else None."""


def plant(spec: GeometrySpec) -> Concepts:
    """The concepts of ``spec`` (from ``spec.seed + ATOM_SEED_OFFSET``)."""
    gen = torch.Generator().manual_seed(spec.seed + ATOM_SEED_OFFSET)
    Q = torch.linalg.qr(torch.randn(spec.d, spec.d, generator=gen))[0].T  # rows orthonormal
    types, bases, centres, at = [], [], [], 0
    for d in [1] * spec.rays + [2 + i % 2 for i in range(spec.subspaces)]:
        types.append("ray" if d == 1 else "subspace")
        bases.append(Q[at : at + d])
        centres.append(None)
        at += d
    for _ in range(spec.regions):
        for t in ("core", "shell"):
            types.append(t)
            bases.append(Q[at + 1 : at + 3])
            centres.append(spec.radius * Q[at])
        at += 3
    return Concepts(types, bases, centres)


def sample(spec: GeometrySpec, c: Concepts, j: int, n: int, gen: torch.Generator) -> Tensor:
    """n samples [n, D] of concept j."""
    t, B = c.types[j], c.bases[j]
    if t == "ray":
        return torch.exp(0.3 * torch.randn(n, 1, generator=gen)) * B
    if t == "subspace":
        return torch.randn(n, B.shape[0], generator=gen) @ B
    if t == "core":
        return c.centres[j] + spec.core_width * spec.radius * torch.randn(n, 2, generator=gen) @ B
    e = torch.nn.functional.normalize(torch.randn(n, 2, generator=gen), dim=1)
    return c.centres[j] + spec.radius * e @ B


def concept_batch(spec: GeometrySpec, c: Concepts, index: int, rows: int) -> tuple[Tensor, Tensor]:
    """Batch ``index``: rows [rows, D] and which concepts each holds (bool [rows, C]); deterministic."""
    gen = torch.Generator().manual_seed(spec.seed + 1 + index)
    C = len(c.types)
    pick = torch.rand(rows, C, generator=gen).argsort(dim=1)[:, : spec.per_row]
    held = torch.zeros(rows, C, dtype=torch.bool).scatter_(1, pick, True)
    x = spec.noise * torch.randn(rows, spec.d, generator=gen)
    for j in range(C):
        r = held[:, j].nonzero().flatten()
        if r.numel():
            x[r] += sample(spec, c, j, r.numel(), gen)
    return x, held


class ConceptScore(NamedTuple):
    recovered: bool
    f1: float
    """F1 of "some concept latent fires" against "the row holds the concept"."""
    n_latents: int
    """Concept latents (module docstring)."""
    dims: int
    """Directions the concept latents' decoders span inside the concept (rays, subspaces; else 0)."""


def score_concepts(c: Concepts, directions: Tensor, codes: Tensor, held: Tensor) -> list[ConceptScore]:
    """Per concept, the module docstring's criterion. directions [L, D] (decoder rows, any norms); codes [N, L]
    on held-out rows; held bool [N, C]."""
    d = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    fires = codes > 0
    n_fire = fires.sum(dim=0)
    out = []
    for j, t in enumerate(c.types):
        h = held[:, j]
        tp = (fires & h[:, None]).sum(dim=0)
        member = (tp >= max(1.0, 0.01 * float(h.sum()))) & (tp >= MIN_PRECISION * n_fire)
        dims = 0
        if t in ("ray", "subspace"):
            proj = d @ c.bases[j].T  # [L, dim] coordinates inside the concept's span
            member &= proj.norm(dim=1) >= MIN_INSIDE
            if member.any():
                inside = torch.nn.functional.normalize(proj[member], dim=1)
                dims = int((torch.linalg.svdvals(inside) >= 0.3).sum())
        union = fires[:, member].any(dim=1)
        f1 = float(2 * (union & h).sum() / (union.sum() + h.sum()).clamp_min(1))
        ok = f1 >= MIN_F1 and (t != "subspace" or dims >= c.bases[j].shape[0])
        out.append(ConceptScore(ok, f1, int(member.sum()), dims))
    return out


def active_per_type(c: Concepts, codes: Tensor, held: Tensor) -> dict[str, float]:
    """Mean number of active latents on the rows that hold exactly one concept, by that concept's type: whether
    a kind's L0 adapts to the concept's dimensionality (the paper's heterogeneity). NaN for a type no such row has."""
    l0 = (codes > 0).sum(dim=1).float()
    one = held.sum(dim=1) == 1
    kind = torch.tensor([TYPES.index(t) for t in c.types])[held.float().argmax(dim=1)]
    return {t: float(l0[one & (kind == i)].mean()) if bool((one & (kind == i)).any()) else float("nan")
            for i, t in enumerate(TYPES)}
