"""A synthetic ground truth for dictionaries: planted unit atoms, sparse positive combinations, noise.

Each row is ``x = sum_i c_i a_i + offset + noise`` over a random sparse set of atoms a_i (each atom active
independently with probability ``active / n_atoms``), coefficients c_i ~ U[0.5, 1.5], a fixed random offset
(so b_dec matters) and Gaussian noise. A trained dictionary "recovers" an atom when some decoder direction
has cosine above a threshold with it. Used by the recovery tests and bench/synthetic_recovery.py.

For model diffing, :func:`planted_pair` plants atoms in two "models" (shared, only in B, only in A, scaled,
rotated) and :func:`score_b_only` scores a diffing table against them (tests/test_crosscoder_recovery.py,
bench/crosscoder_diff.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from conceptdict.saes.diffing import LatentDiff


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
    children: int = 0
    """> 0: the atoms form families of one parent and ``children`` children (``n_atoms`` a multiple of
    children + 1; the first n_atoms / (children + 1) atoms are the parents, parent i's children follow them at
    n_parents + i * children + j). A child is only ever active with its parent: in a row where a parent is
    active, one of its children, drawn uniformly, is active too with probability ``child_prob`` (the setting of
    feature absorption, Chanin et al. 2024: "short" implies "starts with s", and a dictionary that folds the
    parent into the child's latent saves a latent per row). ``active`` and the frequencies apply to the parents'
    families: a row holds ``active`` atoms on average, parents and children counted."""
    child_prob: float = 0.5
    """With ``children``: probability that an active parent's row also holds one of its children."""

    def __post_init__(self) -> None:
        if self.children < 0 or (self.children and self.n_atoms % (self.children + 1)):
            raise ValueError(f"children={self.children} must be >= 0 and children + 1 must divide "
                             f"n_atoms={self.n_atoms}")
        if not 0 <= self.child_prob <= 1:
            raise ValueError(f"child_prob={self.child_prob} must lie in [0, 1]")

    @property
    def n_parents(self) -> int:
        """Atoms that are parents (every atom without ``children``)."""
        return self.n_atoms // (self.children + 1)

    @property
    def plain(self) -> bool:
        """True for the easy problem (the original generator, whose batches every older test pins)."""
        return self.coef_sigma == 0 and self.row_sigma == 0 and self.freq_exponent == 0 and self.children == 0


ATOM_SEED_OFFSET = 1_000_003
"""Atoms are drawn from seed + ATOM_SEED_OFFSET, never from the seed itself: a dictionary initialises its decoder
with ``randn(L, D)`` from ``TrainConfig.seed``, so atoms drawn as ``randn(n_atoms, D)`` from the same seed ARE
its first decoder rows, and every planted benchmark run with equal seeds starts at the answer."""


def planted_atoms(spec: SyntheticSpec) -> Tensor:
    """The ground-truth atoms [n_atoms, D], unit norm (from ``spec.seed + ATOM_SEED_OFFSET``)."""
    g = torch.Generator().manual_seed(spec.seed + ATOM_SEED_OFFSET)
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
    """Probability [n_atoms] that each atom is active in a row; sums to ``active`` (up to the ``max_prob`` cap).
    With ``children``: [n_parents], the parents' probabilities (their families hold ``active`` atoms per row)."""
    if spec.children:
        return atom_probabilities(replace(spec, n_atoms=spec.n_parents, children=0,
                                          active=spec.active / (1 + spec.child_prob)))
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


def _family_mask(spec: SyntheticSpec, g: torch.Generator) -> Tensor:
    """bool [B, n_atoms] of the active atoms with ``children``: parents, then each active parent's one child
    (with probability ``child_prob``)."""
    B, P, C = spec.batch_size, spec.n_parents, spec.children
    parents = torch.rand(B, P, generator=g) < atom_probabilities(spec)
    with_child = parents & (torch.rand(B, P, generator=g) < spec.child_prob)
    which = torch.randint(0, C, (B, P, 1), generator=g)
    kids = torch.zeros(B, P, C, dtype=torch.bool).scatter_(2, which, with_child.unsqueeze(2))
    return torch.cat([parents, kids.reshape(B, P * C)], dim=1)


def synthetic_batch(spec: SyntheticSpec, index: int, atoms: Tensor | None = None) -> Tensor:
    """Batch ``index`` [batch_size, D] (deterministic: the same index always gives the same rows)."""
    return synthetic_batch_and_atoms(spec, index, atoms)[0]


def synthetic_batch_and_atoms(spec: SyntheticSpec, index: int, atoms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Batch ``index`` [batch_size, D] and which atoms each of its rows holds (bool [batch_size, n_atoms])."""
    atoms = planted_atoms(spec) if atoms is None else atoms
    g = torch.Generator().manual_seed(spec.seed + 1 + index)
    B, A = spec.batch_size, spec.n_atoms
    if spec.plain:
        mask = torch.rand(B, A, generator=g) < spec.active / A
        coef = torch.rand(B, A, generator=g) + 0.5
        x = (coef * mask) @ atoms + _offset(spec)
        return x + spec.noise * torch.randn(B, spec.d, generator=g), mask
    mask = _family_mask(spec, g) if spec.children else torch.rand(B, A, generator=g) < atom_probabilities(spec)
    if spec.coef_sigma > 0:
        coef = torch.exp(spec.coef_sigma * torch.randn(B, A, generator=g))
    else:
        coef = torch.rand(B, A, generator=g) + 0.5
    rows = torch.exp(spec.row_sigma * torch.randn(B, 1, generator=g)) if spec.row_sigma > 0 else 1.0
    x = rows * ((coef * mask) @ atoms) + _offset(spec)
    return x + spec.noise * torch.randn(B, spec.d, generator=g), mask


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


@torch.no_grad()
def alive_recovery(model, spec: SyntheticSpec, eval_batches: int = 1, threshold: float = 0.9) -> Recovery:
    """Atom recovery by the latents of ``model`` (a SparseCoder) that fire on the first ``eval_batches`` batches of
    ``spec`` (the held-out ones of a run with that many ``eval_batches``): a dead latent's direction does not count."""
    alive = sum((model.encode(x) > 0).any(dim=0).int() for x in itertools.islice(synthetic_batches(spec), eval_batches))
    return atom_recovery(model.decoder_directions()[alive > 0], planted_atoms(spec), threshold)


class Absorption(NamedTuple):
    absorbed: float  # mean over parents: share of their rows WITH a child where the parent's latent is silent
    missed: float  # the same on their rows without a child
    parent_recovery: float  # share of the parents some decoder direction matches (cos > 0.9)
    child_recovery: float  # the same for the children


def absorption(spec: SyntheticSpec, directions: Tensor, fired: Tensor, mask: Tensor,
               threshold: float = 0.9) -> Absorption:
    """Feature absorption on a hierarchical planted set (``spec.children`` > 0): each parent's latent is the
    decoder direction closest to it (``directions`` [L, D]); on rows ``fired`` (bool [N, L], which latents fire)
    with atoms ``mask`` (bool [N, n_atoms], :func:`synthetic_batch_and_atoms`), ``absorbed`` is the share of the
    parent's rows that also hold one of its children where its latent does not fire: the child's latent has taken
    the parent's direction in (Chanin et al. 2024), and Matryoshka's nested losses are meant to prevent it.
    ``missed`` is the same share on the parent's rows without a child, the baseline a silent latent has anyway.
    Means over the parents with at least 10 rows of each kind."""
    if not spec.children:
        raise ValueError("absorption needs a hierarchical planted set: SyntheticSpec(children=...) > 0")
    atoms = planted_atoms(spec)
    d = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cos = atoms @ d.T
    P, C = spec.n_parents, spec.children
    latent = cos[:P].argmax(dim=1)
    parent = mask[:, :P]
    child = mask[:, P:].reshape(-1, P, C).any(dim=2)
    silent = ~fired[:, latent]  # [N, P]
    with_child, alone = parent & child, parent & ~child
    keep = (with_child.sum(0) >= 10) & (alone.sum(0) >= 10)
    if not keep.any():
        raise ValueError(f"too few rows ({mask.shape[0]}) to measure absorption: no parent has 10 rows with a child "
                         "and 10 without; evaluate on more rows")
    rate = lambda rows: ((silent & rows).sum(0) / rows.sum(0).clamp_min(1))[keep].mean()
    best = cos.max(dim=1).values > threshold
    return Absorption(float(rate(with_child)), float(rate(alone)), float(best[:P].float().mean()),
                      float(best[P:].float().mean()))


# --------------------------------------------------------------------------- planted two-model data


ATOM_KINDS = ("shared", "b_only", "scaled", "rotated", "a_only")


class PlantedPair(NamedTuple):
    """Ground truth of a synthetic two-"model" pair: atom n appears as atoms_a[n] in model A and atoms_b[n]
    in model B (both [N, D]; a zero row means the model lacks it). ``kinds[n]`` is one of ATOM_KINDS."""

    atoms_a: Tensor
    atoms_b: Tensor
    kinds: list[str]


def planted_pair(d_in: int, n_shared: int, n_b_only: int, n_scaled: int, n_rotated: int, *, n_a_only: int = 0,
                 scale: float = 0.4, angle_deg: float = 60.0, seed: int = 0) -> PlantedPair:
    """Random unit atoms in R^D shared by both models, with ``n_b_only`` atoms only in B (zero in A),
    ``n_scaled`` in both but scaled by ``scale`` in A, ``n_rotated`` in both with A's direction rotated by
    ``angle_deg`` inside a random plane, and ``n_a_only`` only in A. Drawn from ``seed + ATOM_SEED_OFFSET``, so a
    crosscoder initialised from the same seed does not start at the atoms."""
    if not 0.0 < scale < 1.0:
        raise ValueError(f"scale={scale} must lie in (0, 1): the scaled atoms are scaled DOWN in model A")
    gen = torch.Generator().manual_seed(seed + ATOM_SEED_OFFSET)
    counts = {"shared": n_shared, "b_only": n_b_only, "scaled": n_scaled, "rotated": n_rotated, "a_only": n_a_only}
    kinds = [kind for kind in ATOM_KINDS for _ in range(counts[kind])]
    n = len(kinds)
    if n == 0:
        raise ValueError("planted_pair needs at least one atom")
    atoms_b = torch.randn(n, d_in, generator=gen)
    atoms_b = atoms_b / atoms_b.norm(dim=-1, keepdim=True)
    atoms_a = atoms_b.clone()
    other = torch.randn(n, d_in, generator=gen)
    other = other - (other * atoms_b).sum(-1, keepdim=True) * atoms_b  # orthogonal to each atom
    other = other / other.norm(dim=-1, keepdim=True)
    theta = math.radians(angle_deg)
    for i, kind in enumerate(kinds):
        if kind == "b_only":
            atoms_a[i] = 0.0
        elif kind == "scaled":
            atoms_a[i] = scale * atoms_b[i]
        elif kind == "rotated":
            atoms_a[i] = math.cos(theta) * atoms_b[i] + math.sin(theta) * other[i]
        elif kind == "a_only":
            atoms_b[i] = 0.0
    return PlantedPair(atoms_a, atoms_b, kinds)


def planted_codes(n_rows: int, n_atoms: int, p_fire: float, gen: torch.Generator, coef_sigma: float = 0.0) -> Tensor:
    """Sparse non-negative codes [n_rows, N]: each atom fires independently with probability ``p_fire``
    with magnitude uniform in [0.5, 1.5], or log-normal exp(N(0, coef_sigma^2)) when ``coef_sigma > 0``
    (heavy-tailed, so row norms vary by an order of magnitude as in real activations)."""
    on = torch.rand(n_rows, n_atoms, generator=gen) < p_fire
    if coef_sigma > 0:
        return on * torch.exp(coef_sigma * torch.randn(n_rows, n_atoms, generator=gen))
    return on * (0.5 + torch.rand(n_rows, n_atoms, generator=gen))


def planted_batches(pair: PlantedPair, batch_size: int, n_batches: int, *, p_fire: float = 0.05,
                    noise: float = 0.01, seed: int = 0, coef_sigma: float = 0.0):
    """Yield ``n_batches`` batches x [B, 2, D] (source 0 = model A, 1 = model B) of the same sparse codes
    (:func:`planted_codes`) through each model's atoms, plus Gaussian noise of std ``noise``.
    Deterministic given ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    n, d = pair.atoms_b.shape
    atoms = torch.stack([pair.atoms_a, pair.atoms_b], dim=1)  # [N, 2, D]
    for _ in range(n_batches):
        codes = planted_codes(batch_size, n, p_fire, gen, coef_sigma)
        x = torch.einsum("bn,nsd->bsd", codes, atoms)
        yield x + noise * torch.randn(batch_size, 2, d, generator=gen)


class PlantedScore(NamedTuple):
    """How a diffing table recovers the planted truth of :func:`planted_pair`.

    A latent is matched to the atom whose B direction is closest in cosine to its B decoder (at least
    ``min_cos``; else unmatched). "Predicted B-only" is the latent set being scored (Delta tags alone, or
    the model_specific flag of Latent Scaling)."""

    precision: float  # predicted B-only latents matched to a b_only atom / predicted (nan if none predicted)
    recall: float  # b_only atoms with at least one predicted latent matched to them / b_only atoms
    n_predicted: int
    misattributed: dict[str, int]  # predicted B-only latents by the kind of their matched atom ("unmatched")
    shared_tagged_shared: float  # fraction of shared atoms whose best latent is tagged shared


def score_b_only(table: LatentDiff, directions: Tensor, pair: PlantedPair, predicted: Tensor,
                 min_cos: float = 0.9, source_b: int = 1) -> PlantedScore:
    """Score the predicted B-only latents (bool [L]) of ``table`` (decoder ``directions [L, S, D]``) against
    the planted atoms of ``pair``."""
    d_b = directions[:, source_b].double()
    atoms_b = pair.atoms_b.double()
    cos = (d_b / d_b.norm(dim=-1, keepdim=True).clamp_min(1e-12)) @ (
        atoms_b / atoms_b.norm(dim=-1, keepdim=True).clamp_min(1e-12)).T  # [L, N]
    best_cos, best_atom = cos.max(dim=1)
    kinds = pair.kinds
    b_only_atoms = {n for n, kind in enumerate(kinds) if kind == "b_only"}
    mis: dict[str, int] = {}
    hit_atoms: set[int] = set()
    n_pred = 0
    for j in predicted.nonzero().flatten().tolist():
        n_pred += 1
        atom = int(best_atom[j]) if best_cos[j] >= min_cos else None
        if atom in b_only_atoms:
            hit_atoms.add(atom)
        else:
            key = "unmatched" if atom is None else kinds[atom]
            mis[key] = mis.get(key, 0) + 1
    tp = n_pred - sum(mis.values())
    precision = tp / n_pred if n_pred else math.nan
    recall = len(hit_atoms) / len(b_only_atoms) if b_only_atoms else math.nan
    shared = [n for n, kind in enumerate(kinds) if kind == "shared"]
    ok = [table.tags[int(cos[:, n].argmax())] == "shared" for n in shared]
    return PlantedScore(precision, recall, n_pred, mis, sum(ok) / len(ok) if ok else math.nan)


def learned_by_kind(directions: Tensor, pair: PlantedPair, min_cos: float = 0.9) -> dict[str, float]:
    """Share of the planted atoms of each kind that some latent learned: a decoder ``directions [L, S, D]``
    at cosine >= ``min_cos`` with the atom in the model that has it (B; A for ``a_only`` atoms), whatever
    the latent's tag. Says whether one-model atoms are learned as often as shared ones."""
    out: dict[str, list[bool]] = {}
    for source, atoms in ((0, pair.atoms_a), (1, pair.atoms_b)):
        d = directions[:, source].double()
        a = atoms.double()
        cos = (d / d.norm(dim=-1, keepdim=True).clamp_min(1e-12)) @ (a / a.norm(dim=-1, keepdim=True).clamp_min(1e-12)).T
        best = cos.max(dim=0).values
        for n, kind in enumerate(pair.kinds):
            if (kind == "a_only") == (source == 0):
                out.setdefault(kind, []).append(bool(best[n] >= min_cos))
    return {kind: sum(hits) / len(hits) for kind, hits in out.items()}
