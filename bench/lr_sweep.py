"""The default learning rate measured again: ``conceptdict train`` at lr = m x default on generated and real stores.

Every run is the command line a user types, ``conceptdict train --store S --latents L --k K --lr LR`` with every
other setting at its default (a setting may add flags of its own, named in SETTINGS, e.g. the bench's batch size and
length), one thread per run (OMP_NUM_THREADS=1), ``nice -n 10``, at most ``--jobs`` at once. The default lr is
1.6e-3 / sqrt(L / 4096) (TrainConfig.lr, docs/results/defaults.md). Printed per run: held-out FVU and dead fraction
(config.json's ``training.heldout_eval``, the rows training held out), the last logged training FVU, and where the
setting has ground truth, the share of planted atoms that some alive decoder direction matches at |cos| > 0.9
(recovery) and the mean over atoms of the best |cos| (a matching-free MCC-like score).

Settings (generated: ground truth known):
  whole-b4096   bench/whole_train.py's store (bench/train_step.py synthetic_batches: D 768, 16 of 1536 random unit
                atoms per row, |N(0,1)| weights, 0.1 noise), L 8192, k 32, --batch-size 4096 --tokens 393216 (96 steps)
  whole-default the same store, L 8192, k 32, the CLI's batch size and length
  planted-test  the defaults.md lr section's problem: saes.synthetic plain, 256 atoms, D 128, active 3, L 512, k 6,
                120 batches of 1024 rows imported as a store; the stopping rule picks the length
  planted-test-116  the same at the section's length, --tokens 118784 (116 steps of 1024 rows)
  planted-wide  saes.synthetic plain, 4096 atoms, D 256, active 8, L 8192, k 16, 64 batches of 1024 rows
Real (no ground truth): demo-sentences (runs/demo/store), pydocs (bench/cbm_accuracy.py's pydocs sentence store),
demo-tokens (runs/demo/store_tokens, blocks.3.hook_out of the default model).

    .venv/bin/python bench/lr_sweep.py --work /tmp/lr --main /work/main                    # every setting, m 0.25-2
    .venv/bin/python bench/lr_sweep.py --work /tmp/lr --settings planted-test --mults 0.5 1
    .venv/bin/python bench/lr_sweep.py --work /tmp/lr --settings whole-b4096 --mults 1 --train-flags warmup-steps=24 --tag wu24
    .venv/bin/python bench/lr_sweep.py --work /tmp/lr --table-only --json /tmp/lr/rows.json

A run whose output directory already holds a config.json is read, not retrained (delete it to rerun).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generators.synthetic import SyntheticSpec, planted_atoms, synthetic_batch

WHOLE_STORE = "runs/whole-train/store-d768-b4096-n98"


@dataclass(frozen=True)
class Setting:
    store: str
    """Store path relative to --main, or 'planted:<name>' for a store this script generates under --work."""
    latents: int
    k: int
    flags: tuple[str, ...] = ()
    """Flags beyond --latents/--k/--lr (the bench's batch size and length)."""
    atoms: str | None = None
    """'whole' (train_step's 1536 atoms), 'planted' (the spec's atoms) or None (no ground truth)."""
    spec: SyntheticSpec | None = field(default=None)


SETTINGS = {
    "whole-b4096": Setting(WHOLE_STORE, 8192, 32, ("--batch-size", "4096", "--tokens", "393216"), atoms="whole"),
    "whole-default": Setting(WHOLE_STORE, 8192, 32, atoms="whole"),
    "planted-test": Setting("planted:test", 512, 6, atoms="planted",
                            spec=SyntheticSpec(n_atoms=256, d=128, active=3, noise=0.02, batch_size=1024,
                                               n_batches=120, seed=0)),
    "planted-test-116": Setting("planted:test", 512, 6, ("--tokens", str(116 * 1024)), atoms="planted",
                                spec=SyntheticSpec(n_atoms=256, d=128, active=3, noise=0.02, batch_size=1024,
                                                   n_batches=120, seed=0)),
    "planted-wide": Setting("planted:wide", 8192, 16, atoms="planted",
                            spec=SyntheticSpec(n_atoms=4096, d=256, active=8, batch_size=1024, n_batches=64, seed=0)),
    "demo-sentences": Setting("runs/demo/store", 1024, 16),
    "pydocs": Setting("runs/bench/cbm-accuracy/stores/pydocs-d23128fab4d5", 1024, 16),
    "demo-tokens": Setting("runs/demo/store_tokens", 4096, 32),
}


def default_lr(latents: int) -> float:
    """TrainConfig's default: 1.6e-3 / sqrt(L / 4096)."""
    return 1.6e-3 / math.sqrt(latents / 4096)


def whole_atoms(d: int = 768) -> torch.Tensor:
    """bench/train_step.py synthetic_batches' atoms (its first draw from seed 1234), unit rows [2D, D]."""
    g = torch.Generator().manual_seed(1234)
    return torch.nn.functional.normalize(torch.randn(2 * d, d, generator=g), dim=1)


def conceptdict(*argv: str, threads: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    exe = Path(sys.executable).with_name("conceptdict")
    done = subprocess.run(["nice", "-n", "10", str(exe), *argv], check=False, capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"conceptdict {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def planted_store(setting: Setting, work: Path) -> Path:
    """The setting's rows imported as a store under --work (made once)."""
    name = setting.store.split(":", 1)[1]
    store = work / f"store-{name}"
    if (store / "manifest.json").exists():
        return store
    spec = setting.spec
    atoms = planted_atoms(spec)
    rows = torch.cat([synthetic_batch(spec, i, atoms) for i in range(spec.n_batches)]).numpy().astype(np.float32)
    npy = work / f"rows-{name}.npy"
    np.save(npy, rows)
    conceptdict("store", "import", str(npy), "--out", str(store), "--overwrite")
    npy.unlink()
    return store


def store_path(setting: Setting, args: argparse.Namespace) -> Path:
    if setting.store.startswith("planted:"):
        return planted_store(setting, args.work)
    return args.main / setting.store


def recovery(out: Path, setting: Setting) -> dict:
    """Recovery at |cos| > 0.9 and mean best |cos| of the planted atoms, over the decoder directions that fired on
    the held-out rows (the dictionary's own held-out eval names the alive share)."""
    from conceptdict.saes import load_dictionary

    model = load_dictionary(out)
    atoms = whole_atoms() if setting.atoms == "whole" else planted_atoms(setting.spec)
    d = model.decoder_directions().detach().float()
    d = d / d.norm(dim=1, keepdim=True).clamp_min(1e-12)
    best = torch.full((atoms.shape[0],), 0.0)
    for c in range(0, d.shape[0], 4096):
        best = torch.maximum(best, (atoms @ d[c:c + 4096].T).abs().max(dim=1).values)
    return {"recovery": float((best > 0.9).float().mean()), "mean_best_cos": float(best.mean())}


def read_run(out: Path, setting: Setting) -> dict:
    cfg = json.loads((out / "config.json").read_text())["training"]
    ev = cfg["heldout_eval"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(m["step"], round(m["fvu"], 4)) for m in logged if "fvu" in m and "step" in m]
    row = {"lr": cfg["resolved"]["lr"], "steps": cfg["steps"], "batch_size": cfg["config"]["batch_size"],
           "warmup_steps": cfg["resolved"]["warmup_steps"], "heldout_fvu": ev["fvu"], "dead": ev["dead_fraction"],
           "heldout_rows": ev["n_tokens"], "l0": ev["l0"], "train_fvu_last": curve[-1][1] if curve else None,
           "train_fvu_min": min(f for _, f in curve) if curve else None, "curve": curve}
    if setting.atoms:
        row.update(recovery(out, setting))
    return row


def run_one(name: str, m: float, args: argparse.Namespace) -> dict:
    setting = SETTINGS[name]
    out = args.work / f"{name}-m{m:g}{'-' + args.tag if args.tag else ''}"
    lr = m * default_lr(setting.latents)
    started = time.time()
    if not (out / "config.json").exists():
        if args.table_only:
            return {"setting": name, "m": m, "tag": args.tag, "missing": True}
        store = store_path(setting, args)
        extra = list(setting.flags)
        for flag in args.train_flags:
            name_, eq, value = flag.partition("=")
            if not eq:
                raise SystemExit(f"--train-flags {flag!r}: write FLAG=VALUE, e.g. warmup-steps=24")
            extra += [f"--{name_.lstrip('-')}", value]
        conceptdict("train", "--store", str(store), "--out", str(out), "--latents", str(setting.latents),
                    "--k", str(setting.k), "--lr", repr(lr), "--log-every", "8", "--checkpoint-every", "0",
                    "--overwrite", *extra)
    row = {"setting": name, "m": m, "tag": args.tag, **read_run(out, setting), "wall_s": round(time.time() - started)}
    print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    return row


def fmt(row: dict) -> str:
    if row.get("missing"):
        return f"| {row['setting']} | {row['m']:g} | not run | | | | | |"
    rec = f"{row['recovery']:.1%} / {row['mean_best_cos']:.3f}" if "recovery" in row else "-"
    return (f"| {row['setting']}{' ' + row['tag'] if row['tag'] else ''} | {row['m']:g} ({row['lr']:.3g}) | "
            f"{row['steps']} x {row['batch_size']} | {row['heldout_rows']} | {row['heldout_fvu']:.4f} | "
            f"{row['dead']:.1%} | "
            f"{row['train_fvu_min']:.4f} / {row['train_fvu_last']:.4f} | {rec} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for generated stores and the trained runs")
    p.add_argument("--main", type=Path, default=Path("."), help="checkout whose runs/ holds the real stores")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--mults", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0], help="lr = m x default")
    p.add_argument("--train-flags", nargs="*", default=[], metavar="FLAG=VALUE",
                   help="more train flags, e.g. warmup-steps=24 code-l1=0 (with --tag: they change the setting)")
    p.add_argument("--tag", default="", help="suffix of the run folders (e.g. wu24 with warmup-steps=24)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    p.add_argument("--table-only", action="store_true", help="read finished runs, train nothing")
    p.add_argument("--json", type=Path, help="write every row (with its logged training-FVU curve) here")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.main = args.main.resolve()
    for name in args.settings:  # stores first, one at a time
        if SETTINGS[name].store.startswith("planted:") and not args.table_only:
            planted_store(SETTINGS[name], args.work)
    jobs = [(n, m) for n in args.settings for m in args.mults]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: run_one(*job, args), jobs))
    print("| setting | m (lr) | steps x B | held-out rows | held-out FVU | dead | train FVU min / last | recovery / mean best cos |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(fmt(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
