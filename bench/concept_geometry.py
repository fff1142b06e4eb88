"""Planted concepts of heterogeneous dimensionality and shape: which dictionary kinds recover which?

Hindupur, Lubana, Fel, Ba (2025, arXiv 2503.01822) argue that each SAE's encoder is a projection onto its own
constraint set, so an architecture sees some concept geometries and misses others: half-space receptive fields
(ReLU, TopK, JumpReLU) cannot isolate a concept separable from its neighbours only by a curved boundary, and a
fixed number of active latents (TopK) cannot follow concepts of different intrinsic dimensionality; SpaDE's
distance-based, adaptive-support encoder is built for both. This benchmark plants rays (1-d), subspaces (2-3-d)
and core/shell regions (a disk inside a ring around the same centre) side by side (generators.geometry:
the data and the recovery criterion, a concept's latents must fire on its rows with precision >= 0.9 and F1 >=
0.8, and for rays and subspaces lie in its span, spanning all of a subspace's dimensions).

Printed per kind (mean over seeds): the fraction of each concept type recovered, the mean F1 per type, the mean
number of active latents on rows of each type (rows holding one concept: does L0 adapt to the concept?), held-out
FVU and L0, dead latents, and the fraction recovered by the dictionary the run STARTS from (one step at lr 1e-12:
SpaDE starts at data rows, which on one-concept rows already lie on the rays). Every kind trains with its default
settings (only latents, k and the row budget given) on the same rows; its seed is the data's, the concepts come
from seed + ATOM_SEED_OFFSET.

    .venv/bin/python bench/concept_geometry.py --small --seeds 0 1          # ~1-2 min on one core
    .venv/bin/python bench/concept_geometry.py --seeds 0 1 --per-row 2      # two concepts summed per row
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import time

import torch

from conceptdict.saes import TrainConfig, train
from generators.geometry import TYPES, GeometrySpec, active_per_type, concept_batch, plant, score_concepts

KINDS = ("relu", "topk", "batchtopk", "jumprelu", "matryoshka", "spade")
SMALL = dict(d=32, rays=8, subspaces=4, regions=4)


def fit(kind: str, spec: GeometrySpec, data: list, a, lr: float | None = None, batches: int | None = None):
    n = batches or len(data)
    cfg = TrainConfig(latents=a.latents, k=a.k, kind=kind, tokens=(n - a.eval_batches - 2) * a.batch_size,
                      eval_batches=a.eval_batches, log_every=10**9, checkpoint_every=0, seed=spec.seed, lr=lr)
    return train(cfg, [x for x, _ in data[:n]])


def scores(model, concepts, data, eval_batches: int):
    x = torch.cat([x for x, _ in data[:eval_batches]])
    held = torch.cat([h for _, h in data[:eval_batches]])
    with torch.no_grad():
        codes = model.encode(x)
    return score_concepts(concepts, model.decoder_directions(), codes, held), active_per_type(concepts, codes, held)


def run(kind: str, spec: GeometrySpec, a) -> dict:
    concepts = plant(spec)
    data = [concept_batch(spec, concepts, i, a.batch_size) for i in range(a.batches)]
    start, _ = scores(fit(kind, spec, data, a, lr=1e-12, batches=a.eval_batches + 3), concepts, data, a.eval_batches)
    t0 = time.perf_counter()
    model = fit(kind, spec, data, a)
    seconds = time.perf_counter() - t0
    sc, active = scores(model, concepts, data, a.eval_batches)
    ev = model.training_summary["heldout_eval"]
    out = {"kind": kind, "seed": spec.seed, "fvu": ev["fvu"], "l0": ev["l0"], "dead": ev["dead_fraction"],
           "seconds": seconds, "at_start": statistics.mean(s.recovered for s in start)}
    for t in TYPES:
        mine = [s for s, tt in zip(sc, concepts.types) if tt == t]
        out[t] = statistics.mean(s.recovered for s in mine)
        out[f"start_{t}"] = statistics.mean(s.recovered for s, tt in zip(start, concepts.types) if tt == t)
        out[f"f1_{t}"] = statistics.mean(s.f1 for s in mine)
        out[f"l0_{t}"] = active[t]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--small", action="store_true",
                   help=f"{SMALL}, L=128, k=4, 80 batches of 512 rows (default: D=64, 16 rays, 6 subspaces, "
                        "8 regions, L=256, k=6, 150 batches of 1024 rows)")
    p.add_argument("--per-row", type=int, default=1, help="concepts summed per row (1: the paper's toy setting)")
    p.add_argument("--latents", type=int, default=None)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--batches", type=int, default=None, help="batches, the held-out ones included")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", type=str, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    dims = SMALL if a.small else {}
    a.latents = a.latents or (128 if a.small else 256)
    a.k = a.k or (4 if a.small else 6)
    a.batches = a.batches or (80 if a.small else 150)
    a.batch_size = a.batch_size or (512 if a.small else 1024)
    specs = [GeometrySpec(**dims, per_row=a.per_row, seed=s) for s in a.seeds]
    print(f"{dataclasses.asdict(specs[0])} (seeds {a.seeds}); L={a.latents}, k={a.k}, {a.batches} batches of "
          f"{a.batch_size} rows", flush=True)
    print("recovered fraction | mean F1 | active latents on one-concept rows, per concept type (mean over seeds)")
    head = (f"{'kind':<11}" + "".join(f"{t:>9}" for t in TYPES) + " |" + "".join(f"{t:>9}" for t in TYPES) + " |"
            + "".join(f"{t:>9}" for t in TYPES) + f"{'fvu':>7}{'l0':>7}{'dead':>7}{'start':>7}{'s':>5}")
    print(head, flush=True)
    results = []
    for kind in a.kinds:
        rs = [run(kind, spec, a) for spec in specs]
        results += rs
        m = {key: statistics.mean(r[key] for r in rs) for key in rs[0] if key not in ("kind", "seed")}
        print(f"{kind:<11}" + "".join(f"{m[t]:>9.0%}" for t in TYPES) + " |"
              + "".join(f"{m['f1_' + t]:>9.2f}" for t in TYPES) + " |"
              + "".join(f"{m['l0_' + t]:>9.2f}" if not math.isnan(m["l0_" + t]) else f"{'-':>9}" for t in TYPES)
              + f"{m['fvu']:>7.3f}{m['l0']:>7.2f}{m['dead']:>7.1%}{m['at_start']:>7.0%}{m['seconds']:>5.0f}",
              flush=True)
        if m["at_start"] > 0:
            print(f"{'  at start':<11}" + "".join(f"{m['start_' + t]:>9.0%}" for t in TYPES), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "runs": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
