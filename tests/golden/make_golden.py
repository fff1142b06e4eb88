"""Golden training numbers: a seeded few-step run of every trainable kind, per-step FVU / L0 / AuxK pinned.

    make golden                                           # rewrites tests/golden/training.json (this script)
    .venv/bin/python tests/golden/make_golden.py --check  # compares only (what tests/test_golden.py does)

Every kind of ``saes.KINDS`` that trains runs ``STEPS`` steps of ``saes.train`` on planted-atom data from
``generators.synthetic`` (two sources for crosscoder kinds), with the dense reference kernels on CPU, one torch
thread, and settings chosen so that every term is active in a few steps: warm-up and the final decay of the
learning rate, AuxK over latents dead after two batches, the BatchTopK threshold estimate, the L1 penalty.
The runs train in float64 (``precision="float64"``): they pin the algorithm, and float64's rounding keeps them the
same on every CPU and ATen capability, where float32 runs drifted apart (an AuxK loss 1.8e-5 off after 3 steps under
``ATEN_CPU_CAPABILITY=default``). The numbers are what ``tests/test_golden.py`` holds the training loop to (relative
tolerance ``RTOL``). A second section, ``bf16``, pins ``BF16_KINDS`` trained with ``precision="bf16"`` (the portable
torch kernels: bf16 needs a fast kernel), the path whose selection reads rounded scores.

When regenerating is legitimate: ONLY when a change is MEANT to change training numerics (the learning-rate
schedule, a loss term or its weight, the dead-latent rule, the threshold update, a kind's selection, the
initialisation, the synthetic data), and the commit that regenerates says which change and why the new
numbers are right (e.g. the recovery benchmark bench/synthetic_recovery.py is no worse). A refactor, a
faster kernel or a new kind must leave the existing numbers alone: if they move, the change is a bug. A new
kind adds its entry by running this script; check the diff touches only that entry.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/generators: the planted data

GOLDEN = Path(__file__).with_name("training.json")
STEPS = 8
RTOL = 1e-5
"""The loosest number pinned is the held-out FVU, evaluated in float32 on the saved float32 dictionary: a pairwise sum of
64 x 16 squares, relative error <= log2(1024) eps32 = 1.2e-6 on any CPU; 1e-5 is 8x that. The per-step numbers are
float64 (~1e-13 apart across CPUs); the bf16 runs' float32 sums are of 64 x 16 terms too."""
ATOL = 1e-6
METRICS = ("fvu", "l0", "aux", "loss", "lr")
SETTINGS = dict(latents=128, k=4, batch_size=64, tokens=64 * STEPS, eval_batches=1, init_rows=128, seed=0,
                lr=1e-2, warmup_steps=2, decay_fraction=0.25, threshold_start_step=3, dead_tokens=64, aux_k=8,
                l1_coeff=0.05, checkpoint_every=0, log_every=1, kernel_impl="reference", device="cpu")


BF16_KINDS = ("topk", "batchtopk", "crosscoder")
"""Kinds also pinned with ``precision="bf16"`` (the encoder matmul choosing the latents in bf16): bf16 needs a fast
kernel, so these runs use ``kernel_impl="torch"`` (the portable one; the float64 runs use the dense reference)."""


def trainable_kinds() -> list[str]:
    from conceptdict.saes import KINDS

    return sorted(k for k, spec in KINDS.items() if spec.trainable)


def _batches(kind: str, start: int):
    """Planted-atom batches [64, 16]; crosscoder kinds get two aligned sources [64, 2, 16], transcoders the same
    two as (input, output), cross-layer transcoders two layers' inputs then outputs [64, 4, 16]."""
    from conceptdict.saes import KINDS, reads_several_sources
    from generators.synthetic import SyntheticSpec, synthetic_batches

    spec = SyntheticSpec(n_atoms=48, d=16, active=3, batch_size=64, n_batches=STEPS + 3, seed=7)
    for x in synthetic_batches(spec, start):
        pair = reads_several_sources(kind)
        y = 0.6 * x + 0.4 * x.roll(1, dims=1)
        if KINDS[kind].layered:
            yield torch.stack([x, y, y, 0.5 * y + torch.relu(x - 0.5)], dim=1)
        else:
            yield torch.stack([x, y], dim=1) if pair else x


class _Record:
    """A metrics sink that keeps every step's record."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, record: dict) -> None:
        self.rows.append(record)

    def close(self) -> None:
        pass


def golden_run(kind: str, precision: str = "float64") -> dict:
    """The per-step metrics and the final threshold of one seeded run of ``kind`` (``BF16_KINDS`` also in bf16)."""
    from conceptdict.saes import train, train_config
    from conceptdict.saes.flat import flat_for_kind

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sink = _Record()
        # SETTINGS' kind-specific entries (l1_coeff, threshold_start_step) go to the kinds that read them
        settings = dict(SETTINGS, kind=kind)
        settings.update(precision=precision, kernel_impl="reference" if precision == "float64" else "torch")
        model = train(train_config(**flat_for_kind(settings, kind)), functools.partial(_batches, kind), sink=sink)
    finally:
        torch.set_num_threads(threads)
    out = {m: [float(r[m]) for r in sink.rows] for m in METRICS}
    out["threshold_mean"] = float(model.threshold.mean()) if model.spec.uses_threshold else None
    out["heldout_fvu"] = float(model.training_summary["heldout_eval"]["fvu"])
    return out


def compare(got: dict, want: dict) -> list[str]:
    """One line per number of ``got`` that is not ``want`` within RTOL / ATOL."""
    bad = []
    for key, ref in want.items():
        values, refs = (got.get(key), ref) if isinstance(ref, list) else ([got.get(key)], [ref])
        if values is None or len(values) != len(refs):
            bad.append(f"{key}: {values} against {refs}")
            continue
        for i, (v, r) in enumerate(zip(values, refs)):
            if (v is None) != (r is None) or (r is not None and abs(v - r) > ATOL + RTOL * abs(r)):
                bad.append(f"{key}[{i}]: {v!r} against golden {r!r}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with training.json instead of rewriting it")
    args = ap.parse_args(argv)
    got = {kind: golden_run(kind) for kind in trainable_kinds()}
    got_bf16 = {kind: golden_run(kind, "bf16") for kind in BF16_KINDS}
    if args.check:
        doc = json.loads(GOLDEN.read_text())
        bad = [f"{kind} {line}" for kind in doc["kinds"] for line in compare(got.get(kind, {}), doc["kinds"][kind])]
        bad += [f"{kind} bf16 {line}" for kind in doc["bf16"] for line in compare(got_bf16.get(kind, {}),
                                                                                  doc["bf16"][kind])]
        print("\n".join(bad) or f"{len(doc['kinds'])} kinds and {len(doc['bf16'])} bf16 runs match {GOLDEN.name}")
        return 1 if bad else 0
    doc = {"about": "per-step training metrics pinned by tests/test_golden.py; regenerate with "
                    "tests/golden/make_golden.py (its docstring says when that is legitimate)",
           "torch": torch.__version__, "steps": STEPS, "settings": SETTINGS, "kinds": got, "bf16": got_bf16}
    GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({len(got)} kinds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
