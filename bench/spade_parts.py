"""Looks inside ``bench/train_step.py``'s kind-spade step (defaults: D 768, L 16384, k 32, B 4096, float32) that
``bench/spade_phases.py`` does not give:

    # torch's ops by self CPU a step, each attributed to the Python function that called it (torch.profiler)
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --profile --steps 2
    # the by-latent scatter on the benchmark's SpaDE code (at its initialisation) per tile width, best of 3, CPU ms,
    # and whether the outputs are the same bits whatever the tile; B / D / L from the environment
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --tiles 64 96 128
    # the by-latent gather-sum and gather-dot on that code per block of rows, best of 3, CPU ms, the same bits or not
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --blocks 128 256 512
    # the support search on the benchmark's first 512 rows of scores (at its initialisation), best of 3, CPU ms a step
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/spade_parts.py --search
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


def spade_model():
    """(the benchmark's SpaDE model at its initialisation, its batch, the centred batch, lambda, the prototypes' half
    norms -c |W|^2 / 2: the scores' bias) at B / D / L."""
    import torch
    from conceptdict.saes import SparseCoder, kernels
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
        return model, x, x - model.b_dec, lam, -0.5 * c * kernels.square_norms(W)


def spade_code():
    """(the benchmark's SpaDE code at its initialisation, bucketed by latent; W_dec; the batch) at B / D / L."""
    import torch
    from conceptdict.saes import kernels
    from conceptdict.saes.kernels import numba_impl
    from conceptdict.saes.kinds import spade

    model, x, xc, lam, half = spade_model()
    with torch.no_grad():
        c = spade.weight_unit(model)
        f, idx, _, _ = kernels.encode_spade(xc, model.W_enc, half, 2 * c * lam, lam, xc.square().sum(dim=1), 128,
                                            value_scale=c)
    return numba_impl.by_latent(idx, f, model.n_latents), model.W_dec.detach().numpy(), x.numpy()


def best_of(run, n=3) -> float:
    """The least CPU ms of n calls of run, after one more."""
    run()
    times = []
    for _ in range(n):
        c = time.thread_time()
        run()
        times.append(time.thread_time() - c)
    return 1e3 * min(times)


def tiles(widths: list[int]) -> None:
    import numpy as np
    from conceptdict.saes.kernels import numba_wide as nw

    code, W, A = spade_code()
    B, D, L = A.shape[0], A.shape[1], W.shape[0]
    print(f"D {D} L {L} B {B}: {code.row.shape[0]} entries; load {os.getloadavg()[0]:.1f}")
    first = None
    for tile in widths:
        out = np.empty((L, D), np.float32)
        ms = best_of(lambda t=tile, o=out: nw.scatter(code.start, code.row, code.value, A, t, o))
        first = out if first is None else first
        print(f"tile {tile:4d}: scatter {ms:6.1f} ms; output as tile {widths[0]}'s bit for bit: "
              f"{np.array_equal(out, first)}")


def blocks(rows: list[int]) -> None:
    import numpy as np
    from conceptdict.saes.kernels import numba_wide as nw

    code, W, A = spade_code()
    B, D = A.shape
    G = np.random.default_rng(0).standard_normal((B, D)).astype(np.float32)
    bias = np.full(D, 0.25, np.float32)
    print(f"D {D} L {W.shape[0]} B {B}: {code.row.shape[0]} entries; load {os.getloadavg()[0]:.1f}; the library's "
          f"block: {nw.block_rows(B, D)} rows")
    first = None
    for r in rows:
        outs = np.empty((B, D), np.float32), np.empty((code.rows, code.width), np.float32)
        ms = (best_of(lambda o=outs[0], r=r: nw.gather_sum(code.start, code.row, code.value, W, bias, r, o)),
              best_of(lambda o=outs[1], r=r: nw.gather_dot(code.start, code.row, code.entry, G, W, r, o)))
        first = outs if first is None else first
        same = [np.array_equal(a, b) for a, b in zip(outs, first)]
        print(f"{r:5d} rows: gather-sum {ms[0]:6.1f} ms, gather-dot {ms[1]:6.1f} ms; as {rows[0]} rows' bit for "
              f"bit: {same[0]} / {same[1]}")


def search() -> None:
    import numpy as np
    import torch
    from conceptdict.saes.kernels import kinds, numba_sparsemax
    from conceptdict.saes.kinds import spade

    model, x, xc, lam, half = spade_model()
    with torch.no_grad():
        pre = torch.addmm(half, xc[: kinds.ROW_CHUNK], model.W_enc).numpy()
    s = np.float32(float(2 * spade.weight_unit(model) * lam))
    out, size = np.empty(pre.shape, np.int32), np.empty(pre.shape[0], np.int64)
    ms = best_of(lambda: numba_sparsemax.sparsemax_rows(pre, s, out, size))
    print(f"load {os.getloadavg()[0]:.1f}; the support search on {pre.shape[0]} rows of {pre.shape[1]} scores "
          f"(median support {int(np.median(size))}): {ms:.1f} ms, {ms * x.shape[0] / pre.shape[0]:.0f} ms a step of "
          f"{x.shape[0]} rows")


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
    ap.add_argument("--blocks", type=int, nargs="*")
    ap.add_argument("--search", action="store_true")
    a = ap.parse_args(argv)
    import conceptdict  # noqa: F401

    if a.profile:
        profile(a.steps)
    if a.tiles:
        tiles(a.tiles)
    if a.chunk:
        chunk()
    if a.blocks:
        blocks(a.blocks)
    if a.search:
        search()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
