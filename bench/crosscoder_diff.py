"""Model diffing on planted data: BatchTopK crosscoders + Latent Scaling against the L1 crosscoder.

Two synthetic "models" A and B read the same sparse codes through their own atoms
(``generators.synthetic.planted_pair``): shared atoms, atoms only in B, atoms only in A, atoms in both
but scaled down in A, atoms in both with A's direction rotated. Both crosscoder losses are trained on the
same batches with the project's training loop; each latent is matched to its planted atom by decoder
cosine; "predicted B-only" is either the Delta tag alone (Delta > 0.9) or Latent Scaling's
model_specific flag (Delta > 0.9, nu_eps < 0.2, nu_r < 0.5). Prints precision and recall of B-only, the
misattributions by atom kind, and ratios against the baseline measured in the same run (the L1 crosscoder
read by Delta alone, i.e. the classical diffing recipe). Also printed: the share of each atom kind that some
latent learned at all (a one-model concept that no latent learned cannot be found by any reading). Code
magnitudes are log-normal by default (``--coef-sigma 0``: the former easy problem); every figure is the mean
over ``--seeds``. ``--json PATH`` writes the figures.

The default run is 1000 steps of 512 rows. Shorter runs leave the shared atoms split: at 400 steps about a
fifth of them are covered only by two latents at cosine ~0.85 each (the `crosscoder` learned 0.82 of the
shared atoms against 1.00 of the one-model ones); by 1000 steps the pairs have merged (0.99).

    .venv/bin/python bench/crosscoder_diff.py --json runs/bench/crosscoder_diff.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from conceptdict.saes import evaluate, train, train_config
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.kinds.crosscoder import input_scale
from conceptdict.saes.diffing import DiffAnalysisConfig, diff_crosscoder
from generators.synthetic import learned_by_kind, planted_batches, planted_pair, score_b_only


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-in", type=int, default=64, help="width D of each model's activations")
    p.add_argument("--shared", type=int, default=96, help="atoms in both models")
    p.add_argument("--b-only", type=int, default=32, help="atoms only in B")
    p.add_argument("--a-only", type=int, default=32, help="atoms only in A")
    p.add_argument("--scaled", type=int, default=32, help="atoms in both, scaled down in A")
    p.add_argument("--rotated", type=int, default=32, help="atoms in both, rotated in A")
    p.add_argument("--scale", type=float, default=0.3, help="factor of the scaled atoms in A")
    p.add_argument("--angle", type=float, default=60.0, help="rotation of the rotated atoms in A (degrees)")
    p.add_argument("--active", type=float, default=6.0, help="mean planted atoms active per token")
    p.add_argument("--latents", type=int, default=512, help="crosscoder latents L")
    p.add_argument("--k", type=int, default=8, help="BatchTopK k")
    p.add_argument("--l1-coeff", type=float, default=1.5, help="lambda of the L1 crosscoder")
    p.add_argument("--steps", type=int, default=1000, help="training steps per crosscoder")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches for eval and Latent Scaling")
    p.add_argument("--coef-sigma", type=float, default=1.0,
                   help="log-normal sigma of the code magnitudes (0: uniform in [0.5, 1.5], the easy problem)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kinds", nargs="+", default=["crosscoder-l1", "crosscoder-absolute", "crosscoder"],
                   help="the first one is the baseline")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def run_one(kind: str, args, seed: int, pair, train_batches, held_out) -> dict:
    t0 = time.perf_counter()
    # --l1-coeff is crosscoder-l1's setting: the other kinds do not read it
    cfg = train_config(**flat_for_kind(dict(latents=args.latents, k=args.k, kind=kind, batch_size=args.batch_size,
                                            eval_batches=0, l1_coeff=args.l1_coeff, seed=seed, log_every=10**9,
                                            checkpoint_every=0, device="cpu"), kind))
    model = train(cfg, train_batches)
    train_s = time.perf_counter() - t0
    ev = evaluate(model, held_out)
    table = diff_crosscoder(model, held_out, DiffAnalysisConfig())
    directions = model.decoder_directions() * input_scale(model)[None, :, None]
    by_delta = torch.tensor([t == "B-only" for t in table.tags])
    out = {"kind": kind, "seed": seed, "train_s": train_s, "fvu": ev.fvu, "per_source_fvu": list(ev.per_source_fvu),
           "l0": ev.l0, "dead_fraction": ev.dead_fraction, "counts": table.counts(),
           "learned": learned_by_kind(directions, pair)}
    for name, predicted in (("delta", by_delta), ("latent_scaling", table.flags["model_specific"])):
        score = score_b_only(table, directions, pair, predicted)
        out[name] = score._asdict()
    return out


def _fmt(x: float) -> str:
    return "  n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:5.2f}"


def run_seed(args, seed: int) -> list[dict]:
    pair = planted_pair(args.d_in, args.shared, args.b_only, args.scaled, args.rotated, n_a_only=args.a_only,
                        scale=args.scale, angle_deg=args.angle, seed=seed)
    p_fire = args.active / len(pair.kinds)
    train_batches = list(planted_batches(pair, args.batch_size, args.steps, p_fire=p_fire, seed=seed + 1,
                                         coef_sigma=args.coef_sigma))
    held_out = list(planted_batches(pair, args.batch_size, args.eval_batches, p_fire=p_fire, seed=seed + 2,
                                    coef_sigma=args.coef_sigma))
    return [run_one(kind, args, seed, pair, train_batches, held_out) for kind in args.kinds]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"planted: D={args.d_in}, atoms {args.shared} shared, {args.b_only} B-only, {args.a_only} A-only, "
          f"{args.scaled} scaled x{args.scale} in A, {args.rotated} rotated {args.angle:g} deg; code magnitudes "
          f"{'log-normal sigma ' + str(args.coef_sigma) if args.coef_sigma > 0 else 'U[0.5, 1.5]'}; "
          f"L={args.latents}, k={args.k}, {args.steps} steps x {args.batch_size}; seeds {args.seeds}")
    print(f"{'seed':<5}{'crosscoder':<20}{'read by':<16}{'prec':>6}{'recall':>7}{'pred':>6}  "
          f"{'misattributed (by atom kind)':<34}{'shared ok':>9}  prec/base  fvu    l0   train s")
    results = []
    for seed in args.seeds:
        runs = run_seed(args, seed)
        base = runs[0]["delta"]
        for res in runs:
            for name in ("delta", "latent_scaling"):
                sc = res[name]
                ratio = sc["precision"] / base["precision"] if base["precision"] else math.nan
                res[name]["precision_over_baseline"] = ratio
                print(f"{seed:<5}{res['kind']:<20}{name:<16}{_fmt(sc['precision']):>6}{_fmt(sc['recall']):>7}"
                      f"{sc['n_predicted']:>6}  {json.dumps(sc['misattributed']):<34}"
                      f"{_fmt(sc['shared_tagged_shared']):>9}  {_fmt(ratio):>9}  {res['fvu']:.3f} {res['l0']:5.2f} "
                      f"{res['train_s']:7.1f}", flush=True)
        results += runs
    print("\nmean over seeds: B-only precision / recall as read by Latent Scaling (Delta alone), and the share of "
          "each atom kind that some latent learned (cos >= 0.9)")
    kinds = sorted({k for r in results for k in r["learned"]})
    print(f"{'crosscoder':<20}{'LS prec':>8}{'LS rec':>8}{'D prec':>8}{'D rec':>8}  " + "".join(f"{k:>9}" for k in kinds))
    for kind in args.kinds:
        rs = [r for r in results if r["kind"] == kind]
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        vals = [mean([r[n][m] for r in rs if not math.isnan(r[n][m])]) for n in ("latent_scaling", "delta")
                for m in ("precision", "recall")]
        learned = [mean([r["learned"][k] for r in rs]) for k in kinds]
        print(f"{kind:<20}" + "".join(f"{_fmt(v):>8}" for v in vals) + "  " + "".join(f"{v:>9.2f}" for v in learned))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        figures = {"args": vars(args) | {"json": str(args.json)}, "runs": results}
        args.json.write_text(json.dumps(figures, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
