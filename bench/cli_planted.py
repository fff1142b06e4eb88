"""Planted atoms as a new user meets them: a generator of its own, an .npy file, and the command line.

``bench/synthetic_recovery.py`` trains in-process on ``generators.synthetic``, the generator the defaults
were tuned on. This benchmark shares neither: its generator is written here in numpy, from the description of the
problem that first showed BatchTopK lagging (issue 11: unit atoms, log-normal coefficients so row norms vary by an
order of magnitude, some atoms that fire together and some whose directions are close, skewed atom frequencies,
small noise, more latents than atoms), with its own choices where that description is silent: each atom fires
independently with its own probability (so the number of atoms per row varies), the frequencies follow a power
law, partners fire with their atom, and a constant offset is added. The rows go through ``conceptdict store
import`` and ``conceptdict train --kind K --latents L --k K --tokens N`` exactly as a user would run them, and
the saved dictionary is read back with ``conceptdict.saes.load_dictionary``.

Printed per kind: atom recovery (share of atoms with a decoder direction at |cos| > 0.9), the same for the atoms
that fire rarely (the least frequent fifth) and for the atoms with a close partner, held-out FVU and L0 of the
dictionary's own inference rule on rows it never saw, the dead fraction (no firing on those rows), wall time,
and recovery and FVU as ratios to the first kind of --kinds, measured in the same invocation.

    .venv/bin/python bench/cli_planted.py                                   # topk batchtopk, seed 0
    .venv/bin/python bench/cli_planted.py --kinds topk batchtopk matryoshka jumprelu-relative --seeds 0 1
    .venv/bin/python bench/cli_planted.py --atoms 2048 --d 256 --latents 4096 --k 16 --tokens 2000000
    .venv/bin/python bench/cli_planted.py --store-rows 200000 --tokens 0   # a small store, train's default length
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit norm (zero rows stay zero)."""
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def unit_atoms(g: np.random.Generator, n: int, d: int) -> np.ndarray:
    """n random unit atoms in d dimensions [n, d]."""
    atoms = g.standard_normal((n, d))
    return atoms / np.linalg.norm(atoms, axis=1, keepdims=True)


def power_law(g: np.random.Generator, n: int, args: argparse.Namespace) -> np.ndarray:
    """Each atom's firing probability: (1 + rank)^-freq_exponent in a random rank order, scaled so that a row
    holds ``active`` atoms on average, at most 0.5."""
    rank = g.permutation(n)  # the frequency order is independent of the atoms' index
    probs = (1.0 + rank) ** -args.freq_exponent
    return np.minimum(probs * (args.active / probs.sum()), 0.5)


def generate(n_rows: int, args: argparse.Namespace, seed: int, atoms_and_probs=None):
    """Rows [n_rows, d] float32, the unit atoms [atoms, d], each atom's firing probability, and the two marked
    subsets (rare atoms, atoms with a close partner). The atoms and probabilities depend on ``seed`` only, so the
    training and held-out rows share them; pass them back in to draw more rows."""
    if atoms_and_probs is None:
        g = np.random.default_rng(10_000 + seed)
        n, d = args.atoms, args.d
        atoms = unit_atoms(g, n, d)
        # close pairs: atom 2i+1 of the first `close` pairs is moved towards atom 2i until their cosine is args.close_cos
        n_close = int(args.close_share * n) // 2
        for i in range(n_close):
            a, b = atoms[2 * i], atoms[2 * i + 1]
            b = b - (b @ a) * a
            b /= np.linalg.norm(b)
            atoms[2 * i + 1] = args.close_cos * a + np.sqrt(1 - args.close_cos ** 2) * b
        probs = power_law(g, n, args)
        # co-firing partners: the last `cofire` atoms each follow one other atom (fire with it with prob 0.5)
        n_co = int(args.cofire_share * n)
        leaders = g.choice(n - n_co, size=n_co, replace=False)
        offset = g.standard_normal(d) * args.offset / np.sqrt(d)
        rare = np.argsort(probs)[: n // 5]
        close = np.arange(2 * n_close)
        atoms_and_probs = (atoms.astype(np.float32), probs, leaders, offset, rare, close)
    atoms, probs, leaders, offset, rare, close = atoms_and_probs
    n, d = atoms.shape
    n_co = len(leaders)
    g = np.random.default_rng([seed, n_rows, 7])
    rows = np.empty((n_rows, d), dtype=np.float32)
    for start in range(0, n_rows, 8192):
        m = min(8192, n_rows - start)
        fire = g.random((m, n)) < probs
        follow = fire[:, leaders] & (g.random((m, n_co)) < 0.5)
        fire[:, n - n_co:] = follow
        coef = np.exp(args.coef_sigma * g.standard_normal((m, n))) * fire
        x = coef.astype(np.float32) @ atoms
        x += offset.astype(np.float32)
        x += (args.noise * g.standard_normal((m, d))).astype(np.float32)
        rows[start:start + m] = x
    return rows, atoms_and_probs


PAIR_KINDS = ("shared", "b_only", "a_only", "scaled", "rotated")


def generate_pair(n_rows: int, args: argparse.Namespace, seed: int, pair=None):
    """Two "models" reading the same codes through their own atoms: rows A and B [n_rows, d] float32, and the
    atoms (A's and B's, [atoms, d], zero rows where a model lacks the atom) with each atom's category. Shares of
    the categories: --pair-shares (shared, B-only, A-only, scaled down in A by --scale, rotated in A by --angle
    degrees). Codes: each atom fires with its own power-law probability and a log-normal coefficient, as in
    :func:`generate`; the categories are assigned at random, so frequencies do not depend on them."""
    if pair is None:
        g = np.random.default_rng(20_000 + seed)
        n, d = args.atoms, args.d
        atoms = unit_atoms(g, n, d)
        counts = [int(round(share * n)) for share in args.pair_shares]
        counts[0] += n - sum(counts)
        kinds = np.array(sum(([kind] * c for kind, c in zip(PAIR_KINDS, counts)), []))
        kinds = kinds[g.permutation(n)]
        a, b = atoms.copy(), atoms.copy()
        a[kinds == "b_only"] = 0.0
        b[kinds == "a_only"] = 0.0
        a[kinds == "scaled"] *= args.scale
        angle = np.deg2rad(args.angle)
        for i in np.flatnonzero(kinds == "rotated"):
            u = g.standard_normal(d)
            u -= (u @ atoms[i]) * atoms[i]
            a[i] = np.cos(angle) * atoms[i] + np.sin(angle) * u / np.linalg.norm(u)
        probs = power_law(g, n, args)
        offsets = g.standard_normal((2, d)) * args.offset / np.sqrt(d)
        pair = (a.astype(np.float32), b.astype(np.float32), kinds, probs, offsets)
    a, b, kinds, probs, offsets = pair
    n, d = a.shape
    g = np.random.default_rng([seed, n_rows, 11])
    rows = [np.empty((n_rows, d), dtype=np.float32) for _ in range(2)]
    for start in range(0, n_rows, 8192):
        m = min(8192, n_rows - start)
        coef = (np.exp(args.coef_sigma * g.standard_normal((m, n))) * (g.random((m, n)) < probs)).astype(np.float32)
        for out, atoms, offset in zip(rows, (a, b), offsets):
            out[start:start + m] = coef @ atoms + offset + (args.noise * g.standard_normal((m, d))).astype(np.float32)
    return rows, pair


def score_diff(out: Path, pair) -> dict:
    """B-only precision and recall of ``conceptdict diff``'s output at ``out`` (the Delta tag, and Latent
    Scaling's model_specific flag), and the share of each atom category some latent learned (|cos| > 0.9 on the
    model that has it, B's decoder except for A-only atoms)."""
    from conceptdict.saes import load_dictionary
    a, b, kinds, _, _ = pair
    records = json.loads((out / "diff.json").read_text())["latents"]
    dirs = load_dictionary(out / "crosscoder").decoder_directions().numpy()  # [L, 2, D]

    cos_b, cos_a = (np.abs(unit_rows(dirs[:, s]) @ unit_rows(atoms).T) for s, atoms in ((1, b), (0, a)))  # [L, atoms]
    learned = {kind: float((np.where(kind == "a_only", cos_a, cos_b)[:, kinds == kind].max(0) > 0.9).mean())
               for kind in PAIR_KINDS if (kinds == kind).any()}
    b_only = np.flatnonzero(kinds == "b_only")
    res = dict(learned=learned)
    for name, pick in (("tag", lambda r: r["tag"] == "B-only"), ("ls", lambda r: bool(r.get("model_specific")))):
        predicted = [r["latent"] for r in records if pick(r)]
        best = cos_b[predicted].argmax(1) if predicted else np.array([], dtype=int)
        hits = [int(atom) for j, atom in zip(predicted, best) if cos_b[j, atom] > 0.9 and kinds[atom] == "b_only"]
        res[name] = dict(n=len(predicted), precision=len(hits) / len(predicted) if predicted else float("nan"),
                         recall=len(set(hits)) / len(b_only))
    return res


def run_diff(args: argparse.Namespace) -> list[dict]:
    """--diff: the planted pair through ``conceptdict store import`` (twice) and ``conceptdict diff``."""
    results = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="cli-diff-") as tmp:
            tmp = Path(tmp)
            rows, pair = generate_pair(args.tokens, args, seed)
            for name, r in zip("AB", rows):
                np.save(tmp / f"{name}.npy", r)
                cli("store", "import", str(tmp / f"{name}.npy"), "--out", str(tmp / f"store-{name}"))
            del rows
            for kind in args.kinds:
                out = tmp / f"diff-{kind}"
                t0 = time.perf_counter()
                cli("diff", "--store", str(tmp / "store-A"), "--store", str(tmp / "store-B"), "--out", str(out),
                    "--kind", kind, "--seed", str(seed), *extra_flags(args))
                r = dict(kind=kind, seed=seed, seconds=time.perf_counter() - t0, **score_diff(out, pair))
                results.append(r)
                print(f"seed {seed} {kind:20s} B-only by Delta: precision {r['tag']['precision']:.2f} recall "
                      f"{r['tag']['recall']:.2f} ({r['tag']['n']} latents); by Latent Scaling: precision "
                      f"{r['ls']['precision']:.2f} recall {r['ls']['recall']:.2f}; learned "
                      + " / ".join(f"{k} {v:.2f}" for k, v in r["learned"].items()) + f"  {r['seconds']:.0f}s",
                      flush=True)
    print("\nmean over seeds:")
    for kind in args.kinds:
        rs = [r for r in results if r["kind"] == kind]
        mean = lambda f: float(np.mean([f(r) for r in rs]))  # noqa: E731
        print(f"  {kind:20s} Delta P {mean(lambda r: r['tag']['precision']):.2f} R {mean(lambda r: r['tag']['recall']):.2f}"
              f" | LS P {mean(lambda r: r['ls']['precision']):.2f} R {mean(lambda r: r['ls']['recall']):.2f} | learned "
              + " / ".join(f"{k} {mean(lambda r: r['learned'][k]):.2f}" for k in rs[0]["learned"]))
    return results


def recovery(directions: np.ndarray, atoms: np.ndarray, subset=None) -> float:
    """Share of the (unit) atoms, or of ``subset`` of them, that some decoder direction matches at |cos| > 0.9."""
    best = np.abs(atoms @ unit_rows(directions).T).max(axis=1)
    if subset is not None:
        best = best[subset]
    return float((best > 0.9).mean())


def extra_flags(args: argparse.Namespace) -> list[str]:
    """--flags FLAG=VALUE ... as command-line arguments."""
    out = []
    for flag in args.flags:
        name, _, value = flag.partition("=")
        out += [f"--{name}", value] if value else [f"--{name}"]
    return out


def cli(*argv: str) -> None:
    cmd = [str(Path(sys.executable).parent / "conceptdict"), *argv]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def evaluate_dir(out: Path, held: np.ndarray, atoms_and_probs) -> dict:
    from conceptdict.saes import load_dictionary
    model = load_dictionary(out)
    atoms, _, _, _, rare, close = atoms_and_probs
    x = torch.from_numpy(held)
    fired = torch.zeros(model.n_latents, dtype=torch.bool)
    err = tot = l0 = 0.0
    mean = x.mean(0)
    with torch.no_grad():
        for chunk in x.split(4096):
            dense = model.encode(chunk)
            recon = model.decode(dense)
            fired |= (dense > 0).any(0)
            l0 += float((dense > 0).sum())
            err += float(((recon - chunk) ** 2).sum())
            tot += float(((chunk - mean) ** 2).sum())
    dirs = model.decoder_directions().reshape(model.n_latents, -1).numpy()
    return dict(recovery=recovery(dirs, atoms), rare=recovery(dirs, atoms, rare),
                close=recovery(dirs, atoms, close) if len(close) else float("nan"),
                fvu=err / tot, l0=l0 / len(held), dead=1.0 - float(fired.float().mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=None,
                   help="first one is the baseline; default topk batchtopk (--diff: crosscoder)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--atoms", type=int, default=768)
    p.add_argument("--d", type=int, default=96)
    p.add_argument("--latents", type=int, default=1536)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--active", type=float, default=6.0, help="expected atoms per row")
    p.add_argument("--coef-sigma", type=float, default=1.0, help="log-normal sigma of the coefficients")
    p.add_argument("--freq-exponent", type=float, default=0.7, help="atom frequency ~ (1 + rank)^-exponent")
    p.add_argument("--cofire-share", type=float, default=0.1, help="share of atoms that follow another atom")
    p.add_argument("--close-share", type=float, default=0.1, help="share of atoms in pairs at cosine --close-cos")
    p.add_argument("--close-cos", type=float, default=0.5)
    p.add_argument("--noise", type=float, default=0.03)
    p.add_argument("--offset", type=float, default=3.0, help="norm of the constant offset added to every row")
    p.add_argument("--tokens", type=int, default=400_000,
                   help="training rows (conceptdict train --tokens); 0: the command's default length")
    p.add_argument("--store-rows", type=int, default=None,
                   help="rows in the store (default: --tokens): a smaller store is read several times")
    p.add_argument("--held-out", type=int, default=16_384)
    p.add_argument("--threads", type=int, default=0, help="torch threads of each training process (0: torch's)")
    p.add_argument("--json", type=Path)
    p.add_argument("--diff", action="store_true",
                   help="a planted pair of models through `conceptdict diff` instead (--kinds: crosscoder kinds; "
                        "--tokens: rows per store, trained as diff does by default: one pass)")
    p.add_argument("--pair-shares", type=float, nargs=5, default=[0.5, 0.125, 0.125, 0.125, 0.125],
                   help="--diff: shares of shared, B-only, A-only, scaled-in-A and rotated-in-A atoms")
    p.add_argument("--scale", type=float, default=0.3, help="--diff: factor of the scaled atoms in A")
    p.add_argument("--angle", type=float, default=60.0, help="--diff: rotation of the rotated atoms in A (degrees)")
    p.add_argument("--flags", nargs="*", default=[], metavar="FLAG=VALUE",
                   help="extra flags of conceptdict train (or diff), without the dashes (e.g. batch-size=1024)")
    args = p.parse_args()

    env_threads = {} if not args.threads else {"OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env_threads)
    if args.kinds is None:
        args.kinds = ["crosscoder"] if args.diff else ["topk", "batchtopk"]
    if args.diff:
        results = run_diff(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    results = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="cli-planted-") as tmp:
            tmp = Path(tmp)
            store_rows = args.store_rows or args.tokens
            rows, ap = generate(store_rows, args, seed)
            held, _ = generate(args.held_out, args, seed + 1_000_000, ap)
            np.save(tmp / "rows.npy", rows)
            del rows
            cli("store", "import", str(tmp / "rows.npy"), "--out", str(tmp / "store"))
            norms = np.linalg.norm(held - held.mean(0), axis=1)
            print(f"seed {seed}: {args.atoms} atoms in D={args.d}, L={args.latents}, k={args.k}, "
                  f"{store_rows} rows in the store, --tokens {args.tokens or 'default'}; "
                  f"held-out row norms p10/p50/p90 "
                  f"{np.percentile(norms, 10):.2f}/{np.percentile(norms, 50):.2f}/{np.percentile(norms, 90):.2f}",
                  flush=True)
            base = None
            for kind in args.kinds:
                out = tmp / f"dict-{kind}"
                t0 = time.perf_counter()
                cli("train", "--store", str(tmp / "store"), "--out", str(out), "--kind", kind,
                    "--latents", str(args.latents), "--k", str(args.k),
                    *(["--tokens", str(args.tokens)] if args.tokens else []), "--seed", str(seed), *extra_flags(args))
                run = json.loads((out / "train_config.json").read_text())["train"]
                done = json.loads((out / "config.json").read_text())["training"]  # the stopping rule may end early
                rule = done.get("stopping") or {}
                r = dict(kind=kind, seed=seed, seconds=time.perf_counter() - t0, batch=run["batch_size"],
                         steps=done["steps"], upper_bound=run["tokens"] // run["batch_size"],
                         fired_at=rule.get("fired_at"), back_to=rule.get("back_to"),
                         rise=rule["history"][-1][1] / rule["low"] - 1 if rule.get("fired_at") is not None else None,
                         **evaluate_dir(out, held, ap))
                base = base or r
                results.append(r)
                went = (f", fired at {r['fired_at']} {r['rise']:+.1%} above the lowest held-out FVU"
                        if r["fired_at"] is not None else "") + (f", back to {r['back_to']}" if r["back_to"] else "")
                print(f"  {kind:18s} {r['steps']} steps (of at most {r['upper_bound']}{went}) of {r['batch']}: "
                      f"recovery {r['recovery']:.1%} (rare {r['rare']:.1%}, close {r['close']:.1%})  "
                      f"FVU {r['fvu']:.3f}  L0 {r['l0']:.2f}  dead {r['dead']:.1%}  {r['seconds']:.0f}s  "
                      f"x{r['recovery'] / max(base['recovery'], 1e-9):.3f} recovery, "
                      f"x{r['fvu'] / base['fvu']:.3f} FVU vs {base['kind']}", flush=True)
    print("\nmean over seeds:")
    for kind in args.kinds:
        rs = [r for r in results if r["kind"] == kind]
        m = {f: float(np.mean([r[f] for r in rs])) for f in ("recovery", "rare", "close", "fvu", "l0", "dead")}
        print(f"  {kind:18s} recovery {m['recovery']:.1%} (rare {m['rare']:.1%}, close {m['close']:.1%})  "
              f"FVU {m['fvu']:.3f}  L0 {m['l0']:.2f}  dead {m['dead']:.1%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
