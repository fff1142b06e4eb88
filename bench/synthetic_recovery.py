"""Synthetic ground-truth benchmark: how many planted atoms does each dictionary kind recover?

Data: ``n_atoms`` unit atoms in D dimensions; each row a sparse positive combination of ``active`` atoms on
average plus an offset and Gaussian noise (conceptdict.saes.synthetic). Every run trains on the same rows
and is evaluated on held-out rows. Printed per run: atom recovery (best |cos| > 0.9), mean best cosine,
held-out FVU, inference L0, dead fraction, wall time; and each figure as a ratio to the BASELINE run measured
in the same invocation: plain TopK at the literature's learning rate 2e-4 / sqrt(L / 2^14), other settings
default (what the default learning rate is tuned against).

    .venv/bin/python bench/synthetic_recovery.py                      # 4096 atoms in D=256 (about 10 min on 2 cores)
    .venv/bin/python bench/synthetic_recovery.py --small --json out.json
    .venv/bin/python bench/synthetic_recovery.py --lrs 4e-4 8e-4 1.6e-3 3.2e-3   # lr sweep of the default kind
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import time
from dataclasses import asdict

import torch

from conceptdict.saes import TrainConfig, train
from conceptdict.saes.synthetic import SyntheticSpec, atom_recovery, planted_atoms, synthetic_batches


def run_one(name: str, spec: SyntheticSpec, cfg: TrainConfig) -> dict:
    t0 = time.perf_counter()
    model = train(cfg, functools.partial(synthetic_batches, spec))
    seconds = time.perf_counter() - t0
    rec = atom_recovery(model.decoder_directions(), planted_atoms(spec))
    held = model.training_summary["heldout_eval"]
    return {"name": name, "kind": cfg.kind, "lr": model.training_summary["resolved"]["lr"],
            "recovery": rec.fraction, "mean_best_cos": rec.mean_best_cos, "fvu": held["fvu"], "l0": held["l0"],
            "k": cfg.k, "dead": held["dead_fraction"], "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--atoms", type=int, default=4096)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--latents", type=int, default=None, help="default: the number of atoms")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--active", type=float, default=8.0)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--kinds", nargs="+", default=["topk", "batchtopk", "relu"])
    p.add_argument("--lrs", nargs="*", type=float, default=[], help="extra TopK runs at these learning rates")
    p.add_argument("--small", action="store_true", help="the test-sized problem (256 atoms in D=128)")
    p.add_argument("--kernel-impl", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="also write the figures here")
    a = p.parse_args(argv)
    if a.small:
        a.atoms, a.d, a.k, a.active, a.batches = 256, 128, 6, 3.0, 80
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(a.seed)
    spec = SyntheticSpec(n_atoms=a.atoms, d=a.d, active=a.active, noise=a.noise, batch_size=a.batch_size,
                         n_batches=a.batches, seed=a.seed)
    L = a.latents or a.atoms
    base = dict(latents=L, k=a.k, tokens=(a.batches - 4) * a.batch_size, eval_batches=4, log_every=10**9,
                checkpoint_every=0, kernel_impl=a.kernel_impl, seed=a.seed)
    lit_lr = 2e-4 / math.sqrt(L / 2**14)
    runs = [("BASELINE topk, literature lr", TrainConfig(**base, lr=lit_lr))]
    runs += [(f"{kind} (defaults)", TrainConfig(**base, kind=kind)) for kind in a.kinds]
    runs += [(f"topk lr={lr:g}", TrainConfig(**base, lr=lr)) for lr in a.lrs]
    print(f"planted {a.atoms} atoms in D={a.d}, {a.active} active per row, noise {a.noise}; L={L}, k={a.k}, "
          f"{a.batches - 4} x {a.batch_size} training rows")
    results = []
    for name, cfg in runs:
        r = run_one(name, spec, cfg)
        results.append(r)
        b = results[0]
        ratio = (f"x{r['recovery'] / b['recovery']:.2f} recovery" if b["recovery"] > 0 else "baseline recovers 0")
        print(f"{name:<46} recovery {r['recovery']:6.1%}  cos {r['mean_best_cos']:.3f}  fvu {r['fvu']:.4f}  "
              f"l0 {r['l0']:6.2f}  dead {r['dead']:6.2%}  lr {r['lr']:.2e}  {r['seconds']:6.1f}s  "
              f"[{ratio}, fvu x{r['fvu'] / b['fvu']:.2f}, time x{r['seconds'] / b['seconds']:.2f}]", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"spec": asdict(spec), "latents": L, "k": a.k, "runs": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
