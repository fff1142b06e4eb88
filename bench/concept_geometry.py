"""Planted concepts of heterogeneous dimensionality and shape: which dictionary kinds recover which?

Hindupur, Lubana, Fel, Ba (2025, arXiv 2503.01822) argue that each SAE's encoder is a projection onto its own
constraint set, so an architecture sees some concept geometries and misses others: TopK-style encoders
(half-space receptive fields, a fixed number of active latents) fit 1-d concepts, while concepts spread over a
few dimensions or separable from their neighbours only by a curved boundary need adaptive sparsity and
non-half-space receptive fields (SpaDE). This benchmark plants the three geometries side by side.

Data (D = 64 by default): every row is the sum of ``--per-row`` (default 2) distinct concepts' samples plus
noise (0.02 per coordinate), in one of four types:

- ray (1-d): ``c u`` with a unit direction u and c ~ LogNormal(0, 0.3) (a planted atom);
- subspace (2-d or 3-d): ``U a`` with an orthonormal basis U [D, d] and a ~ N(0, I_d) (every direction of the
  subspace, either sign);
- core (a ball): ``m + 0.25 r V g`` with a centre m of norm r = 1.5, V an orthonormal 2-d basis orthogonal to m
  and g ~ N(0, I_2) -- a small disk around m;
- shell: ``m + r V e`` with e a uniform unit vector of the plane, the ring of radius r around the SAME centre m
  as its core. A core is separable from its shell only by a disk: every half-space that holds the core holds
  an arc of the shell too.

Recovery, per concept type (the table reports the fraction recovered per type):

- ray: some decoder direction has cosine >= 0.9 with u (the planted-atom criterion of synthetic_recovery);
- subspace: the decoder directions that lie in the subspace (|projection| >= 0.9 of their norm) span >= 90%
  of the concept's variance (so 1 latent cannot recover a 2-d subspace, and d well-placed ones can);
- core and shell: a latent DETECTS the concept: on held-out rows it fires on >= 50% of the rows that hold the
  concept, and >= 90% of the rows it fires on hold it (a region concept has no single direction to match, so
  it is recovered when some latent's receptive field is that region).

Every kind trains with its default settings (only latents, k and the row budget given) on the same rows.

    .venv/bin/python bench/concept_geometry.py                               # topk batchtopk jumprelu matryoshka spade
    .venv/bin/python bench/concept_geometry.py --kinds topk spade --batches 100 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import NamedTuple

import torch
from torch import Tensor

from conceptdict.saes import TrainConfig, train

TYPES = ("ray", "subspace", "core", "shell")


class Concepts(NamedTuple):
    types: list[str]  # one per concept
    bases: list[Tensor]  # ray: [1, D] direction; subspace: [d, D]; core/shell: [2, D] plane
    centres: list[Tensor | None]  # core/shell: [D] centre, else None


def plant(D: int, n_rays: int, n_sub: int, n_regions: int, gen: torch.Generator) -> Concepts:
    """Random concepts; every basis vector and centre is a column of one random orthogonal matrix, so that
    the concepts are mutually orthogonal (needs n_rays + 2.5 n_sub + 3 n_regions <= D)."""
    dims = [1] * n_rays + [2 + i % 2 for i in range(n_sub)]
    need = sum(dims) + 3 * n_regions
    if need > D:
        raise ValueError(f"{need} orthogonal directions do not fit in D={D}; lower the counts or raise --d")
    Q = torch.linalg.qr(torch.randn(D, D, generator=gen))[0].T  # rows orthonormal
    types, bases, centres, at = [], [], [], 0
    for d in dims:
        types.append("ray" if d == 1 else "subspace")
        bases.append(Q[at : at + d])
        centres.append(None)
        at += d
    for _ in range(n_regions):
        for t in ("core", "shell"):
            types.append(t)
            bases.append(Q[at + 1 : at + 3])
            centres.append(1.5 * Q[at])
        at += 3
    return Concepts(types, bases, centres)


def sample(c: Concepts, j: int, n: int, gen: torch.Generator) -> Tensor:
    """n samples [n, D] of concept j."""
    t, B = c.types[j], c.bases[j]
    if t == "ray":
        return torch.exp(0.3 * torch.randn(n, 1, generator=gen)) * B
    if t == "subspace":
        return torch.randn(n, B.shape[0], generator=gen) @ B
    if t == "core":
        return c.centres[j] + 0.25 * 1.5 * torch.randn(n, 2, generator=gen) @ B
    e = torch.nn.functional.normalize(torch.randn(n, 2, generator=gen), dim=1)
    return c.centres[j] + 1.5 * e @ B


def rows(c: Concepts, n: int, per_row: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """n rows [n, D] and which concepts each holds (bool [n, C])."""
    C, D = len(c.types), c.bases[0].shape[1]
    pick = torch.rand(n, C, generator=gen).argsort(dim=1)[:, :per_row]
    held = torch.zeros(n, C, dtype=torch.bool).scatter_(1, pick, True)
    x = 0.02 * torch.randn(n, D, generator=gen)
    for j in range(C):
        r = held[:, j].nonzero().flatten()
        if r.numel():
            x[r] += sample(c, j, r.numel(), gen)
    return x, held


def recovered(c: Concepts, directions: Tensor, codes: Tensor, held: Tensor) -> list[bool]:
    """Per concept, the criterion of its type (module docstring). directions [L, D]; codes [N, L] on held-out
    rows; held [N, C]."""
    d = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    fires = codes > 0
    out = []
    for j, t in enumerate(c.types):
        B = c.bases[j]
        if t == "ray":
            out.append(bool((d @ B[0]).abs().max() >= 0.9))
        elif t == "subspace":
            inside = d[(d @ B.T).norm(dim=1) >= 0.9]
            if inside.shape[0] == 0:
                out.append(False)
                continue
            span = torch.linalg.qr((inside @ B.T).T)[0]  # [dim, r] orthonormal span, in the subspace's coordinates
            s = torch.randn(2000, B.shape[0])  # the concept's (isotropic) variance explained by the span
            out.append(bool((s @ span).norm().square() / s.norm().square() >= 0.9))
        else:
            h = held[:, j]
            recall = (fires & h[:, None]).sum(dim=0) / h.sum().clamp_min(1)
            precision = (fires & h[:, None]).sum(dim=0) / fires.sum(dim=0).clamp_min(1)
            out.append(bool(((recall >= 0.5) & (precision >= 0.9)).any()))
    return out


def run(kind: str, a, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    c = plant(a.d, a.rays, a.subspaces, a.regions, gen)
    data = [rows(c, a.batch_size, a.per_row, gen) for _ in range(a.batches)]
    cfg = TrainConfig(latents=a.latents, k=a.k, kind=kind, tokens=(a.batches - 6) * a.batch_size, eval_batches=4,
                      log_every=10**9, checkpoint_every=0, seed=seed)
    t0 = time.perf_counter()
    model = train(cfg, [x for x, _ in data])
    seconds = time.perf_counter() - t0
    x_held = torch.cat([x for x, _ in data[:4]])
    held = torch.cat([h for _, h in data[:4]])
    with torch.no_grad():
        codes = model.encode(x_held)
    ok = recovered(c, model.decoder_directions(), codes, held)
    ev = model.training_summary["heldout_eval"]
    per_type = {t: statistics.mean(o for o, tt in zip(ok, c.types) if tt == t) for t in TYPES}
    return {"kind": kind, "seed": seed, **per_type, "fvu": ev["fvu"], "l0": ev["l0"], "dead": ev["dead_fraction"],
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=["topk", "batchtopk", "jumprelu", "matryoshka", "spade"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--rays", type=int, default=16)
    p.add_argument("--subspaces", type=int, default=6, help="half 2-d, half 3-d")
    p.add_argument("--regions", type=int, default=8, help="core/shell pairs")
    p.add_argument("--per-row", type=int, default=2)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--json", type=str, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = []
    head = f"{'kind':<12}" + "".join(f"{t:>10}" for t in TYPES) + f"{'fvu':>8}{'l0':>7}{'dead':>7}{'s':>6}"
    print("recovered fraction per concept type (mean over seeds)\n" + head, flush=True)
    for kind in a.kinds:
        rs = [run(kind, a, s) for s in a.seeds]
        results += rs
        mean = {key: statistics.mean(r[key] for r in rs) for key in (*TYPES, "fvu", "l0", "dead", "seconds")}
        print(f"{kind:<12}" + "".join(f"{mean[t]:>10.0%}" for t in TYPES)
              + f"{mean['fvu']:>8.3f}{mean['l0']:>7.2f}{mean['dead']:>7.1%}{mean['seconds']:>6.0f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "runs": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
