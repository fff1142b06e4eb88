"""Training without a store: ``conceptdict train --model M --hookpoint H --dataset D`` (activations.live).

On the tiny local LM: the live stream's rows are the rows ``cache`` stores; it is deterministic with or without
its prefetching thread and skips to any batch without running the model for the fills before it; the dictionary
it trains matches, on held-out rows, one trained on a store cached from the same tokens with the same settings;
a run killed at a random batch and resumed ends with the uninterrupted run's weights (one dictionary, and one per
hookpoint of a single forward); under torchrun --nproc_per_node=2 it trains the one-process dictionary.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections import Counter
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, models
from conceptdict.activations import live as live_mod
from conceptdict.activations.live import LiveConfig, live_batches, open_model
from conceptdict.cli.main import main
from conceptdict.saes import evaluate, load_dictionary
from crashing import Crash, crashing
from fixtures_models import tiny_corpus

HPS = ["blocks.0.hook_out", "blocks.1.hook_out"]
ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "distributed_entry.py"


@pytest.fixture(scope="module")
def docs(tmp_path_factory, tiny_lm_dir):
    """(model dir, training documents .jsonl, a held-out store of other documents)."""
    root = tmp_path_factory.mktemp("live")
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(240)))
    held = CacheConfig(model=str(tiny_lm_dir), hookpoints=HPS, dataset="", out=root / "held", context_length=32,
                       batch_size=8, progress=False)
    return tiny_lm_dir, path, cache_activations(held, records=tiny_corpus(80, seed=9))


def _live(model_dir, dataset) -> LiveConfig:
    return LiveConfig(model=str(model_dir), dataset=str(dataset), context_length=32, forward_batch_size=4)


@pytest.mark.unit
def test_live_rows_are_the_cached_rows_in_a_deterministic_resumable_order(docs, tmp_path, monkeypatch):
    model_dir, dataset, _ = docs
    cfg = _live(model_dir, dataset)
    model = open_model(cfg, HPS, "cpu")
    kw = dict(seed=3, buffer_rows=200)
    seq = list(live_batches(cfg, model, HPS, 32, prefetch=0, **kw))
    pre = list(live_batches(cfg, model, HPS, 32, **kw))
    assert len(seq) > 20 and all(torch.equal(a, b) for a, b in zip(seq, pre)) and len(seq) == len(pre)
    assert seq[0].shape == (32, 2, 32) and seq[0].dtype == torch.float32

    calls, original = [0], models.capture
    monkeypatch.setattr(models, "capture", lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), original(*a, **k))[1])
    tail = list(live_batches(cfg, model, HPS, 32, start_batch=19, **kw))
    assert all(torch.equal(a, b) for a, b in zip(seq[19:], tail)) and len(tail) == len(seq) - 19
    forwards = -(-sum(1 for _ in open(dataset)) // 4)  # an upper bound: every forward batch of the dataset
    assert calls[0] < forwards * 0.6, "skipping to batch 19 ran the model over the fills before it"

    store = cache_activations(CacheConfig(model=str(model_dir), hookpoints=HPS, dataset=str(dataset), out=tmp_path / "s",
                                          context_length=32, batch_size=4, progress=False))
    s = ActivationStore(store)
    cached = Counter(tuple(r.tolist()) for r in s.rows(HPS[1], 0, s.num_rows))
    streamed = Counter(tuple(r.tolist()) for b in seq for r in b[:, 1])
    assert not streamed - cached  # every streamed row is a cached row, none more often (a causal LM repeats rows)
    assert streamed.total() > 0.9 * s.num_rows  # one pass; only the last incomplete batch is dropped


@pytest.mark.integration
def test_train_from_the_model_matches_training_on_its_cached_store(docs, tmp_path, capsys):
    model_dir, dataset, held = docs
    common = ["--latents", "64", "--k", "4", "--batch-size", "64", "--tokens", str(64 * 50), "--eval-batches", "2",
              "--seed", "1", "--device", "cpu", "--buffer-rows", "1024", "--kernel-impl", "torch"]
    assert main(["cache", "--model", str(model_dir), "--hookpoint", HPS[1], "--dataset", str(dataset),
                 "--context-length", "32", "--batch-size", "4", "--out", str(tmp_path / "store")]) == 0
    assert main(["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "stored"), *common]) == 0
    assert main(["train", "--model", str(model_dir), "--hookpoint", HPS[1], "--dataset", str(dataset),
                 "--context-length", "32", "--forward-batch-size", "4", "--out", str(tmp_path / "live"), *common]) == 0
    text = capsys.readouterr().out
    assert "held-out evaluation" in text and f"dictionary: {tmp_path / 'live'}" in text
    rows = ActivationStore(held).rows(HPS[1], 0, ActivationStore(held).num_rows)
    fvu = {name: evaluate(load_dictionary(tmp_path / name), [rows]).fvu for name in ("stored", "live")}
    assert fvu["live"] < 0.6, fvu
    assert abs(fvu["live"] - fvu["stored"]) <= 0.01, fvu
    cfg = json.loads((tmp_path / "live" / "config.json").read_text())
    assert cfg["hookpoints"] == [HPS[1]] and cfg["live"]["model"] == str(model_dir)


def _train_cli(model_dir, dataset, out: Path, *extra: str) -> int:
    return main(["train", "--model", str(model_dir), "--hookpoint", HPS[0], "--hookpoint", HPS[1], "--dataset",
                 str(dataset), "--context-length", "32", "--forward-batch-size", "4", "--latents", "48", "--k", "4",
                 "--batch-size", "32", "--tokens", str(32 * 30), "--eval-batches", "2", "--buffer-rows", "160",
                 "--checkpoint-every", "4", "--init-rows", "64", "--kernel-impl", "torch", "--device", "cpu", "--out", str(out), *extra])


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_killed_at_a_random_batch_and_resumed_ends_as_the_uninterrupted_run(docs, tmp_path, monkeypatch, seed):
    """One forward feeds a dictionary per hookpoint (OUT/HOOKPOINT); the run dies at a random batch, and
    `--resume` continues both from their checkpoints to the uninterrupted run's weights, bit for bit."""
    model_dir, dataset, _ = docs
    assert _train_cli(model_dir, dataset, tmp_path / "full") == 0
    at = random.Random(seed).randint(9, 30)
    original = live_mod.live_batches
    monkeypatch.setattr(live_mod, "live_batches", lambda *a, start_batch=0, **k: crashing(
        lambda s: original(*a, start_batch=s, **k), at)(start_batch))
    with pytest.raises(Crash):
        _train_cli(model_dir, dataset, tmp_path / "cut", "--debug")
    monkeypatch.setattr(live_mod, "live_batches", original)
    assert _train_cli(model_dir, dataset, tmp_path / "cut", "--resume") == 0
    for hp in HPS:
        full, cut = load_file(tmp_path / "full" / hp / "weights.safetensors"), load_file(
            tmp_path / "cut" / hp / "weights.safetensors")
        assert all(torch.equal(full[k], cut[k]) for k in full), f"{hp}: resumed weights differ (crash at {at})"
    assert not torch.equal(load_file(tmp_path / "full" / HPS[0] / "weights.safetensors")["W_dec"],
                           load_file(tmp_path / "full" / HPS[1] / "weights.safetensors")["W_dec"])


@pytest.mark.integration
def test_a_sweep_from_the_model_equals_its_separate_runs_and_runs_each_forward_once(docs, tmp_path, monkeypatch):
    """`train --model ... --sweep k=A,B --sweep kind=topk,batchtopk`: four dictionaries from one pass over the
    model's forward, each equal bit for bit (weights, metrics, held-out evaluation) to its separate run with the
    same seed; the sweep runs the model over each forward batch as often as ONE separate run does."""
    from test_sweep import same_run

    model_dir, dataset, _ = docs
    calls, original = [0], models.capture
    monkeypatch.setattr(models, "capture", lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), original(*a, **k))[1])
    # no read-ahead thread, so that the forwards counted are the ones the training needs, whatever the timing
    monkeypatch.setattr(live_mod, "live_batches", functools.partial(live_mod.live_batches, prefetch=0))
    base = ["train", "--model", str(model_dir), "--hookpoint", HPS[1], "--dataset", str(dataset), "--context-length",
            "32", "--forward-batch-size", "4", "--latents", "48", "--batch-size", "32", "--tokens", str(32 * 20),
            "--eval-batches", "2", "--buffer-rows", "160", "--seed", "2", "--init-rows", "64", "--kernel-impl",
            "torch", "--device", "cpu", "--log-every", "3"]
    forwards = {}
    for k, kind in itertools.product((3, 5), ("topk", "batchtopk")):
        calls[0] = 0
        assert main([*base, "--k", str(k), "--kind", kind, "--out", str(tmp_path / f"alone-{k}-{kind}")]) == 0
        forwards[kind] = calls[0]
    calls[0] = 0
    assert main([*base, "--sweep", "k=3,5", "--sweep", "kind=topk,batchtopk", "--out",
                 str(tmp_path / "sweep")]) == 0
    for k, kind in itertools.product((3, 5), ("topk", "batchtopk")):
        same_run(tmp_path / f"alone-{k}-{kind}", tmp_path / "sweep" / f"k-{k}_kind-{kind}")
    assert calls[0] == max(forwards.values()), (calls[0], forwards)  # batchtopk holds out 2 more batches


@pytest.mark.integration
@pytest.mark.parametrize("extra", [[], ["--latent-shards", "2"]], ids=["data-parallel", "latent-shards"])
def test_two_ranks_train_the_one_process_dictionary(docs, tmp_path, extra):
    """torchrun --nproc_per_node=2: each rank runs the model on its forward batches; the result is the
    one-process dictionary (the store-based tolerance, test_distributed_train.py). With --latent-shards 2 both
    ranks are one data part: each runs every forward batch and holds half the latents."""
    from test_distributed_train import TORCHRUN, failure

    model_dir, dataset, _ = docs
    args = ["train", "--model", str(model_dir), "--hookpoint", HPS[1], "--dataset", str(dataset), "--context-length",
            "32", "--forward-batch-size", "4", "--kind", "batchtopk-absolute", "--latents", "64", "--k", "4",
            "--batch-size", "64", "--tokens", "640", "--buffer-rows", "256", "--seed", "1", "--device", "cpu",
            "--kernel-impl", "torch"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argv": [*args, *extra, "--out", str(tmp_path / "two")]}))
    cmd = [str(TORCHRUN), "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", str(ENTRY),
           "cli", str(spec)]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "tests"),
           **{k: v for k, v in __import__("os").environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)
    one, two = load_file(tmp_path / "one" / "weights.safetensors"), load_file(tmp_path / "two" / "weights.safetensors")
    diff, key = max((float((one[k] - two[k]).abs().max()), k) for k in one)
    assert diff < 1e-4, f"train --model on 2 ranks differs from 1 process by {diff:.2e} (in {key})"


@pytest.mark.unit
def test_train_from_a_model_refuses_incomplete_flags(tmp_path, capsys):
    base = ["train", "--latents", "8", "--k", "2", "--out", str(tmp_path / "o")]
    cases = [(["--model", "m", "--dataset", "d", "--hookpoint", "h"], "needs --tokens"),
             (["--model", "m", "--dataset", "d", "--hookpoint", "h", "--tokens", "64", "--store", "s"], "not both"),
             (["--dataset", "d", "--store", "s"], "add --model")]
    for extra, message in cases:
        assert main([*base, *extra]) == 1
        assert message in capsys.readouterr().err
