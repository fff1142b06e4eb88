"""Dictionary kinds and training defaults on real activations no default was tuned on: held-out FVU, L0 and dead
latents, each against TopK's FVU at the same L0, measured in the same run.

The planted benchmark (``bench/synthetic_recovery.py``) says which atoms a kind finds; this one says what a change
costs on the data the product trains on. Rows: the sentence embeddings of ``bench/cbm_corpora.py``'s corpora (man
pages, Debian package descriptions, third-party docstrings) at ``sentence.mean_normalized`` of the default model,
embedded once and cached under ``--cache`` (shared with ``bench/cbm_accuracy.py``). Per corpus, 1 / ``--test-share``
of the rows (a fixed permutation) is held out for evaluation and the next ``calibration_batches`` batches for the
thresholded kinds' calibration (as a store's held-out rows are in a real run: a corpus of a few thousand rows is
read ~50 times in 400 steps, and a threshold calibrated on rows the dictionary trained on lets through 2-3x k on
unseen ones); every dictionary trains ``--steps`` batches of the rest with the demo's sentence recipe (L = 1024,
k = 16, batches of 256) and is evaluated on the held-out rows.

The calibration holds the mean L0 at k on unseen rows, but not exactly (and a kind's own L0 may differ), so a
bare FVU can compare unlike sparsities. The BASELINE is TopK's FVU-L0 frontier: TopK trains at every k of
``--frontier`` (default k/2 .. 4k) on the same split, and each run prints its FVU over TopK's at its own held-out
L0 (log-log interpolation between the two nearest frontier points), ``x1.00`` meaning as good as TopK there.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/real_heldout.py --kinds batchtopk jumprelu jumprelu:topk_start=0
    HF_HUB_OFFLINE=1 .venv/bin/python bench/real_heldout.py --corpus debian --kinds batchtopk:code_l1=0.2 \\
        --json runs/bench/real_heldout.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cbm_corpora import default_model, embedded  # noqa: E402
from synthetic_recovery import kind_variant  # noqa: E402

from conceptdict.saes import TrainConfig, train, train_config  # noqa: E402
from conceptdict.saes.config import calibration_batch_count  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", action="append", choices=["manpages", "debian", "pydocs", "stdlib"],
                   help="corpus to measure (repeat; default: manpages, debian, pydocs)")
    p.add_argument("--kinds", nargs="+", default=["batchtopk"], metavar="KIND[:FIELD=VALUE,...]",
                   help="dictionaries to measure, as bench/synthetic_recovery.py's --kinds")
    p.add_argument("--latents", type=int, default=1024, help="dictionary latents (the demo's)")
    p.add_argument("--k", type=int, default=16, help="dictionary k (the demo's)")
    p.add_argument("--steps", type=int, default=400, help="training batches per dictionary")
    p.add_argument("--batch", type=int, default=256, help="rows per batch (the demo's)")
    p.add_argument("--frontier", type=int, nargs="+", default=None,
                   help="TopK's k values for the baseline frontier (default: k/2, k, 1.5k, 2k, 3k, 4k)")
    p.add_argument("--test-share", type=float, default=0.2, help="share of each corpus held out")
    p.add_argument("--calibration-batches", type=int, default=TrainConfig.calibration_batches,
                   help="batches of rows set aside for the thresholded kinds' calibration (TrainConfig's default)")
    p.add_argument("--seed", type=int, default=0, help="split, data order and initialisation seed")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cache", type=Path, default=Path("runs/cbm-corpora"), help="embedding cache directory")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = p.parse_args(argv)
    if not 0 < a.test_share < 1:
        p.error(f"--test-share {a.test_share} must lie in (0, 1)")
    return a


def batches(x: torch.Tensor, batch: int, steps: int, seed: int):
    """``steps`` whole batches of ``batch`` rows of x, each pass over x in a fresh seeded order."""
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            if len(idx) == batch and done < steps:
                done += 1
                yield x[idx]


def split(x: torch.Tensor, share: float, calibration_rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(train rows, calibration rows, held-out rows) of a fixed permutation: the first ``share`` is held out, the
    next ``calibration_rows`` calibrate."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(len(x) * share))
    if len(x) - n_test - calibration_rows < 1:
        raise SystemExit(f"{len(x)} rows cannot hold {n_test} held-out and {calibration_rows} calibration rows")
    cut = n_test + calibration_rows
    return x[perm[cut:]], x[perm[n_test:cut]], x[perm[:n_test]]


def heldout(kind: str, fields: dict, k: int, parts: tuple[torch.Tensor, ...], a) -> dict:
    """Train one dictionary on the training rows of ``parts`` (:func:`split`; a thresholded kind calibrates on its
    calibration rows, the stream's first batches) and measure it on the held-out rows: FVU (against the held-out
    mean), L0, dead."""
    train_x, calib_x, test_x = parts
    cfg = train_config(latents=a.latents, k=k, kind=kind, batch_size=a.batch, device="cpu", eval_batches=0,
                       checkpoint_every=0, log_every=10**9, seed=a.seed, tokens=a.steps * a.batch, **fields)
    n_calib = calibration_batch_count(cfg)
    if n_calib * a.batch > len(calib_x):
        raise SystemExit(f"{kind}: calibration_batches={n_calib} needs {n_calib * a.batch} rows; "
                         f"--calibration-batches {a.calibration_batches} set aside {len(calib_x)}: raise it")
    calib = list(calib_x[: n_calib * a.batch].split(a.batch)) if n_calib else []
    stream = itertools.chain(calib, batches(train_x, a.batch, a.steps, a.seed))
    sae = train(cfg, stream)
    with torch.no_grad():
        f = sae.encode(test_x)
        fvu = float((sae.decode(f) - test_x).square().sum() / (test_x - test_x.mean(0)).square().sum())
        active = f > 0
    return {"fvu": fvu, "l0": float(active.sum(1).float().mean()), "dead": float((~active.any(0)).float().mean())}


def frontier_fvu(points: list[tuple[float, float]], l0: float) -> float:
    """TopK's FVU at ``l0`` from its (L0, FVU) points: log-log interpolation between the two nearest points,
    extrapolated from the two end points outside their range."""
    pts = sorted(points)
    lo, hi = pts[0], pts[1]
    for a, b in zip(pts, pts[1:]):
        lo, hi = a, b
        if l0 <= b[0]:
            break
    t = (math.log(l0) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
    return math.exp(math.log(lo[1]) + t * (math.log(hi[1]) - math.log(lo[1])))


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = [(label, *kind_variant(label)) for label in a.kinds]
    ks = sorted(set(a.frontier or [max(1, a.k // 2), a.k, a.k * 3 // 2, 2 * a.k, 3 * a.k, 4 * a.k]))
    if len(ks) < 2:
        raise SystemExit(f"--frontier {ks}: give at least two k values (TopK's frontier needs two points)")
    model = default_model()

    rows = []
    for name in a.corpus or ["manpages", "debian", "pydocs"]:
        x, _, _ = embedded(name, model, a.cache)
        parts = split(x, a.test_share, a.calibration_batches * a.batch, a.seed)
        print(f"{name}: {len(parts[0])} training rows, {len(parts[1])} for calibration, {len(parts[2])} held out; "
              f"L={a.latents}, {a.steps} steps", flush=True)
        front = [heldout("topk", {}, k, parts, a) for k in ks]
        points = [(r["l0"], r["fvu"]) for r in front]
        for k, r in zip(ks, front):
            print(f"  topk k={k:<4} (frontier)  fvu {r['fvu']:.4f}  l0 {r['l0']:6.2f}  dead {r['dead']:6.1%}",
                  flush=True)
        for label, kind, fields in variants:
            r = heldout(kind, fields, a.k, parts, a)
            base = frontier_fvu(points, r["l0"])
            rows.append({"corpus": name, "kind": label, **r, "topk_fvu_at_l0": base, "fvu_vs_topk": r["fvu"] / base})
            print(f"  {label:<32} fvu {r['fvu']:.4f}  l0 {r['l0']:6.2f}  dead {r['dead']:6.1%}  "
                  f"[topk at this L0: {base:.4f}, fvu x{r['fvu'] / base:.2f}]", flush=True)
    print(f"\n{'corpus':<10}{'kind':<34}{'fvu':>8}{'l0':>8}{'dead':>8}{'x topk':>8}")
    for r in rows:
        print(f"{r['corpus']:<10}{r['kind']:<34}{r['fvu']:>8.4f}{r['l0']:>8.2f}{r['dead']:>8.1%}"
              f"{r['fvu_vs_topk']:>8.2f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
