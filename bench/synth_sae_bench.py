"""SynthSAEBench (sae-lens' synthetic benchmark) for every kind: conceptdict at the CLI's defaults against SAELens'
own trainers, on the same samples, scored by sae-lens' own metrics.

Per scale and seed: ``bench/synth_sae_side.py world`` (in the side venv ``.venv-synth``: torch + sae-lens >= 6.54)
builds a world with sae-lens' own generator (``SyntheticModel``: the published SynthSAEBench-16k recipe --
hierarchy, correlated Zipf firing, magnitudes -- with features, hidden width, SAE width and hierarchy roots divided
by the scale) and writes its training rows, held-out rows and their true feature activations; the world's k is the
recipe's rule (the true L0 of the width's most frequent features; 25 at full scale). Then, in this process:

- every conceptdict kind trains through the public API exactly as ``conceptdict store import train.npy`` +
  ``conceptdict train --store S --latents W --k K --kind KIND`` would: nothing else given, so batch, run length,
  learning rate, stopping rule and every kind setting are the CLI's defaults;
- every SAELens architecture trains with ``sae_lens.synthetic.train_toy_sae`` (the benchmark's lr 3e-4, batch 1024)
  and its own defaults (``synth_sae_side.ARCHS`` says what is set) on the same rows, for as many samples as the
  conceptdict kinds of the same architecture used (the most of them: SAELens never sees fewer);
- every dictionary is scored in the side venv by ``sae_lens.synthetic.eval_sae_on_synthetic_data`` on the same
  held-out rows: conceptdict's dictionaries through ``conceptdict export --format saelens`` where the kind exports,
  else through the codes and reconstructions conceptdict computes on those rows (with its decoder directions).

Printed: kind x scale x seed -> MCC, F1, explained variance, L0, dead latents, samples, wall time, and MCC and F1 as
ratios to SAELens' same architecture in the same run; then means over seeds per scale, and the kinds ordered by F1.
Results go to --out/results-s<scales>-seed<seeds>.json (runs of other scales or seeds can go side by side, in
parallel, and ``--table`` prints them together); worlds and dictionaries stay under --out (a world is reused when its files exist).

    python3 -m venv .venv-synth && .venv-synth/bin/pip install torch==2.13.0 "sae-lens>=6.54"
    .venv/bin/python bench/synth_sae_bench.py                                  # scales 16 and 32, seeds 0 1 2
    .venv/bin/python bench/synth_sae_bench.py --scales 16 --seeds 0 --kinds topk matryoshka --saelens topk matryoshka
    .venv/bin/python bench/synth_sae_bench.py --table runs/synth/results-*.json  # print finished runs' tables
    .venv/bin/python bench/synth_sae_bench.py --scales 16 --seeds 0 --kinds matryoshka \
        --matryoshka-inner-weights 0.03 0.3 1.0 --saelens --tag inner          # an inner-weight sweep, no SAELens

With --tag, the results file is results-s<scales>-seed<seeds>-<tag>.json and its SAELens rows show the tag in the
tables: each kind is compared with the SAELens run of its own invocation (trained for its sample count).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "synth_sae_side.py"

PAIR = {"topk": "topk", "batchtopk": "batchtopk", "batchtopk-absolute": "batchtopk", "matryoshka": "matryoshka",
        "matryoshka-absolute": "matryoshka", "jumprelu": "jumprelu", "jumprelu-relative": "jumprelu",
        "relu": "standard", "spade": None}
"""Every trainable single-source conceptdict kind -> the SAELens architecture it is compared with (None: SAELens
has none). ``gated`` is only read (from SAELens), never trained, so it is not here."""

KINDS = list(PAIR)
SAELENS = ["topk", "batchtopk", "matryoshka", "jumprelu", "standard"]


def side(python: str, *args: str, threads: int) -> str:
    """Run ``synth_sae_side.py`` in the side venv; its last stdout line. Raises with its stderr's tail on failure."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TQDM_DISABLE="1")
    done = subprocess.run([python, str(SIDE), *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{SIDE.name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def world(python: str, out: Path, scale: int, seed: int, train_rows: int, eval_rows: int, threads: int) -> dict:
    """The world of ``scale`` and ``seed`` under ``out`` (built once)."""
    here = out / f"s{scale}-seed{seed}"
    meta = here / "world.json"
    if meta.exists():
        found = json.loads(meta.read_text())
        if found["train_rows"] == train_rows and found["eval_rows"] == eval_rows:
            return found | {"dir": str(here)}
    side(python, "world", "--scale", str(scale), "--seed", str(seed), "--train-rows", str(train_rows),
         "--eval-rows", str(eval_rows), "--out", str(here), threads=threads)
    return json.loads(meta.read_text()) | {"dir": str(here)}


def rows_trained(sae_dir: Path) -> int:
    """Training rows a conceptdict run used (its last metrics line; the stopping rule may end it early)."""
    lines = (sae_dir / "metrics.jsonl").read_text().strip().splitlines()
    return int(json.loads(lines[-1])["rows"])


def train_kind(w: dict, kind: str, out: Path, **settings) -> dict:
    """Import the world's rows as a store (once) and train ``kind`` at the CLI's defaults: latents and k only
    (plus ``settings``, e.g. ``matryoshka_inner_weight``, where a sweep gives one)."""
    import conceptdict as cd

    store = Path(w["dir"]) / "store"
    if not (store / "manifest.json").exists():
        cd.import_array(Path(w["dir"]) / "train.npy", out=store, overwrite=True)
    t0 = time.perf_counter()
    cd.train(store=store, latents=w["width"], k=w["k"], kind=kind, out=out, overwrite=True, **settings)
    return {"seconds": time.perf_counter() - t0, "samples": rows_trained(out)}


def scored_input(w: dict, kind: str, sae_dir: Path) -> list[str]:
    """``score``'s input for a conceptdict dictionary: its SAELens export where the kind has one, else its codes,
    reconstructions and decoder directions on the held-out rows."""
    import conceptdict as cd
    import torch
    from conceptdict.saes.formats.saelens import exports_exactly

    if exports_exactly(kind):
        exported = sae_dir.parent / f"{sae_dir.name}-saelens"
        cd.export(sae_dir, out=exported, format="saelens", overwrite=True)
        return ["--saelens", str(exported)]
    model = cd.load(sae_dir)
    hidden = torch.from_numpy(np.load(Path(w["dir"]) / "eval_hidden.npy"))
    with torch.no_grad():
        codes = model.encode(hidden)
        recon = model.decode(codes)
        directions = model.decoder_directions().reshape(model.n_latents, -1)
    npz = sae_dir.parent / f"{sae_dir.name}-codes.npz"
    np.savez(npz, W_dec=directions.numpy(), codes=codes.numpy(), recon=recon.numpy())
    return ["--codes", str(npz)]


def score(python: str, w: dict, which: list[str], out: Path, threads: int) -> dict:
    side(python, "score", "--world", w["dir"], *which, "--out", str(out), threads=threads)
    return json.loads(out.read_text())


def runs(kinds: list[str], inner_weights: list[float] | None) -> list[tuple[str, str, dict]]:
    """(kind, row name, settings) of each conceptdict run: every kind at its defaults, except that with
    ``inner_weights`` each matryoshka kind runs once per weight, named ``KIND@inner=W``."""
    out = []
    for kind in kinds:
        if inner_weights and kind.startswith("matryoshka"):
            out += [(kind, f"{kind}@inner={w:g}", {"matryoshka_inner_weight": w}) for w in inner_weights]
        else:
            out.append((kind, kind, {}))
    return out


def run_world(args, w: dict) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    here = Path(w["dir"]) / "dicts"
    here.mkdir(exist_ok=True)
    rows, samples_for = [], {}
    for kind, name, settings in runs(args.kinds, args.matryoshka_inner_weights):
        sae_dir = here / name
        trained = train_kind(w, kind, sae_dir, **settings)
        result = score(args.side_python, w, scored_input(w, kind, sae_dir), here / f"{name}.score.json", args.threads)
        rows.append(dict(lib="conceptdict", name=name, pair=PAIR[kind], **trained, **result))
        if PAIR[kind]:
            samples_for[PAIR[kind]] = max(samples_for.get(PAIR[kind], 0), trained["samples"])
        print(line(w, rows[-1]), flush=True)
    for arch in args.saelens:
        samples = samples_for.get(arch) or max(samples_for.values(), default=2_048_000)
        sae_dir = here / f"saelens-{arch}"
        side(args.side_python, "train", "--world", w["dir"], "--arch", arch, "--k", str(w["k"]), "--samples",
             str(samples), "--out", str(sae_dir), threads=args.threads)
        bench = json.loads((sae_dir / "bench.json").read_text())
        result = score(args.side_python, w, ["--saelens", str(sae_dir)], here / f"saelens-{arch}.score.json",
                       args.threads)
        rows.append(dict(lib="saelens", name=arch, pair=arch, seconds=bench["seconds"], samples=samples, **result))
        print(line(w, rows[-1]), flush=True)
    for r in rows:
        r.update(scale=w["scale"], seed=w["seed"], k=w["k"], width=w["width"], hidden_dim=w["hidden_dim"],
                 num_features=w["num_features"], tag=args.tag)
    return rows


def line(w: dict, r: dict) -> str:
    return (f"s{w['scale']} seed {w['seed']} {r['lib']:11s} {r['name']:19s} MCC {r['mcc']:.3f} "
            f"F1 {r['classification']['f1_score']:.3f} EV {r['explained_variance']:.3f} L0 {r['sae_l0']:.1f} "
            f"dead {r['dead_latents']} samples {r['samples']:,} {r['seconds']:.0f}s")


def ratio(r: dict, rows: list[dict], field) -> str:
    """``field`` of conceptdict's row over SAELens' same architecture, scale and seed: the SAELens run of the same
    invocation (same tag: it got these kinds' sample count) where several are merged."""
    ref = [x for x in rows if x["lib"] == "saelens" and x["name"] == r["pair"] and x["scale"] == r["scale"]
           and x["seed"] == r["seed"]]
    ref.sort(key=lambda x: x.get("tag", "") != r.get("tag", ""))
    return f"x{field(r) / field(ref[0]):.2f}" if ref and field(ref[0]) else "-"


def shown(r: dict) -> str:
    """A row's name in the tables: SAELens runs of a tagged invocation carry the tag (their sample count follows
    that invocation's kinds, so they are not averaged with another invocation's)."""
    return f"{r['name']} [{r['tag']}]" if r["lib"] == "saelens" and r.get("tag") else r["name"]


def file_tag(results: Path) -> str:
    """The --tag in a results file's name (``results-s16-seed0-1-more.json`` -> ``more``; none -> "")."""
    found = re.search(r"-seed\d+(?:-\d+)*(?:-(.+))?$", results.stem)
    return (found.group(1) or "") if found else ""


def tables(rows: list[dict]) -> str:
    f1 = lambda r: r["classification"]["f1_score"]
    mcc = lambda r: r["mcc"]
    out = [("| scale | seed | library | kind | MCC | F1 | explained var. | L0 | dead | samples | wall s | MCC / SAELens "
            "| F1 / SAELens |"), "|" + "---|" * 13]
    for r in rows:
        out.append(f"| {r['scale']} | {r['seed']} | {r['lib']} | {shown(r)} | {mcc(r):.3f} | {f1(r):.3f} | "
                   f"{r['explained_variance']:.3f} | {r['sae_l0']:.1f} | {r['dead_latents']} | {r['samples']:,} | "
                   f"{r['seconds']:.0f} | {ratio(r, rows, mcc) if r['lib'] == 'conceptdict' else ''} | "
                   f"{ratio(r, rows, f1) if r['lib'] == 'conceptdict' else ''} |")
    out += ["", "Means over seeds (worst seed's ratio in brackets):", "",
            "| scale | library | kind | MCC | F1 | explained var. | L0 | MCC / SAELens | F1 / SAELens |",
            "|" + "---|" * 9]
    for scale in sorted({r["scale"] for r in rows}, reverse=True):
        here = [r for r in rows if r["scale"] == scale]
        names = list(dict.fromkeys((r["lib"], shown(r)) for r in here))
        means = []
        for lib, name in names:
            mine = [r for r in here if (r["lib"], shown(r)) == (lib, name)]
            m = {key: statistics.mean(fn(r) for r in mine) for key, fn in
                 (("mcc", mcc), ("f1", f1), ("ev", lambda r: r["explained_variance"]), ("l0", lambda r: r["sae_l0"]))}
            rat = {}
            for key, fn in (("mcc", mcc), ("f1", f1)):
                vals = [float(ratio(r, rows, fn)[1:]) for r in mine if ratio(r, rows, fn) != "-"]
                rat[key] = (f"x{statistics.mean(vals):.2f} (x{min(vals):.2f})" if vals and lib == "conceptdict"
                            else "")
            means.append((lib, name, m, rat))
            out.append(f"| {scale} | {lib} | {name} | {m['mcc']:.3f} | {m['f1']:.3f} | {m['ev']:.3f} | "
                       f"{m['l0']:.1f} | {rat['mcc']} | {rat['f1']} |")
        order = sorted(means, key=lambda x: -x[2]["f1"])
        out.append(f"| {scale} | order by F1 | " + " > ".join(f"{lib[:2]}:{name}" for lib, name, _, _ in order)
                   + " |||||||")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=int, nargs="+", default=[16, 32],
                    help="divide the published recipe's features, hidden width, SAE width and roots by these")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="world seeds (the generator's seed)")
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS, help="conceptdict kinds")
    ap.add_argument("--saelens", nargs="*", default=SAELENS, choices=SAELENS,
                    help="SAELens architectures (none: conceptdict only)")
    ap.add_argument("--matryoshka-inner-weights", type=float, nargs="+", default=None,
                    help="train each matryoshka kind once per inner-prefix weight (the CLI's "
                         "--matryoshka-inner-weight), rows named KIND@inner=W; default: the kind's default only")
    ap.add_argument("--tag", default="", help="appended to the results file's name (runs of other kinds or "
                                               "settings on the same scale and seed then sit side by side)")
    ap.add_argument("--train-rows", type=int, default=65536, help="rows of each world's store")
    ap.add_argument("--eval-rows", type=int, default=16384, help="held-out rows scored (multiple of 4096)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every training (both libraries)")
    ap.add_argument("--side-python", default=str(ROOT / ".venv-synth" / "bin" / "python"),
                    help="python of the side venv with sae-lens")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "synth")
    ap.add_argument("--table", type=Path, nargs="+", help="print the tables of results-*.json files and exit")
    args = ap.parse_args(argv)
    if args.table:
        # rows written before results carried their --tag: the tag is the results file's name after the seeds
        print(tables([{"tag": file_tag(f)} | r for f in args.table for r in json.loads(f.read_text())]))
        return
    if not Path(args.side_python).exists():
        raise SystemExit(f"--side-python {args.side_python} does not exist: build the side venv first "
                         "(python3 -m venv .venv-synth && .venv-synth/bin/pip install torch==2.13.0 'sae-lens>=6.54')")
    if args.eval_rows % 4096:
        raise SystemExit(f"--eval-rows {args.eval_rows}: must be a multiple of 4096 (the scoring batch)")
    # numba's kernels (conceptdict's sparse steps) take --threads too: with its default pool of every core, a step
    # on the loaded 2-core machine waited for both threads at each parallel region (about 500 rows/s instead of
    # 5,000 with one thread, measured at width 256), while SAELens ran on one thread
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / f"results-s{'-'.join(map(str, args.scales))}-seed{'-'.join(map(str, args.seeds))}"
    results = results.with_name(f"{results.name}{'-' + args.tag if args.tag else ''}.json")
    rows = []
    for scale in args.scales:
        for seed in args.seeds:
            w = world(args.side_python, args.out, scale, seed, args.train_rows, args.eval_rows, args.threads)
            print(f"world s{scale} seed {seed}: {w['num_features']} features, d {w['hidden_dim']}, width "
                  f"{w['width']}, k {w['k']} (true L0 {w['true_l0']:.1f}, of the width's most frequent "
                  f"{w['true_l0_top_width']:.1f})", flush=True)
            rows += run_world(args, w)
            results.write_text(json.dumps(rows, indent=1))
    print(tables(rows))


if __name__ == "__main__":
    sys.exit(main())
