"""Closed-form concept erasure and steering of activations: LEACE, SPLINCE, LEACE-Switch and MidSteer.

Every method here is one affine map, fitted on rows ``x [N, D]`` with a concept label per row (and, for SPLINCE,
a target label), and stored the same way (:class:`Eraser`)::

    x' = x - ((x - mu) R^T) L^T          L [D, r], R [r, D]   (the map is I - L R around the mean mu)

Notation (all moments over the fit rows, in float64): ``mu = E[x]``, ``Sigma = Cov(x)``; ``W = (Sigma^{1/2})^+``
whitens on Sigma's support (eigenvalues below ``tol * max`` dropped) and ``W^+ = Sigma^{1/2}``; ``Z [N, k]`` is
the one-hot concept, ``Sigma_xz = Cov(x, Z) [D, k]``, ``U_z`` an orthonormal basis of the columns of
``W Sigma_xz`` (rank <= k - 1: the one-hot columns sum to one). ``Y`` and ``U_y`` likewise for a target label.

- **LEACE** (Belrose et al., "LEACE: Perfect linear concept erasure in closed form", NeurIPS 2023, Thm. 4.3)::

      x' = x - W^+ U_z U_z^T W (x - mu)

  After it ``Cov(x', Z) = 0``, so no linear classifier predicts C better than a constant one, and
  ``E||x' - x||^2`` is the smallest of any affine map with that property.
- **LEACE-Switch** (Gaintseva et al., "MidSteer: Optimal affine framework for steering generative models",
  2026, Eq. 22 with beta = 2)::

      x' = x - 2 W^+ U_z U_z^T W (x - mu)

  ``Cov(x', Z) = -Cov(x, Z)``: each class mean is reflected through mu, ``E[x'|c] - mu = -(E[x|c] - mu)``
  (the class-mean offsets span the concept subspace). For a balanced binary concept this swaps the two means.
- **MidSteer** (same paper, Eq. 23; minimal-disturbance switching of class s to class t, strength beta)::

      x' = x + beta W^+ (u_t - u_s) u_s^+ W (x - mu),   u_i = W (E[x|i] - mu),   u_s^+ = u_s^T / |u_s|^2

  The class-s mean moves by ``beta (E[x|t] - E[x|s])``: to the class-t mean at beta = 1. Every row moves by
  ``beta W^+ (u_t - u_s) <u_s, W(x - mu)> / |u_s|^2`` (one direction, a rank-1 map).
- **SPLINCE** (Holstege, Ravfogel and Wouters, "Preserving task-relevant information under linear concept
  removal", NeurIPS 2025): the oblique projection ``P = W^+ V (U^T V)^{-1} U^T W`` whose kernel holds
  ``Sigma_xz`` and whose range holds ``Sigma_xy``. In whitened coordinates, with ``B = [U_z, U_y]``::

      Q = I - [U_z, 0] B^+       (Q U_z = 0, Q U_y = U_y, Q^2 = Q)
      x' = x - W^+ [U_z, 0] B^+ W (x - mu)

  so ``Cov(x', Z) = 0`` (C linearly unpredictable) and ``Cov(x', Y) = Cov(x, Y)`` exactly on the fit rows. Each
  row ``a`` of ``I - P`` is the least-variance ``a^T Sigma a`` meeting both constraints, so the map has the least
  mean squared displacement of all such maps (the paper's uniqueness result). It needs ``U_z`` and ``U_y`` to be
  linearly independent: a target whose covariance with x lies in the concept's cannot be kept.

Saved as a directory like a dictionary: ``eraser.json`` (method, classes, hookpoint, ...) and
``eraser.safetensors`` (``mean [D]``, ``left [D, r]``, ``right [r, D]``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

FORMAT = "conceptdict-eraser"
FORMAT_VERSION = 1
METHODS = ("leace", "leace-switch", "midsteer", "splince")


@dataclass(frozen=True)
class Eraser:
    """An affine map ``x -> x - ((x - mean) right^T) left^T`` fitted by one of :data:`METHODS`."""

    method: str
    mean: Tensor
    """[D] the fit rows' mean."""
    left: Tensor
    """[D, r]"""
    right: Tensor
    """[r, D]"""
    meta: dict[str, Any] = field(default_factory=dict)
    """classes, source / target classes (MidSteer), rank, tolerance, hookpoint, ..."""

    def __call__(self, x: Tensor) -> Tensor:
        """x [..., D] -> the edited rows, same shape and dtype (computed in x's dtype, at least float32)."""
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        flat = x.reshape(-1, x.shape[-1]).to(dt)
        m, L, R = (t.to(device=x.device, dtype=dt) for t in (self.mean, self.left, self.right))
        out = flat - ((flat - m) @ R.T) @ L.T
        return out.to(x.dtype).reshape(x.shape)

    def displacement(self, x: Tensor) -> Tensor:
        """[N]: squared distance each row of x [N, D] moves."""
        return (self(x.double()) - x.double()).square().sum(-1)


# ---------------------------------------------------------------- moments


def one_hot(labels: Tensor, n_classes: int | None = None) -> Tensor:
    """labels [N] int in 0..k-1 -> [N, k] float64."""
    return torch.nn.functional.one_hot(labels.long(), n_classes or int(labels.max()) + 1).double()


def check_classes(labels: Tensor, what: str = "concept") -> int:
    """The number of classes in ``labels [N]``; a ValueError when fewer than two are present."""
    present = torch.unique(labels)
    if len(present) < 2:
        value = present.tolist()
        raise ValueError(f"the {what} labels hold one class ({value}); erasure and steering need at least two")
    return int(labels.max()) + 1


def cross_covariance(x: Tensor, z: Tensor) -> Tensor:
    """Cov(x, z) [D, k] with 1/N, float64."""
    x, z = x.double(), z.double()
    return (x - x.mean(0)).T @ (z - z.mean(0)) / x.shape[0]


def whitening(cov: Tensor, tol: float | None = None) -> tuple[Tensor, Tensor]:
    """(W, W^+) = ((Sigma^{1/2})^+, Sigma^{1/2}) on the eigenvalues above ``tol * max`` (default D * eps)."""
    evals, evecs = torch.linalg.eigh(cov.double())
    evals = evals.clamp_min(0)
    tol = cov.shape[0] * torch.finfo(torch.float64).eps if tol is None else tol
    keep = evals > tol * evals.max().clamp_min(1e-300)
    root = torch.where(keep, evals.sqrt(), torch.zeros_like(evals))
    inv_root = torch.where(keep, 1 / root.clamp_min(1e-300), torch.zeros_like(evals))
    return (evecs * inv_root) @ evecs.T, (evecs * root) @ evecs.T


def column_basis(u: Tensor, tol: float = 1e-8) -> Tensor:
    """Orthonormal basis [D, r] of the columns of u [D, k] (singular values above ``tol * max``)."""
    U, s, _ = torch.linalg.svd(u, full_matrices=False)
    if not len(s) or float(s.max()) == 0:
        return U[:, :0]
    return U[:, s > tol * s.max()]


class _Fit:
    """The moments every method starts from."""

    def __init__(self, x: Tensor, tol: float | None) -> None:
        if x.dim() != 2 or x.shape[0] < 2:
            raise ValueError(f"need rows x [N >= 2, D] to fit an eraser, got shape {list(x.shape)}")
        self.x = x.double()
        self.mean = self.x.mean(0)
        centred = self.x - self.mean
        self.W, self.W_pinv = whitening(centred.T @ centred / x.shape[0], tol)


def _eraser(method: str, fit: _Fit, left_white: Tensor, right_white: Tensor, meta: dict) -> Eraser:
    """The map I - W^+ left right W, stored as L = W^+ left, R = right W."""
    left = fit.W_pinv @ left_white
    right = right_white @ fit.W
    return Eraser(method, fit.mean, left, right, {**meta, "rank": int(left.shape[1])})


def fit_leace(x: Tensor, concept: Tensor, *, scale: float = 1.0, tol: float | None = None,
              method: str = "leace") -> Eraser:
    """LEACE on rows x [N, D] with concept classes ``concept [N]`` (ints); ``scale`` 2 is LEACE-Switch."""
    k = check_classes(concept)
    fit = _Fit(x, tol)
    U = column_basis(fit.W @ cross_covariance(fit.x, one_hot(concept, k)))
    return _eraser(method, fit, scale * U, U.T, {"n_classes": k, "scale": scale})


def fit_leace_switch(x: Tensor, concept: Tensor, *, tol: float | None = None) -> Eraser:
    """LEACE-Switch: Cov(x', Z) = -Cov(x, Z) (see the module docstring)."""
    return fit_leace(x, concept, scale=2.0, tol=tol, method="leace-switch")


def fit_midsteer(x: Tensor, concept: Tensor, source: int, target: int, *, strength: float = 1.0,
                 tol: float | None = None) -> Eraser:
    """MidSteer: move class ``source``'s mean toward class ``target``'s (all the way at strength 1)."""
    k = check_classes(concept)
    for name, c in (("source", source), ("target", target)):
        if not bool((concept == c).any()):
            raise ValueError(f"MidSteer {name} class {c} has no rows; pick a class present in the concept labels")
    if source == target:
        raise ValueError(f"MidSteer source and target are the same class ({source}); pick two different classes")
    fit = _Fit(x, tol)
    u_s = fit.W @ (fit.x[concept == source].mean(0) - fit.mean)
    u_t = fit.W @ (fit.x[concept == target].mean(0) - fit.mean)
    norm = u_s.square().sum()
    if float(norm) <= 1e-24:
        raise ValueError(f"class {source}'s mean equals the overall mean; there is no direction to steer along")
    return _eraser("midsteer", fit, (strength * (u_s - u_t))[:, None], (u_s / norm)[None, :],
                   {"n_classes": k, "source": int(source), "target": int(target), "strength": strength})


def fit_splince(x: Tensor, concept: Tensor, target: Tensor, *, tol: float | None = None,
                independence_tol: float = 1e-6) -> Eraser:
    """SPLINCE: erase ``concept`` while keeping Cov(x, one-hot ``target``) exactly (see the module docstring)."""
    k = check_classes(concept)
    m = check_classes(target, "target")
    fit = _Fit(x, tol)
    U_z = column_basis(fit.W @ cross_covariance(fit.x, one_hot(concept, k)))
    U_y = column_basis(fit.W @ cross_covariance(fit.x, one_hot(target, m)))
    B = torch.cat([U_z, U_y], dim=1)
    s = torch.linalg.svdvals(B)
    if float(s.min()) < independence_tol:
        raise ValueError("the target's covariance with the activations lies in the concept's span (smallest "
                         f"singular value {float(s.min()):.2e}); SPLINCE cannot erase the concept and keep it. "
                         "Pick a target column less tied to the concept, or use LEACE")
    E_right = torch.linalg.pinv(B)[: U_z.shape[1]]  # the rows of B^+ that [U_z, 0] picks
    return _eraser("splince", fit, U_z, E_right, {"n_classes": k, "n_target_classes": m})


# ---------------------------------------------------------------- save / load


def save_eraser(eraser: Eraser, directory: str | Path) -> Path:
    """``eraser.safetensors`` (mean, left, right) + ``eraser.json`` (format, method, meta)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"mean": eraser.mean, "left": eraser.left, "right": eraser.right}
    tmp = directory / "eraser.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, directory / "eraser.safetensors")
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "method": eraser.method, "meta": eraser.meta}
    (directory / "eraser.json.tmp").write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(directory / "eraser.json.tmp", directory / "eraser.json")
    return directory


def load_eraser(directory: str | Path) -> Eraser:
    directory = Path(directory)
    path = directory / "eraser.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} has no eraser.json; pass a directory written by `conceptdict erase`")
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} file (format {doc.get('format')!r}, "
                         f"version {doc.get('format_version')!r}); rewrite it with this conceptdict")
    t = load_file(str(directory / "eraser.safetensors"))
    D = t["mean"].shape[0]
    if t["left"].shape[0] != D or t["right"].shape[1] != D or t["left"].shape[1] != t["right"].shape[0]:
        raise ValueError(f"{directory}/eraser.safetensors has inconsistent shapes mean {list(t['mean'].shape)}, "
                         f"left {list(t['left'].shape)}, right {list(t['right'].shape)}; refit the eraser")
    return Eraser(doc["method"], t["mean"], t["left"], t["right"], doc.get("meta", {}))
