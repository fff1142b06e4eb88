"""Synthetic ground-truth benchmark: how many planted atoms does each dictionary kind recover, and how well?

Data (``conceptdict.saes.synthetic``): unit atoms in D dimensions, rows that are sparse positive combinations
of them plus an offset and noise. The settings below go from the easy problem to what real activations look
like -- heavy-tailed (log-normal) coefficients so row norms vary by an order of magnitude, heavy-tailed row
scales, Zipf-like atom frequencies, correlated atoms -- always with more latents than atoms. Every kind
trains with its DEFAULT settings (only latents, k and the row budget given) on the same rows of each
setting and seed, and is evaluated on held-out rows.

Printed per run: atom recovery (share of atoms with a decoder direction at |cos| > 0.9), mean best cosine,
held-out FVU, inference L0, dead fraction (no firing on the held-out rows), the alive latents that match no
atom and their share of the firings (what the latents beyond the atoms do), wall time; and recovery and FVU
as ratios to the BASELINE of the same setting and seed, measured in the same invocation: plain TopK.
The closing table has one line per setting and kind (mean over seeds, worst seed in brackets).

    .venv/bin/python bench/synthetic_recovery.py --json out.json              # all settings, 2 seeds
    .venv/bin/python bench/synthetic_recovery.py --settings heavy --seeds 0 1 2 --kinds topk batchtopk
    .venv/bin/python bench/synthetic_recovery.py --kinds topk batchtopk jumprelu matryoshka spade
    .venv/bin/python bench/synthetic_recovery.py --settings plain --coef-sigma 1.5 --batches 600   # overrides
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import statistics
import time

import torch

from conceptdict.saes import TrainConfig, train
from conceptdict.saes.synthetic import SyntheticSpec, atom_recovery, planted_atoms, synthetic_batches

BASE = dict(n_atoms=1024, d=128, active=6.0, noise=0.02)
SETTINGS: dict[str, dict] = {
    "plain": {},
    "heavy": dict(coef_sigma=1.0),
    "heavy-rows": dict(coef_sigma=0.8, row_sigma=0.5),
    "zipf-corr": dict(coef_sigma=1.0, freq_exponent=0.5, correlated=0.1, correlation=0.5),
}
"""Generator settings (fields of SyntheticSpec) over BASE; the command line overrides any field."""

FIELDS = ("n_atoms", "d", "active", "noise", "coef_sigma", "row_sigma", "freq_exponent", "correlated", "correlation")


@torch.no_grad()
def unmatched_alive(model, spec: SyntheticSpec, eval_batches: int) -> tuple[int, float]:
    """Latents that fire on the held-out rows without matching any atom (|cos| <= 0.9), and their share of all
    firings there: what the latents beyond the atoms do when they are not dead."""
    d = model.decoder_directions().reshape(model.n_latents, -1)
    best = (d / d.norm(dim=1, keepdim=True).clamp_min(1e-12) @ planted_atoms(spec).T).abs().max(dim=1).values
    counts = sum((model.encode(x) > 0).sum(dim=0) for x in itertools.islice(synthetic_batches(spec), eval_batches))
    unmatched = best <= 0.9
    return int(((counts > 0) & unmatched).sum()), float(counts[unmatched].sum() / counts.sum().clamp_min(1))


def run_one(spec: SyntheticSpec, cfg: TrainConfig) -> dict:
    t0 = time.perf_counter()
    model = train(cfg, functools.partial(synthetic_batches, spec))
    seconds = time.perf_counter() - t0
    rec = atom_recovery(model.decoder_directions(), planted_atoms(spec))
    held = model.training_summary["heldout_eval"]
    n_unmatched, share = unmatched_alive(model, spec, cfg.eval_batches)
    return {"kind": cfg.kind, "seed": spec.seed, "recovery": rec.fraction, "mean_best_cos": rec.mean_best_cos,
            "fvu": held["fvu"], "l0": held["l0"], "k": cfg.k, "dead": held["dead_fraction"], "seconds": seconds,
            "unmatched_alive": n_unmatched, "unmatched_firing_share": share}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--kinds", nargs="+", default=["topk", "batchtopk"],
                   choices=["topk", "batchtopk", "batchtopk-absolute", "relu", "jumprelu", "jumprelu-relative", "matryoshka",
                            "matryoshka-absolute", "spade"])
    p.add_argument("--latents", type=int, default=None, help="default: twice the number of atoms")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batches", type=int, default=None,
                   help="batches of --batch-size rows, held-out ones included (default 1000; --small: 200)")
    p.add_argument("--eval-batches", type=int, default=16,
                   help="held-out batches every run is evaluated on (16k rows: a latent rarer than that is dead)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--kernel-impl", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--small", action="store_true", help="the test-sized problem (256 atoms in D=128, 3 active, k=6)")
    for f in FIELDS:
        p.add_argument("--" + f.replace("_", "-"), type=float if f not in ("n_atoms", "d") else int, default=None,
                       help=f"override SyntheticSpec.{f} in every setting")
    p.add_argument("--json", type=str, default=None, help="also write the figures here")
    return p.parse_args(argv)


def spec_for(a, setting: str, seed: int) -> SyntheticSpec:
    fields = dict(BASE, **SETTINGS[setting])
    if a.small:
        fields.update(n_atoms=256, d=128, active=3.0)
        a.k = 6
    fields.update({f: getattr(a, f) for f in FIELDS if getattr(a, f) is not None})
    return SyntheticSpec(**fields, batch_size=a.batch_size, n_batches=a.batches, seed=seed)


def summary(results: list[dict], settings: list[str], kinds: list[str]) -> list[str]:
    lines = [f"{'setting':<12}{'kind':<20}{'recovery':>16}{'fvu':>16}{'l0':>8}{'dead':>16}"]
    for s in settings:
        for kind in kinds:
            rs = [r for r in results if r["setting"] == s and r["kind"] == kind]
            if not rs:
                continue
            rec = [r["recovery"] for r in rs]
            fvu = [r["fvu"] for r in rs]
            dead = [r["dead"] for r in rs]
            lines.append(f"{s:<12}{kind:<20}{statistics.mean(rec):>8.1%} [{min(rec):5.1%}]"
                         f"{statistics.mean(fvu):>8.3f} [{max(fvu):.3f}]{statistics.mean(r['l0'] for r in rs):>8.2f}"
                         f"{statistics.mean(dead):>8.1%} [{max(dead):5.1%}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.batches is None:
        a.batches = 200 if a.small else 1000
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    results = []
    for setting in a.settings:
        for seed in a.seeds:
            spec = spec_for(a, setting, seed)
            L = a.latents or 2 * spec.n_atoms
            print(f"[{setting}, seed {seed}] {dataclasses.asdict(spec)}; L={L}, k={a.k}", flush=True)
            base = None
            for kind in a.kinds:
                cfg = TrainConfig(latents=L, k=a.k, kind=kind, tokens=(a.batches - a.eval_batches - 2) * a.batch_size,
                                  eval_batches=a.eval_batches,
                                  log_every=10**9, checkpoint_every=0, kernel_impl=a.kernel_impl, seed=seed)
                r = dict(run_one(spec, cfg), setting=setting)
                results.append(r)
                base = base or r
                ratio = f"x{r['recovery'] / base['recovery']:.2f}" if base["recovery"] else "n/a"
                print(f"  {kind:<11} recovery {r['recovery']:6.1%}  cos {r['mean_best_cos']:.3f}  fvu {r['fvu']:.4f}  "
                      f"l0 {r['l0']:6.2f}  dead {r['dead']:6.2%}  unmatched alive {r['unmatched_alive']} "
                      f"({r['unmatched_firing_share']:.1%} of firings)  {r['seconds']:6.1f}s  "
                      f"[vs {a.kinds[0]}: recovery {ratio}, fvu x{r['fvu'] / base['fvu']:.2f}]", flush=True)
    print("\n".join(["", "mean over seeds [worst seed]:", *summary(results, a.settings, a.kinds)]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"base": BASE, "settings": SETTINGS, "args": vars(a), "runs": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
