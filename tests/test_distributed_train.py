"""Data-parallel training: 2 gloo ranks under torchrun train the same dictionary as one process.

Every trainable kind of ``saes.KINDS`` (TopK, BatchTopK, ReLU-L1, BatchTopK crosscoder, L1 crosscoder, and any
kind added later: there is no per-kind data-parallel code to write) trains on a tiny synthetic store in one process and under ``torchrun --nproc_per_node=2``; the weights (and the
BatchTopK inference threshold) must agree to float32 rounding (the runs train in float64: :func:`ulps`), every rank must hold the same dictionary, and a
checkpoint written by one process must resume under two ranks to the uninterrupted result.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conceptdict.activations import ActivationStore, ImportConfig, import_array, stream_batches
from conceptdict.activations.stream import rank_rows
from conceptdict.saes import KINDS as ALL_KINDS
from conceptdict.saes import TrainConfig, reads_several_sources, train, train_config
from conceptdict.saes.flat import flat_for_kind

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "distributed_entry.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

pytestmark = pytest.mark.equivalence  # `make test` runs these again under another ATen CPU capability


def synthetic_store(tmp: Path, n: int = 3072, d: int = 12, seed: int = 0) -> Path:
    """Two aligned hookpoints ``a`` and ``b`` [n, d] of sparse combinations of random atoms, and ``c``, ``d`` derived
    from them (a second layer's MLP input and output, for a 2-layer cross-layer transcoder)."""
    rng = np.random.default_rng(seed)
    atoms = rng.normal(size=(48, d)).astype(np.float32)
    codes = rng.random((n, 48)) * (rng.random((n, 48)) < 0.08)
    a = (codes @ atoms + 0.05 * rng.normal(size=(n, d))).astype(np.float32)
    b = (0.7 * a + 0.3 * (codes[:, ::-1] @ atoms) + 2.0).astype(np.float32)
    c = (a + 0.5 * b).astype(np.float32)
    e = (0.4 * c + 0.3 * (codes[:, 1:] @ atoms[1:]) - 1.0).astype(np.float32)
    np.savez(tmp / "acts.npz", a=a, b=b, c=c, d=e)
    return import_array(ImportConfig(array=tmp / "acts.npz", out=tmp / "store"))


def noise_stores(tmp: Path) -> tuple[Path, Path]:
    """(train, held out): 256 rows of Gaussian noise each (D=48), which 512 latents at k=2 memorise: their held-out
    FVU rises while the training FVU falls, so the stopping rule goes back to its lowest held-out FVU."""
    rng = np.random.default_rng(1)
    for name in ("train", "held"):
        np.savez(tmp / f"{name}.npz", a=rng.normal(size=(256, 48)).astype(np.float32))
    return tuple(import_array(ImportConfig(array=tmp / f"{n}.npz", out=tmp / f"noise-{n}")) for n in ("train", "held"))


GOES_BACK = dict(latents=512, k=2, tokens=128 * 200, stop_patience=8, stop_every=10, stop_threshold=0.01,
                 calibration_batches=0)
"""A stopping run on :func:`noise_stores` (topk) that memorises and goes back (``back_to``)."""


def held_apart(stores: list, held: list, hps: list[str], cfg: TrainConfig, start: int, part=(0, 1)):
    """The global batches from ``start`` on: ``held``'s rows first (one pass: the held-out batches), then ``stores``'
    (so the held-out rows are never trained on); ``part``: this rank's part of each batch."""
    first = stream_batches(held, hps, cfg.batch_size, seed=0, epochs=1, part=part)
    rest = stream_batches(stores, hps, cfg.batch_size, seed=cfg.seed, epochs=None, part=part)
    return itertools.islice(itertools.chain(first, rest), start, None)


def one_process_held_apart(store: Path, held: Path, cfg: TrainConfig, out: Path | None = None):
    """:func:`one_process` on ``store`` with its held-out batches from ``held`` (:func:`held_apart`)."""
    s, h = ActivationStore(store), ActivationStore(held)
    return train(cfg, lambda start: held_apart([s], [h], ["a"], cfg, start), out=out)


def base_config(kind: str, **over) -> dict:
    cfg = dict(kind=kind, latents=64, k=4, batch_size=128, tokens=128 * 14, eval_batches=2, init_rows=256,
               threshold_start_step=4, dead_tokens=300, aux_k=8, checkpoint_every=0, log_every=5,
               kernel_impl="torch", device="cpu", seed=3, lr=3e-3, l1_coeff=0.05, precision="float64")
    cfg.update(over)
    return flat_for_kind(cfg, kind)  # l1_coeff, threshold_start_step: for the kinds that read them


KINDS = [(kind, ["a", "b"] if reads_several_sources(kind) else ["a"])
         for kind, spec in sorted(ALL_KINDS.items()) if spec.trainable]


def one_process(store: Path, hps: list[str], cfg: TrainConfig, out: Path | None = None, resume: bool = False,
                sink=None):
    s = ActivationStore(store)
    return train(cfg, lambda start: stream_batches(s, hps, cfg.batch_size, seed=cfg.seed, epochs=None,
                                                   start_batch=start), out=out, resume=resume, sink=sink)


def torchrun(mode: str, spec: dict, tmp: Path, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp / f"spec-{mode}.json"
    path.write_text(json.dumps(spec))
    cmd = [str(TORCHRUN), f"--nproc_per_node={nproc}", "--master_port=0", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(ENTRY), mode, str(path)]
    run_env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")} | (env or {})
    return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300)


def failure(proc: subprocess.CompletedProcess) -> str:
    """The ranks' own tracebacks, without torchrun's summary."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join(ln for ln in lines if ln.startswith("[rank"))[-6000:] or proc.stderr[-4000:]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


FLOAT32_EPS = torch.finfo(torch.float32).eps


def ulps(a: dict, b: dict) -> float:
    """How far apart two dictionaries are, in float32 rounding units of each tensor's largest entry (eps32 * max |t|).

    The equivalence runs train in float64 (``precision="float64"``) and save float32. Two float64 runs that differ
    only in summation order (ranks, shards, CPU capability) differ by ~1e-14 relative, so their float32 roundings
    are equal or one unit apart: the bound is ``ulps <= 1``. A discrete choice made differently (a latent selected
    at one cut and not the other) moves weights by about the learning rate, millions of units."""
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        unit = FLOAT32_EPS * max(float(x.abs().max()), float(y.abs().max()), 1e-30) if x.numel() else 1.0
        worst = max(worst, float((x - y).abs().max()) / unit if x.numel() else 0.0)
    return worst


@pytest.mark.unit
def test_rank_rows_split_every_global_batch():
    assert [rank_rows(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ValueError, match="GLOBAL batch"):
        rank_rows(2, 0, 3)


@pytest.mark.unit
def test_rank_parts_concatenate_to_stream_batches(tmp_path):
    store = ActivationStore(synthetic_store(tmp_path, n=1000))
    ref = list(stream_batches(store, ["a", "b"], 96, seed=5, buffer_rows=300, start_batch=2))
    for world_size in (1, 2, 3):
        parts = [list(stream_batches(store, ["a", "b"], 96, seed=5, buffer_rows=300, start_batch=2,
                                     part=(r, world_size))) for r in range(world_size)]
        assert all(len(p) == len(ref) for p in parts)
        for i, batch in enumerate(ref):
            assert torch.equal(torch.cat([p[i] for p in parts]), batch)


class _StopAfter:
    """A metrics sink that interrupts training after ``step`` (a killed job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def write(self, record):
        if record["step"] > self.step:
            raise KeyboardInterrupt

    def close(self):
        pass


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One torchrun launch (startup dominates) for every run: each kind from scratch, and a BatchTopK run
    resumed under 2 ranks from a checkpoint one process wrote after step 6 of 14."""
    tmp = tmp_path_factory.mktemp("dp")
    store = synthetic_store(tmp)
    runs, refs = {}, {}
    for kind, hps in KINDS:
        cfg = base_config(kind)
        refs[kind] = {k: v.detach() for k, v in one_process(store, hps, train_config(**cfg)).state_dict().items()}
        runs[kind] = {"config": cfg, "stores": [str(store)], "hookpoints": hps,
                      "weights": str(tmp / f"{kind}.safetensors")}
    for kind in ("clt", "clt-batchtopk"):  # two layers: inputs a, c; outputs b, d (the tests above: one layer)
        cfg, hps = base_config(kind), ["a", "c", "b", "d"]
        refs[f"{kind}-2"] = {k: v.detach() for k, v in one_process(store, hps, train_config(**cfg)).state_dict().items()}
        runs[f"{kind}-2"] = {"config": cfg, "stores": [str(store)], "hookpoints": hps,
                             "weights": str(tmp / f"{kind}-2.safetensors")}
    cfg = base_config("batchtopk", checkpoint_every=6, log_every=1)
    out = tmp / "resumed"
    with pytest.raises(KeyboardInterrupt):
        one_process(store, ["a"], train_config(**cfg), out=out, sink=_StopAfter(6))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 6
    refs["resumed"] = refs["batchtopk"]
    runs["resumed"] = {"config": cfg, "stores": [str(store)], "hookpoints": ["a"], "out": str(out),
                       "resume": True, "weights": str(tmp / "resumed.safetensors")}
    runs["interrupted"] = {"config": cfg, "stores": [str(store)], "hookpoints": ["a"], "out": str(tmp / "interrupted"),
                           "interrupt_at": 11, "weights": str(tmp / "never.safetensors")}
    cfg = base_config("batchtopk", tokens=128 * 40, stop_patience=2, stop_every=3, stop_threshold=0.05)
    refs["stopping"] = {k: v.detach() for k, v in
                        one_process(store, ["a"], train_config(**cfg), out=tmp / "stop-1").state_dict().items()}
    runs["stopping"] = {"config": cfg, "stores": [str(store)], "hookpoints": ["a"], "out": str(tmp / "stop-2"),
                        "weights": str(tmp / "stopping.safetensors")}
    noise, held = noise_stores(tmp)
    cfg = base_config("topk", **GOES_BACK)
    refs["back"] = {k: v.detach() for k, v in
                    one_process_held_apart(noise, held, train_config(**cfg), out=tmp / "back-1").state_dict().items()}
    runs["back"] = {"config": cfg, "stores": [str(noise)], "held_out": [str(held)], "hookpoints": ["a"],
                    "out": str(tmp / "back-2"), "weights": str(tmp / "back.safetensors")}
    proc = torchrun("train", {"runs": list(runs.values())}, tmp)
    assert proc.returncode == 0, failure(proc)
    return runs, refs, store


@pytest.mark.integration
@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
def test_two_ranks_train_the_one_process_dictionary(two_rank_runs, kind):
    runs, refs, _ = two_rank_runs
    got = load_file(runs[kind]["weights"])
    assert max_diff(got, load_file(runs[kind]["weights"] + ".rank1")) == 0.0, f"{kind}: ranks disagree"
    diff = ulps(got, refs[kind])
    assert diff <= 1, f"{kind}: 2-rank weights differ from 1 process by {diff:.3g} float32 units"
    if kind in ("batchtopk", "crosscoder"):
        assert bool((got["threshold"] > 0).all()), f"{kind}: inference threshold never estimated"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
def test_two_ranks_train_the_one_process_two_layer_clt(two_rank_runs, kind):
    runs, refs, _ = two_rank_runs
    got = load_file(runs[f"{kind}-2"]["weights"])
    assert got["W_dec"].shape == (64, 2 * 12)
    assert max_diff(got, load_file(runs[f"{kind}-2"]["weights"] + ".rank1")) == 0.0, f"{kind}: ranks disagree"
    diff = ulps(got, refs[f"{kind}-2"])
    assert diff <= 1, f"{kind} over 2 layers: 2-rank weights differ from 1 process by {diff:.3g} float32 units"


@pytest.mark.integration
def test_one_process_checkpoint_resumes_under_two_ranks(two_rank_runs):
    runs, refs, _ = two_rank_runs
    diff = ulps(load_file(runs["resumed"]["weights"]), refs["resumed"])
    assert diff <= 1, f"resumed under 2 ranks: weights differ from the uninterrupted run by {diff:.3g} units"
    out = Path(runs["resumed"]["out"])
    assert (out / "weights.safetensors").exists() and (out / "config.json").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 14


@pytest.mark.integration
def test_two_rank_checkpoint_resumes_in_one_process(two_rank_runs):
    """A 2-rank run killed after step 7 (global batch 11: 2 held out, 2 to calibrate; checkpoint at step 6) finishes in ONE process with the weights of
    the uninterrupted run: the checkpoint does not depend on the number of ranks."""
    runs, refs, store = two_rank_runs
    run = runs["interrupted"]
    out = Path(run["out"])
    assert not Path(run["weights"]).exists()
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 6
    model = one_process(store, ["a"], train_config(**run["config"]), out=out, resume=True)
    diff = ulps({k: v.detach() for k, v in model.state_dict().items()}, refs["batchtopk"])
    assert diff <= 1, f"1-process resume of the 2-rank checkpoint differs from the uninterrupted run by {diff:.3g} units"


@pytest.mark.integration
def test_two_ranks_stop_where_one_process_stops(two_rank_runs):
    """The stopping rule on: the held-out FVU is summed over both ranks' parts, so they decide alike, at the step
    (and with the weights) of one process."""
    runs, refs, _ = two_rank_runs
    run = runs["stopping"]
    got = load_file(run["weights"])
    assert max_diff(got, load_file(run["weights"] + ".rank1")) == 0.0
    assert ulps(got, refs["stopping"]) <= 1
    one, two = (json.loads((Path(run["out"]).parent / d / "config.json").read_text())["training"]
                for d in ("stop-1", "stop-2"))
    assert one["stopping"]["fired_at"] is not None and one["steps"] == one["stopping"]["end_step"] < 40
    assert (two["steps"], two["stopping"]["fired_at"]) == (one["steps"], one["stopping"]["fired_at"])
    assert [h[0] for h in two["stopping"]["history"]] == [h[0] for h in one["stopping"]["history"]]
    assert [h[1] for h in two["stopping"]["history"]] == pytest.approx([h[1] for h in one["stopping"]["history"]],
                                                                       rel=1e-5)


@pytest.mark.integration
def test_two_ranks_go_back_where_one_process_goes_back(two_rank_runs):
    """A run that memorises: both ranks go back to the weights at the same lowest held-out FVU as one process."""
    runs, refs, _ = two_rank_runs
    got = load_file(runs["back"]["weights"])
    assert max_diff(got, load_file(runs["back"]["weights"] + ".rank1")) == 0.0
    assert ulps(got, refs["back"]) <= 1
    one, two = (json.loads((Path(runs["back"]["out"]).parent / d / "config.json").read_text())["training"]["stopping"]
                for d in ("back-1", "back-2"))
    assert one["back_to"] is not None and one["back_to"] < one["fired_at"]
    assert (two["back_to"], two["fired_at"], two["end_step"]) == (one["back_to"], one["fired_at"], one["end_step"])
