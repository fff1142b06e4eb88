"""Whole processes, not steps: ``conceptdict train`` in each precision against sparsify and SAELens on the same rows
and steps.

``bench/train_step.py`` times one step against its matmul floor; a user waits for a whole process: the interpreter,
the imports, opening the store, the initialisation, every step, the held-out evaluation and the save. This runs
each as a fresh process on the same rows and reports its wall time (start to exit), its CPU seconds (every thread:
on a shared machine the ratio of CPU seconds moves less with the load than the wall times') and held-out FVU:

  train-PRECISION  ``conceptdict train --store STORE --latents L --k K --batch-size B --tokens B*steps
                   --precision PRECISION`` (one held-out batch, no stopping rule, no checkpoints); its FVU is the
                   run's own held-out evaluation (config.json)
  sparsify         EleutherAI sparsify's SparseCoder on the same store's rows in the benchmark interpreter
                   (``--bench-python``, ``.venv-bench``: torch + eai-sparsify): ``steps`` batches of B rows after
                   the first B, each with its forward, FVU loss, backward, the gradient projection and decoder
                   renormalisation its Trainer applies, and fused Adam at its default learning rate; its FVU is on
                   the store's first B rows (ours: the run's held-out batch, also B rows of the same store)
  saelens          SAELens' own trainer (``SAETrainer.fit``: its TopK training SAE at k, its Adam at its default
                   learning rate, gradient clipping, dead-latent counters, no logging or checkpoints) fed the same
                   ``steps`` batches in the same interpreter (sae-lens installed there); FVU on the same first B rows

The rows: ``--store`` (a store of one hookpoint), else synthetic rows (``bench/train_step.py``'s generator: sparse
sums of random atoms plus noise) of ``--d`` columns imported as a store once under ``--work``. The first line
printed is the CPU's model name and flags (``bench/train_step.py``'s cpu_info) so that every figure says which
hardware it came from. The machine is shared: each row runs ``--repeat`` times, interleaved, and the median counts.

The benchmark interpreter (once): ``python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0
eai-sparsify==1.3.3 sae-lens==6.54.12`` (torch from its CPU index; the versions the figures in docs/results/speed.md
name).

    .venv/bin/python bench/whole_train.py                                  # D 768, L 8192, k 32, B 4096, 24 steps
    .venv/bin/python bench/whole_train.py --latents 65536 --steps 12
    .venv/bin/python bench/whole_train.py --steps 96 --precisions bf16 --phases   # where our process's time goes
    .venv/bin/python bench/whole_train.py --store runs/demo/store --d 384 --batch 256 --steps 200 --latents 1024 --k 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import children_cpu, run_once  # noqa: E402
from train_step import cpu_info, synthetic_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SPARSIFY = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from sparsify import SparseCoder, SparseCoderConfig

a = json.loads(sys.argv[1])
x = torch.cat([load_file(f)[a["key"]].reshape(-1, a["d"]).float() for f in a["shards"]])
B, steps, L = a["batch"], a["steps"], a["latents"]
held, train = x[:B], x[B:]
torch.manual_seed(a["seed"])
sae = SparseCoder(a["d"], SparseCoderConfig(num_latents=L, k=a["k"]), device="cpu")
opt = torch.optim.Adam(sae.parameters(), lr=2e-4 / (L / 2**14) ** 0.5, fused=True)  # sparsify's Trainer default
n = len(train) // B
for i in range(steps):
    xb = train[(i % n) * B:(i % n + 1) * B]
    out = sae(xb)
    opt.zero_grad(set_to_none=True)
    out.fvu.backward()
    sae.remove_gradient_parallel_to_decoder_directions()
    opt.step()
    sae.set_decoder_norm_to_unit_norm()
with torch.no_grad():
    fvu = float(sae(held).fvu)
print("FVU " + json.dumps(fvu))
"""

SAELENS = r"""
import json, sys
import torch
from safetensors.torch import load_file
from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.config import LoggingConfig, SAETrainerConfig
from sae_lens.training.sae_trainer import SAETrainer

a = json.loads(sys.argv[1])
x = torch.cat([load_file(f)[a["key"]].reshape(-1, a["d"]).float() for f in a["shards"]])
B, steps, L = a["batch"], a["steps"], a["latents"]
held, train = x[:B], x[B:]
n = len(train) // B
torch.manual_seed(a["seed"])
sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=a["d"], d_sae=L, k=a["k"], device="cpu"))
cfg = SAETrainerConfig(total_training_samples=B * steps, train_batch_size_samples=B, device="cpu",
                       lr_end=3e-4 / 10, logger=LoggingConfig(log_to_wandb=False))  # its runner config's defaults
SAETrainer(cfg, sae, (train[(i % n) * B:(i % n + 1) * B] for i in range(steps))).fit()
with torch.no_grad():
    err = (held - sae(held)).pow(2).sum() / (held - held.mean(0)).pow(2).sum()
print("FVU " + json.dumps(float(err)))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, help="a store of one hookpoint (default: synthetic rows under --work)")
    p.add_argument("--d", type=int, default=768, help="synthetic rows' width (a --store's must match)")
    p.add_argument("--latents", type=int, default=8192)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24, help="training steps of every process")
    p.add_argument("--precisions", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16", "auto"])
    p.add_argument("--libraries", nargs="*", default=["sparsify", "saelens"], choices=["sparsify", "saelens"],
                   help="the other libraries' processes to run (SAELens' dense decode takes minutes at L 65,536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs of each row, interleaved (median reported)")
    p.add_argument("--bench-python", default=str(ROOT / ".venv-bench" / "bin" / "python"),
                   help="interpreter with eai-sparsify and sae-lens (a row whose library is missing reports it)")
    p.add_argument("--work", type=Path, default=Path("runs/whole-train"), help="synthetic store and outputs")
    p.add_argument("--phases", action="store_true",
                   help="time our processes' phases too (start-up, data, setup, steps, checkpoint, held-out "
                        "evaluation, save: bench/startup.py's timestamps) and print them")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


def synthetic_store(a: argparse.Namespace) -> Path:
    """A store of (steps + 2) batches of synthetic rows (one held out, one spare), imported once."""
    import torch
    from safetensors.torch import save_file

    n = a.steps + 2
    store = a.work / f"store-d{a.d}-b{a.batch}-n{n}"
    if (store / "manifest.json").exists():
        return store
    a.work.mkdir(parents=True, exist_ok=True)
    rows = a.work / f"rows-d{a.d}-b{a.batch}-n{n}.safetensors"
    save_file({"acts": torch.cat(synthetic_batches(n, a.batch, a.d, "cpu")).contiguous()}, str(rows))
    subprocess.run([str(ROOT / ".venv/bin/conceptdict"), "store", "import", str(rows), "--out", str(store)],
                   check=True)
    rows.unlink()
    return store


def store_shards(store: Path) -> tuple[list[str], str]:
    """The store's shard files in order and the tensor name its rows are under."""
    from safetensors import safe_open

    shards = sorted(str(f) for f in store.glob("shard-*.safetensors"))
    with safe_open(shards[0], "pt") as fh:
        key = next(iter(fh.keys()))
    return shards, key


def run_train(a: argparse.Namespace, store: Path, precision: str, out: Path) -> dict:
    shape = ("--latents", str(a.latents), "--k", str(a.k))
    flags = ["--batch-size", str(a.batch), "--tokens", str(a.batch * a.steps), "--precision", precision,
             "--eval-batches", "1", "--calibration-batches", "0", "--stop-patience", "0", "--checkpoint-every", "0",
             "--seed", str(a.seed), "--no-verify"]
    phases = None
    if a.phases:  # the same process with timestamps around its phases (bench/startup.py's child)
        phases = run_once(store, out, flags, python=str(ROOT / ".venv/bin/python"), shape=shape)
        wall, cpu = phases["total"], phases["cpu_total"]
    else:
        cmd = [str(ROOT / ".venv/bin/conceptdict"), "train", "--store", str(store), *shape, *flags, "--overwrite",
               "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "CONCEPTDICT_PRECISION"}  # auto: this machine's choice
        t, c = time.perf_counter(), children_cpu()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall, cpu = time.perf_counter() - t, children_cpu() - c
        if proc.returncode:
            return {"error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((out / "config.json").read_text())["training"]
    return {"wall_s": wall, "cpu_s": cpu, "fvu": summary["heldout_eval"]["fvu"],
            "precision": summary["config"]["precision"],
            "steps": summary["steps"], **({"phases": phases} if phases else {})}


def run_side(a: argparse.Namespace, store: Path, script: str) -> dict:
    """One process of another library (``SPARSIFY`` or ``SAELENS``) in the benchmark interpreter."""
    if not Path(a.bench_python).exists():
        return {"error": f"no benchmark interpreter at {a.bench_python}"}
    shards, key = store_shards(store)
    spec = dict(shards=shards, key=key, d=a.d, batch=a.batch, steps=a.steps, latents=a.latents, k=a.k, seed=a.seed)
    t, c = time.perf_counter(), children_cpu()
    proc = subprocess.run([a.bench_python, "-c", script, json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    wall, cpu = time.perf_counter() - t, children_cpu() - c
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    fvu = next(json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("FVU "))
    return {"wall_s": wall, "cpu_s": cpu, "fvu": fvu, "steps": a.steps}


def main(argv=None) -> int:
    a = parse_args(argv)
    store = a.store or synthetic_store(a)
    cpu = cpu_info()
    print(f"CPU {cpu['model']} | flags {' '.join(cpu['flags']) or '-'} | load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"store {store}: D {a.d}, L {a.latents}, k {a.k}, B {a.batch}, {a.steps} steps, seed {a.seed}", flush=True)
    names = [f"train-{p}" for p in a.precisions] + list(a.libraries)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.repeat):
        for name in names:
            res = (run_side(a, store, SPARSIFY if name == "sparsify" else SAELENS) if name in ("sparsify", "saelens")
                   else run_train(a, store, name.split("-", 1)[1], a.work / f"out-{name}-{r}"))
            res["load"] = os.getloadavg()[0]  # the machine may be shared: the load as each process ended
            runs[name].append(res)
            print(f"  {name} (run {r + 1}): " + (str(res["error"]) if "error" in res else
                                                   f"{res['wall_s']:.1f} s ({res['cpu_s']:.1f} s CPU), held-out FVU "
                                                   f"{res['fvu']:.4f}") +
                  f" | load {res['load']:.1f}", flush=True)
    rows = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        rows[name] = ({"wall_s": statistics.median(r["wall_s"] for r in ok),
                       "cpu_s": statistics.median(r["cpu_s"] for r in ok), "fvu": ok[0]["fvu"],
                       "precision": ok[0].get("precision"),
                       **({"phases": {k: statistics.median(r["phases"][k] for r in ok) for k in ok[0]["phases"]}}
                          if "phases" in ok[0] else {})} if ok else rs[0])
    f32 = rows.get("train-float32", {}).get("fvu")
    print(f"{'process':16s} {'wall s':>8s} {'sparsify / it':>14s} {'in CPU s':>9s} {'saelens / it':>13s} "
          f"{'in CPU s':>9s} {'CPU s':>8s} {'FVU':>8s} {'FVU / float32':>14s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:16s} error: {r['error']}")
            continue
        speeds = ""
        for other, width in (("sparsify", 14), ("saelens", 13)):
            base = rows[other] if other in rows and "error" not in rows[other] else None
            speeds += (f" {base['wall_s'] / r['wall_s']:{width}.2f} {base['cpu_s'] / r['cpu_s']:9.2f}" if base
                       else f" {'n/a':>{width}s} {'n/a':>9s}")
        rel = f"{r['fvu'] / f32:14.4f}" if f32 and name.startswith("train-") else f"{'-':>14s}"
        print(f"{name:16s} {r['wall_s']:8.1f}{speeds} {r['cpu_s']:8.1f} {r['fvu']:8.4f} {rel}")
    if a.phases:
        timed = {name: r["phases"] for name, r in rows.items() if "phases" in r}
        print(f"{'phase (s)':16s}" + "".join(f"{name:>16s}" for name in timed))
        for key in next(iter(timed.values()), {}):
            print(f"{key:16s}" + "".join(f"{p[key]:16.3f}" for p in timed.values()))
    if a.json:
        a.json.write_text(json.dumps({"cpu": cpu, "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                      "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
