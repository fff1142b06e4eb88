"""Synthetic ground-truth benchmark: how many planted atoms does each dictionary kind recover, and how well?

Data (``generators.synthetic``): unit atoms in D dimensions, rows that are sparse positive combinations
of them plus an offset and noise. The settings below go from the easy problem to what real activations look
like -- heavy-tailed (log-normal) coefficients so row norms vary by an order of magnitude, heavy-tailed row
scales, Zipf-like atom frequencies, correlated atoms -- always with more latents than atoms -- and a
hierarchical set (``hierarchy``: families of a parent and 3 children, a child only ever active with its
parent), on which the run also prints how often the parent's latent is silent on rows that hold one of its
children (feature absorption, Chanin et al. 2024: what Matryoshka's nested losses are meant to prevent). Every kind
trains with its DEFAULT settings (only latents, k and the row budget given) on the same rows of each
setting and seed, and is evaluated on held-out rows.

Each dictionary trains with seed ``synthetic.spec.seed``, not the data's seed: with the data's seed its
initial decoder would already hold the atoms (the recovery by the initial decoder is printed per setting; it
must be about 0; a kind that initialises from the data, spade, also prints the recovery of the dictionary it
starts from, one step at lr 1e-12). Printed per run: atom recovery (share of atoms with a decoder direction at |cos| > 0.9), mean
best cosine, held-out FVU, inference L0, dead fraction (no firing on the held-out rows), the alive latents that match no
atom and their share of the firings (what the latents beyond the atoms do), wall time; and recovery and FVU
as ratios to the BASELINE of the same setting and seed, measured in the same invocation: the first of --kinds.
The closing table has one line per setting and kind (mean over seeds, worst seed in brackets).

    .venv/bin/python bench/synthetic_recovery.py --json out.json              # all settings, 2 seeds
    .venv/bin/python bench/synthetic_recovery.py --settings heavy --seeds 0 1 2 --kinds topk batchtopk
    .venv/bin/python bench/synthetic_recovery.py --kinds topk batchtopk jumprelu matryoshka spade
    .venv/bin/python bench/synthetic_recovery.py --settings plain --coef-sigma 1.5 --batches 600   # overrides
    .venv/bin/python bench/synthetic_recovery.py --small --batches 200 --kinds matryoshka \\
        matryoshka:matryoshka_inner_weight=1.0 batchtopk            # a kind with its own TrainConfig fields
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import time

import torch

from conceptdict.saes import TrainConfig, train, train_config
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes import SparseCoder
from conceptdict.saes.model import kind_spec
from generators.synthetic import (SyntheticSpec, absorption, atom_recovery, planted_atoms,
                                        synthetic_batch_and_atoms, synthetic_batches)

BASE = dict(n_atoms=1024, d=128, active=6.0, noise=0.02)
SETTINGS: dict[str, dict] = {
    "plain": {},
    "heavy": dict(coef_sigma=1.0),
    "heavy-rows": dict(coef_sigma=0.8, row_sigma=0.5),
    "zipf-corr": dict(coef_sigma=1.0, freq_exponent=0.5, correlated=0.1, correlation=0.5),
    "hierarchy": dict(coef_sigma=0.5, children=3, child_prob=0.5),
}
"""Generator settings (fields of SyntheticSpec) over BASE; the command line overrides any field."""

FIELDS = ("n_atoms", "d", "active", "noise", "coef_sigma", "row_sigma", "freq_exponent", "correlated", "correlation",
          "children", "child_prob")


def unmatched_alive(model, spec: SyntheticSpec, fired: torch.Tensor) -> tuple[int, float]:
    """Latents that fire on the held-out rows (``fired``, bool [N, L]) without matching any atom (|cos| <= 0.9), and
    their share of all firings there: what the latents beyond the atoms do when they are not dead."""
    d = model.decoder_directions().reshape(model.n_latents, -1)
    best = (d / d.norm(dim=1, keepdim=True).clamp_min(1e-12) @ planted_atoms(spec).T).abs().max(dim=1).values
    counts = fired.sum(dim=0)
    unmatched = best <= 0.9
    return int(((counts > 0) & unmatched).sum()), float(counts[unmatched].sum() / counts.sum().clamp_min(1))


def recovery_at_init(spec: SyntheticSpec, cfg: TrainConfig) -> float:
    """Atom recovery of the untrained decoder ``train`` starts from (about 0 unless the seeds collide)."""
    model = SparseCoder(spec.d, cfg.latents, cfg.k, cfg.kind)
    model.reset_parameters(generator=torch.Generator().manual_seed(cfg.seed))
    return atom_recovery(model.decoder_directions(), planted_atoms(spec)).fraction


def recovery_at_start(spec: SyntheticSpec, cfg: TrainConfig) -> float | None:
    """Atom recovery of the dictionary a kind with a data-dependent initialisation (spade: prototypes at data rows)
    starts from: one step at lr 1e-12; None for kinds whose start is :func:`recovery_at_init`'s."""
    if kind_spec(cfg.kind).init is None:
        return None
    probe = dataclasses.replace(cfg, lr=1e-12, tokens=spec.batch_size)
    return atom_recovery(train(probe, functools.partial(synthetic_batches, spec)).decoder_directions(),
                         planted_atoms(spec)).fraction


def run_one(spec: SyntheticSpec, cfg: TrainConfig) -> dict:
    start = recovery_at_start(spec, cfg)
    t0 = time.perf_counter()
    model = train(cfg, functools.partial(synthetic_batches, spec))
    seconds = time.perf_counter() - t0
    rec = atom_recovery(model.decoder_directions(), planted_atoms(spec))
    held = model.training_summary["heldout_eval"]
    rows = [synthetic_batch_and_atoms(spec, i) for i in range(cfg.eval_batches)]  # the held-out batches
    with torch.no_grad():
        fired = torch.cat([model.encode(x) > 0 for x, _ in rows])
    n_unmatched, share = unmatched_alive(model, spec, fired)
    absorbed = None
    if spec.children:
        absorbed = absorption(spec, model.decoder_directions(), fired, torch.cat([m for _, m in rows]))._asdict()
    return {"kind": cfg.kind, "seed": spec.seed, "recovery": rec.fraction, "mean_best_cos": rec.mean_best_cos,
            "fvu": held["fvu"], "l0": held["l0"], "k": cfg.k, "dead": held["dead_fraction"], "seconds": seconds,
            "unmatched_alive": n_unmatched, "unmatched_firing_share": share, "at_start": start,
            "absorption": absorbed}


KIND_CHOICES = ("topk", "batchtopk", "batchtopk-absolute", "relu", "jumprelu", "jumprelu-relative", "matryoshka",
                "matryoshka-absolute", "spade")


def kind_variant(label: str) -> tuple[str, dict]:
    """'KIND[:FIELD=VALUE,...]' -> (kind, TrainConfig overrides)."""
    kind, _, fields = label.partition(":")
    if kind not in KIND_CHOICES:
        raise SystemExit(f"--kinds {label!r}: unknown kind {kind!r}; choose from {', '.join(KIND_CHOICES)}")
    return kind, overrides(fields.split(",") if fields else [])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--kinds", nargs="+", default=["topk", "batchtopk"], metavar="KIND[:FIELD=VALUE,...]",
                   help=f"kinds of {', '.join(KIND_CHOICES)}; a kind may carry its own TrainConfig fields, e.g. "
                        "matryoshka:matryoshka_inner_weight=0.25 (a separate line of the table)")
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
        p.add_argument("--" + f.replace("_", "-"), type=int if f in ("n_atoms", "d", "children") else float,
                       default=None,
                       help=f"override SyntheticSpec.{f} in every setting")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="TrainConfig fields for every run (a JSON value: --set matryoshka_inner_weight=0.25)")
    p.add_argument("--match-l0", action="store_true",
                   help="after every jumprelu run, also train batchtopk with k = its held-out L0 (rounded), shown as "
                        "'batchtopk@KIND': the comparison at the same L0 (one run per k and setting, shared)")
    p.add_argument("--json", type=str, default=None, help="also write the figures here")
    return p.parse_args(argv)


def overrides(pairs: list[str]) -> dict:
    """--set FIELD=VALUE pairs -> TrainConfig keyword arguments (VALUE parsed as JSON, else kept as a string)."""
    out = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. matryoshka_inner_weight=0.25")
        try:
            out[field] = json.loads(value)
        except json.JSONDecodeError:
            out[field] = value
    return out


def spec_for(a, setting: str, seed: int) -> SyntheticSpec:
    fields = dict(BASE, **SETTINGS[setting])
    if a.small:
        fields.update(n_atoms=256, d=128, active=3.0)
        a.k = 6
    fields.update({f: getattr(a, f) for f in FIELDS if getattr(a, f) is not None})
    return SyntheticSpec(**fields, batch_size=a.batch_size, n_batches=a.batches, seed=seed)


def summary(results: list[dict], settings: list[str], kinds: list[str]) -> list[str]:
    lines = [f"{'setting':<12}{'kind':<40}{'recovery':>16}{'fvu':>16}{'l0':>8}{'dead':>16}"]
    for s in settings:
        for kind in kinds:
            rs = [r for r in results if r["setting"] == s and r["label"] == kind]
            if not rs:
                continue
            rec = [r["recovery"] for r in rs]
            fvu = [r["fvu"] for r in rs]
            dead = [r["dead"] for r in rs]
            lines.append(f"{s:<12}{kind:<40}{statistics.mean(rec):>8.1%} [{min(rec):5.1%}]"
                         f"{statistics.mean(fvu):>8.3f} [{max(fvu):.3f}]{statistics.mean(r['l0'] for r in rs):>8.2f}"
                         f"{statistics.mean(dead):>8.1%} [{max(dead):5.1%}]  k {'/'.join(str(r['k']) for r in rs)}")
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
            init = recovery_at_init(spec, TrainConfig(latents=L, k=a.k, seed=spec.seed))
            print(f"[{setting}, seed {seed}] {dataclasses.asdict(spec)}; L={L}, k={a.k}; training seed "
                  f"{spec.seed}, recovery by the initial decoder {init:.1%}", flush=True)
            base = None
            trained: dict[int, dict] = {}  # batchtopk runs at the same L0, by k (two kinds may match one run)
            todo = [(label, *kind_variant(label), a.k) for label in a.kinds]
            while todo:
                label, kind, extra, k = todo.pop(0)
                # --set applies to the kinds that read each field, a kind's own FIELD=VALUE to it alone
                shared = dict(latents=L, k=k, kind=kind, tokens=(a.batches - a.eval_batches - 2) * a.batch_size,
                              eval_batches=a.eval_batches, log_every=10**9, checkpoint_every=0,
                              kernel_impl=a.kernel_impl, seed=spec.seed, **overrides(a.set))
                cfg = train_config(**{**flat_for_kind(shared, kind), **extra})
                matched = label.startswith("batchtopk@") and trained.get(k)
                r = dict(matched or run_one(spec, cfg), setting=setting, label=label)
                results.append(r)
                if label.startswith("batchtopk@"):
                    trained[k] = r
                if a.match_l0 and kind.startswith("jumprelu"):
                    todo.insert(0, (f"batchtopk@{label}", "batchtopk", {}, max(1, round(r["l0"]))))
                base = base or r
                ratio = f"x{r['recovery'] / base['recovery']:.2f}" if base["recovery"] else "n/a"
                print(f"  {label:<11} k {k:<3} recovery {r['recovery']:6.1%}  cos {r['mean_best_cos']:.3f}  "
                      f"fvu {r['fvu']:.4f}  "
                      f"l0 {r['l0']:6.2f}  dead {r['dead']:6.2%}  unmatched alive {r['unmatched_alive']} "
                      f"({r['unmatched_firing_share']:.1%} of firings)  {r['seconds']:6.1f}s  "
                      + (f"recovery at its start {r['at_start']:.1%}  " if r["at_start"] is not None else "")
                      + (f"parents {r['absorption']['parent_recovery']:.1%} children "
                         f"{r['absorption']['child_recovery']:.1%} absorbed {r['absorption']['absorbed']:.1%} "
                         f"(alone: silent {r['absorption']['missed']:.1%})  " if r.get("absorption") else "")
                      + f"[vs {a.kinds[0]}: recovery {ratio}, fvu x{r['fvu'] / base['fvu']:.2f}]", flush=True)
    labels = list(dict.fromkeys(r["label"] for r in results))
    print("\n".join(["", "mean over seeds [worst seed]:", *summary(results, a.settings, labels)]))
    for label in labels:
        ab = [r["absorption"] for r in results if r["label"] == label and r.get("absorption")]
        if ab:
            mean = {f: statistics.mean(x[f] for x in ab) for f in ab[0]}
            print(f"hierarchy   {label:<40} parents {mean['parent_recovery']:.1%}  children "
                  f"{mean['child_recovery']:.1%}  absorbed {mean['absorbed']:.1%} (silent without a child "
                  f"{mean['missed']:.1%})")
    for label in (lb for lb in labels if lb.startswith("batchtopk@")):
        kind = label.split("@", 1)[1]
        for setting in a.settings:
            mine = [r["recovery"] for r in results if r["setting"] == setting and r["label"] == kind]
            theirs = [r["recovery"] for r in results if r["setting"] == setting and r["label"] == label]
            if mine and theirs:
                diff = statistics.mean(mine) - statistics.mean(theirs)
                print(f"{setting:<12}{kind} - batchtopk at its L0: {100 * diff:+.1f} points of recovery "
                      f"({'at least as many' if diff >= 0 else 'FEWER'})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"base": BASE, "settings": SETTINGS, "args": vars(a), "runs": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
