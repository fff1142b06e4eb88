"""Two looks inside ``bench/train_step.py``'s kind-spade step (defaults: D 768, L 16384, k 32, B 4096, float32) that
``bench/spade_phases.py`` does not give:

    # torch's ops by self CPU a step, each attributed to the Python function that called it (torch.profiler)
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --profile --steps 2
    # the by-latent gather-sum and scatter on the benchmark's SpaDE code (at its initialisation) per tile width,
    # best of 3, CPU ms, and whether the outputs are the same bits whatever the tile; B / D / L from the environment
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --tiles 64 96 128
    # one 512-row chunk's scores: addmm (the bias copied into the output first) against mm, 10 calls, CPU ms
    OMP_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --chunk
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step as ts


def profile(steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    p = dict(ts.PRESETS["full"], device="cpu", floor=False, threads=1, precision="float32", steps=steps, warmup=1)

    def run(meter, step, batches, warmup):
        for b in batches[:warmup]:
            step(b)
        with torch_profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for b in batches[warmup:]:
                step(b)
        out["prof"] = prof
        meter.times = meter.floors = [1.0]

    ts._Meter.run = run
    ts._Meter.time_floor = lambda *args, **kwargs: None
    ts._measure("kind-spade", p)
    ms = defaultdict(float)
    for e in out["prof"].events():
        if not e.name.startswith("aten::"):
            continue
        parent, chain = e.cpu_parent, []
        while parent is not None and len(chain) < 2:
            if ".py(" in parent.name or "Backward" in parent.name:
                chain.append(parent.name.split("/")[-1][:60])
            parent = parent.cpu_parent
        ms[(e.name, " < ".join(chain))] += e.self_cpu_time_total / 1e3 / steps
    print(f"load {os.getloadavg()[0]:.1f}; torch ops by self CPU ms a step (>= 2 ms), with their callers")
    for (name, chain), t in sorted(ms.items(), key=lambda kv: -kv[1]):
        if t >= 2:
            print(f"{t:7.1f}  {name:26s} {chain}")


def spade_code():
    """(the benchmark's SpaDE code at its initialisation, bucketed by latent; W_dec; the batch) at B / D / L."""
    import torch
    from conceptdict.saes import SparseCoder, kernels
    from conceptdict.saes.kernels import numba_impl
    from conceptdict.saes.kinds import spade

    pr = ts.PRESETS["full"]
    D, L, B = (int(os.environ.get(n, pr[n])) for n in ("D", "L", "B"))
    x = ts.synthetic_batches(1, B, D, "cpu")[0]
    model = SparseCoder(D, L, pr["k"], "spade")
    model.reset_parameters(generator=torch.Generator().manual_seed(0))
    model.add_train_params()
    model.spec.init(model, x)
    with torch.no_grad():
        lam, W, c = spade.scale(model), model.W_enc, spade.weight_unit(model)
        xc = x - model.b_dec
        f, idx, _, _ = kernels.encode_spade(xc, W, -0.5 * c * kernels.square_norms(W), 2 * c * lam, lam,
                                            xc.square().sum(dim=1), 128, value_scale=c)
    return numba_impl.by_latent(idx, f, L), model.W_dec.detach().numpy(), x.numpy()


def tiles(widths: list[int]) -> None:
    import numpy as np
    from conceptdict.saes.kernels import numba_wide as nw

    code, W, A = spade_code()
    B, D, L = A.shape[0], A.shape[1], W.shape[0]
    print(f"D {D} L {L} B {B}: {code.row.shape[0]} entries; load {os.getloadavg()[0]:.1f}")
    bias = np.full(D, 0.25, np.float32)
    first = None
    for tile in widths:
        outs = np.empty((B, D), np.float32), np.empty((L, D), np.float32)
        best = []
        for run in (lambda t=tile, o=outs[0]: nw.gather_sum(code.start, code.row, code.value, W, bias, t, o),
                    lambda t=tile, o=outs[1]: nw.scatter(code.start, code.row, code.value, A, t, o)):
            run()
            times = []
            for _ in range(3):
                c = time.thread_time()
                run()
                times.append(time.thread_time() - c)
            best.append(1e3 * min(times))
        first = outs if first is None else first
        same = all(np.array_equal(a, b) for a, b in zip(outs, first))
        print(f"tile {tile:4d}: gather-sum {best[0]:6.1f} ms, scatter {best[1]:6.1f} ms; outputs as tile "
              f"{widths[0]}'s bit for bit: {same}")


def chunk() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    b, x, W = torch.randn(16384, generator=g), torch.randn(512, 768, generator=g), torch.randn(16384, 768, generator=g)
    buf = torch.zeros(512, 16384)
    spent = {"addmm": 0.0, "mm": 0.0}
    for i in range(12):
        for name, fn in (("addmm", lambda: torch.addmm(b, x, W.t(), out=buf)), ("mm", lambda: torch.mm(x, W.t(), out=buf))):
            c = time.thread_time()
            fn()
            spent[name] += (time.thread_time() - c) if i >= 2 else 0.0
    print(f"load {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}: a [512, 768] x [768, 16384] chunk "
          f"into a reused buffer, addmm {100 * spent['addmm']:.1f} ms, mm {100 * spent['mm']:.1f} ms (mean of 10)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tiles", type=int, nargs="*")
    ap.add_argument("--chunk", action="store_true")
    a = ap.parse_args(argv)
    import conceptdict  # noqa: F401

    if a.profile:
        profile(a.steps)
    if a.tiles:
        tiles(a.tiles)
    if a.chunk:
        chunk()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
