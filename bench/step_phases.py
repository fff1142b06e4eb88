"""Where one training step's time goes: the phases of ``conceptdict.saes.train``'s TopK step, per step, beside the
encoder matmul floor measured in the same process.

``bench/train_step.py`` gives the step over its floor; this splits the step. It runs ``train`` on
``bench/train_step.py``'s synthetic rows under ``torch.profiler`` with a ``record_function`` range around each
phase (the functions are wrapped here, the library is unchanged) and prints, per timed step:

  step            ``saes.training.step`` (everything below is inside it)
  loop            the rest of the loop per batch (normalisation, bookkeeping, the data path): the batch's wall
                  time minus ``step``
  encode          ``kernels.encode`` (the fused encoder), of which:
    matmul          the chunked encoder matmul (``aten::mm``)
    cast            dtype conversions (``aten::copy_`` outside the kernels: the bf16 weight and row copies, the
                    bf16 chunk converted to float32 for the selection)
    selection       the per-row top-k (``row_topk``)
    exact values    the kept entries recomputed in float32 (bf16 only)
  decode          the sparse decode forward
  backward        ``loss.backward()``, of which the decode's and the encoder's sparse backward
  grad projection ``remove_parallel_decoder_grad``
  clip            ``clip_grads``
  adam            ``Adam.step``
  renorm          ``normalize_decoder``
  record          ``record_step`` (dead-latent counters)

    .venv/bin/python bench/step_phases.py                       # bf16, D 768, L 16384, k 32, B 4096
    .venv/bin/python bench/step_phases.py --precision float32
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import cpu_info, synthetic_batches

# label -> (module, attribute): wrapped in a record_function range of that label
WRAPPED = {
    "step": ("conceptdict.saes.training", "step"),
    "encode": ("conceptdict.saes.kernels.sparse", "encode"),
    "selection": ("conceptdict.saes.kernels.numba_kernels", "row_topk"),
    "exact values": ("conceptdict.saes.kernels.sparse", "_exact_values"),
    "grad projection": ("conceptdict.saes.model:SparseCoder", "remove_parallel_decoder_grad"),
    "clip": ("conceptdict.saes.update", "clip_grads"),
    "adam": ("conceptdict.saes.adam:Adam", "step"),
    "renorm": ("conceptdict.saes.model:SparseCoder", "normalize_decoder"),
    "record": ("conceptdict.saes.training", "record_step"),
    "backward": ("torch:Tensor", "backward"),
}
# label -> profiler event names whose inclusive time it is (ranges the library already has)
EVENTS = {
    "matmul": ("aten::mm",),
    "decode": ("_SparseDecode",),
    "decode backward": ("autograd::engine::evaluate_function: _SparseDecodeBackward",),
    "encoder backward": ("autograd::engine::evaluate_function: _SparseEncoderGradBackward",),
}
ORDER = ("step", "loop", "encode", "matmul", "cast", "selection", "exact values", "decode", "backward",
         "decode backward", "encoder backward", "grad projection", "clip", "adam", "renorm", "record")


def _wrap(label: str, where: str, attr: str) -> None:
    import torch

    module, _, cls = where.partition(":")
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls else owner
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(owner, attr, timed)


def profile(D: int, L: int, k: int, B: int, steps: int, warmup: int, precision: str) -> dict:
    import conceptdict.saes.kernels.numba_impl  # noqa: F401  (the kernels wrapped below)
    import torch
    from conceptdict.saes import TrainConfig, train

    for label, (where, attr) in WRAPPED.items():
        _wrap(label, where, attr)
    training = importlib.import_module("conceptdict.saes.training")
    one_step = training.step
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    starts: list[float] = []

    def counted(*args, **kwargs):  # the profiler starts with the first timed step, on the loop's thread
        if len(starts) == warmup:
            prof.__enter__()
        starts.append(time.perf_counter())
        if len(starts) == warmup + steps + 1:  # the timed steps are over (this last one also ends the run)
            prof.__exit__(None, None, None)
        return one_step(*args, **kwargs)

    training.step = counted
    cfg = TrainConfig(latents=L, k=k, batch_size=B, tokens=B * (warmup + steps + 1), eval_batches=0, init_rows=B,
                      checkpoint_every=0, log_every=10**9, precision=precision)
    train(cfg, iter(synthetic_batches(warmup + steps + 2, B, D, "cpu")))
    walls = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1:])]
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        totals[ev.key] = totals.get(ev.key, 0.0) + ev.cpu_time_total / 1e3  # ms, inclusive
    n = len(walls)  # == steps
    ms = {label: totals.get(label, 0.0) / n for label in WRAPPED}
    ms.update({label: sum(totals.get(e, 0.0) for e in names) / n for label, names in EVENTS.items()})
    copies = totals.get("aten::copy_", 0.0) / n
    ms["cast"] = copies
    ms["loop"] = 1e3 * statistics.mean(walls) - ms["step"]
    floor = _floors(D, L, B, precision)
    return {"params": dict(D=D, L=L, k=k, B=B, steps=steps, precision=precision), "ms": ms, "floors_ms": floor,
            "wall_ms": 1e3 * statistics.mean(walls), "cpu": cpu_info()}


def _floors(D: int, L: int, B: int, precision: str) -> dict[str, float]:
    """The encoder matmul [B, D] @ [D, L] + b_enc in float32 and (bf16 runs) bf16, best of 3 each."""
    import torch

    x, W, b = torch.randn(B, D), torch.randn(L, D).t(), torch.zeros(L)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        if name != "float32" and precision != name:
            continue
        Wd, bd = W.to(dtype), b.to(dtype)
        times = []
        for _ in range(4):
            t = time.perf_counter()
            torch.addmm(bd, x.to(dtype), Wd)
            times.append(time.perf_counter() - t)
        out[name] = 1e3 * min(times[1:])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16", choices=("float32", "bf16"))
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--latents", type=int, default=16384)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    r = profile(a.d, a.latents, a.k, a.batch, a.steps, a.warmup, a.precision)
    cpu = r["cpu"]
    print(f"CPU {cpu['model']} | flags {' '.join(cpu['flags']) or '-'}")
    print(f"D={a.d} L={a.latents} k={a.k} B={a.batch} precision={a.precision} steps={a.steps} (+{a.warmup} warm-up)")
    own = r["floors_ms"].get(a.precision, r["floors_ms"]["float32"])
    print(f"floor ({a.precision} matmul): {own:.1f} ms; " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                                       r["floors_ms"].items()))
    print(f"{'phase':20s} {'ms/step':>8s} {'x floor':>8s} {'% step':>7s}")
    for label in ORDER:
        v = r["ms"][label]
        print(f"{label:20s} {v:8.1f} {v / own:8.2f} {100 * v / r['ms']['step']:7.1f}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
