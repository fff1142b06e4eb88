"""What a sweep saves: N dictionaries trained on ONE pass over a store against N separate `conceptdict train` runs.

A store of ``--rows`` planted-atom rows of width ``--d`` (saes.synthetic) is imported into a temporary
directory; then, through the command line users run:

- ``separate``  one ``conceptdict train`` per point of the grid (``--k`` x ``--kind``), one after the other (baseline);
- ``sweep``     one ``conceptdict train --sweep k=... --sweep kind=...`` training all of them on one pass;
- ``stream``    one epoch of ``stream_batches`` alone (what reading the data costs once), for reference.

An untimed warm-up run comes first (kernel compilation, first reads of the store). Each measurement is
repeated ``--repeats`` times, interleaved in alternating order, and the best time kept (the machine may be
shared). The sweep's dictionaries equal the separate runs' bit for bit (tests/test_sweep.py), so only the time
differs. Printed: seconds and the ratio to the separate runs measured in this run.

    .venv/bin/python bench/sweep.py                                  # N=4: k 16,32 x kind topk,batchtopk
    .venv/bin/python bench/sweep.py --rows 65536 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_store(root: Path, rows: int, d: int) -> Path:
    from conceptdict.cli.main import main
    from conceptdict.saes.synthetic import SyntheticSpec, synthetic_batches

    spec = SyntheticSpec(n_atoms=4 * d, d=d, active=8, batch_size=8192, n_batches=rows // 8192, seed=0)
    save_file({"acts": torch.cat(list(synthetic_batches(spec))).contiguous()}, str(root / "acts.safetensors"))
    assert main(["store", "import", str(root / "acts.safetensors"), "--out", str(root / "store")]) == 0
    return root / "store"


def run_separate(store: Path, out: Path, base: list[str], ks: list[int], kinds: list[str]) -> float:
    from conceptdict.cli.main import main

    t = time.perf_counter()
    for k, kind in itertools.product(ks, kinds):
        assert main(["train", "--store", str(store), "--out", str(out / f"k{k}-{kind}"), *base, "--k", str(k),
                     "--kind", kind, "--overwrite"]) == 0
    return time.perf_counter() - t


def run_sweep(store: Path, out: Path, base: list[str], ks: list[int], kinds: list[str]) -> float:
    from conceptdict.cli.main import main

    t = time.perf_counter()
    assert main(["train", "--store", str(store), "--out", str(out), *base, "--k", str(ks[0]), "--overwrite",
                 "--sweep", "k=" + ",".join(map(str, ks)), "--sweep", "kind=" + ",".join(kinds)]) == 0
    return time.perf_counter() - t


def run_stream(store: Path, batch_size: int) -> float:
    from conceptdict.activations import ActivationStore, stream_batches

    t = time.perf_counter()
    for _ in stream_batches(ActivationStore(store), "acts", batch_size, epochs=1):
        pass
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--latents", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--k", type=int, nargs="+", default=[16, 32])
    p.add_argument("--kind", nargs="+", default=["topk", "batchtopk"])
    p.add_argument("--kernel-impl", default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    logging.disable(logging.INFO)
    base = ["--latents", str(args.latents), "--batch-size", str(args.batch_size), "--kernel-impl", args.kernel_impl,
            "--checkpoint-every", "0", "--log-every", "1000000"]
    n = len(args.k) * len(args.kind)
    best = {"separate": float("inf"), "sweep": float("inf"), "stream": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = make_store(root, args.rows, args.d)
        run_separate(store, root / "warm-up", base, args.k[:1], args.kind)  # JIT compilation, first reads: untimed
        modes = {"separate": lambda: run_separate(store, root / "separate", base, args.k, args.kind),
                 "sweep": lambda: run_sweep(store, root / "sweep", base, args.k, args.kind),
                 "stream": lambda: run_stream(store, args.batch_size)}
        for r in range(args.repeats):
            for name in (("separate", "sweep") if r % 2 == 0 else ("sweep", "separate")) + ("stream",):
                best[name] = min(best[name], modes[name]())
    print(f"N={n} dictionaries (k {args.k} x kind {args.kind}), D={args.d}, L={args.latents}, {args.rows} rows, "
          f"batch {args.batch_size}, best of {args.repeats}")
    for name in ("separate", "sweep", "stream"):
        print(f"  {name:<9} {best[name]:8.2f} s   ratio to separate runs {best[name] / best['separate']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"n": n, "args": {k: str(v) for k, v in vars(args).items()},
                                         "seconds": best,
                                         "ratio_sweep_to_separate": best["sweep"] / best["separate"]}, indent=2))


if __name__ == "__main__":
    main()
