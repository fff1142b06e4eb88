"""The memory floor of the update: how long a pass that only moves the bytes ``kernels.adam_rows`` must move takes.

The fused update of one weight matrix [L, D] (Adam, the decoder's renormalisation, the bf16 copy the next step
reads) must read the weights, their gradient and Adam's two moments (4 x 4 bytes a parameter) and write the weights,
the two moments and the bf16 copy (3 x 4 + 2 bytes): 30 bytes a parameter, whatever its arithmetic. A step updates
two such matrices (W_enc and W_dec). This times, on the same [L, D] float32 arrays:

  numba-copy      one numba pass with exactly that traffic (w += g; m = g; v = m; bits = the high half of w):
                  the floor for an update written in numba, threads as numba's
  torch-copy      the same bytes through torch's kernels: ``torch.add(w, g, out=w)``, ``m.copy_(g)``,
                  ``v.copy_(m)`` and the bf16 copy ``c.copy_(w)`` (four passes, as torch cannot fuse them)
  stream          ``torch.add(a, b, out=c)`` (12 bytes an element), a memory bandwidth figure
  adam_rows       ``kernels.adam_rows`` itself (numba; Adam + renormalisation + bf16 copy), what the step runs
  torch-adam      torch's fused Adam over the matrix, then the renormalisation and the bf16 copy (the reference's
                  three passes, ``impl="reference"``)

    .venv/bin/python bench/update_floor.py                 # D 768, L 16384 (one of the step's two matrices)
    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python bench/update_floor.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import cpu_info

UPDATE_BYTES = 30
"""Bytes an update must move per parameter: w, g, m, v read (16); w, m, v (12) and the bf16 copy (2) written."""


@njit(parallel=True, cache=True, nogil=True)
def _copy_pass(W, Wbits, G, M, V, bits):
    """The update's traffic and nothing else: every row of W, G, M, V read once, W, M, V and the bf16 bits (the
    high half of the new w, read back from cache through ``Wbits``, W's uint32 view) written."""
    L, F = W.shape
    for r in prange(L):
        w, wb, g, m, v, o = W[r], Wbits[r], G[r], M[r], V[r], bits[r]
        for j in range(F):
            b = m[j]
            w[j] = w[j] + g[j]
            m[j] = g[j]
            v[j] = b
        for j in range(F):
            o[j] = np.uint16(wb[j] >> np.uint32(16))


def _best(fn, repeats: int) -> tuple[float, float]:
    """The least wall seconds and the least process CPU seconds (every thread) of ``repeats`` calls: on a machine
    other jobs share, the CPU time does not count the time the pass waited for a core."""
    fn()  # first call: compilation, first touch
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def measure(L: int, D: int, repeats: int) -> dict:
    import torch
    from conceptdict.saes import kernels

    g = torch.Generator().manual_seed(0)
    W = torch.nn.functional.normalize(torch.randn(L, D, generator=g), dim=1)
    G = torch.randn(L, D, generator=g) * 1e-3
    M, V = torch.zeros(L, D), torch.zeros(L, D)
    C = torch.empty(L, D, dtype=torch.bfloat16)
    bits = C.view(torch.int16).numpy().view(np.uint16)
    n = L * D
    rows: dict[str, tuple[float, float]] = {}

    rows["numba-copy"] = _best(lambda: _copy_pass(W.numpy(), W.numpy().view(np.uint32), G.numpy(), M.numpy(),
                                                  V.numpy(), bits), repeats)

    def torch_copy():
        torch.add(W, G, out=W)
        M.copy_(G)
        V.copy_(M)
        C.copy_(W)

    rows["torch-copy"] = _best(torch_copy, repeats)
    A, Bt, Ct = torch.randn(n), torch.randn(n), torch.empty(n)
    rows["stream"] = _best(lambda: torch.add(A, Bt, out=Ct), repeats)
    step = torch.tensor(1.0)

    def update(impl):
        def run():
            step.add_(1)
            kernels.adam_rows(W, G, M, V, step, 1e-4, (0.9, 0.999), 1e-8, unit=True, copy=C, impl=impl)
        return run

    rows["adam_rows"] = _best(update("numba"), repeats)
    rows["torch-adam"] = _best(update("reference"), repeats)
    bytes_moved = {"numba-copy": UPDATE_BYTES * n, "torch-copy": (12 + 8 + 8 + 6) * n, "stream": 12 * n,
                   "adam_rows": UPDATE_BYTES * n, "torch-adam": UPDATE_BYTES * n}
    return {"L": L, "D": D, "params": n, "ms": {k: 1e3 * v[0] for k, v in rows.items()},
            "cpu_ms": {k: 1e3 * v[1] for k, v in rows.items()},
            "GB_per_s": {k: bytes_moved[k] / v[0] / 1e9 for k, v in rows.items()},
            "threads": {"torch": torch.get_num_threads(), "numba": __import__("numba").get_num_threads()},
            "cpu": cpu_info()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latents", type=int, default=16384)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    r = measure(a.latents, a.d, a.repeats)
    print(f"CPU {r['cpu']['model']} | threads torch {r['threads']['torch']} numba {r['threads']['numba']}")
    print(f"one matrix [{a.latents}, {a.d}] ({r['params'] / 1e6:.1f}M parameters; a step updates two), best of "
          f"{a.repeats}; the update must move {UPDATE_BYTES} B a parameter = {UPDATE_BYTES * r['params'] / 1e6:.0f} MB")
    print(f"{'pass':12s} {'wall ms':>8s} {'GB/s':>8s} {'CPU ms':>8s}")
    for k, v in r["ms"].items():
        print(f"{k:12s} {v:8.1f} {r['GB_per_s'][k]:8.1f} {r['cpu_ms'][k]:8.1f}")
    print(f"the update's floor at the measured bandwidth of numba-copy: two matrices "
          f"{2 * r['ms']['numba-copy']:.1f} ms a step; adam_rows over it: "
          f"{r['ms']['adam_rows'] / r['ms']['numba-copy']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
