"""Evaluation during training (``train --eval-every N --metrics ...``, saes/during.py, api/train_eval.py): the
yardsticks of the dictionary as it stands are logged every N steps to metrics.jsonl, the run ends with the same
weights bit for bit, metrics whose inputs the run lacks are refused before training, and under torchrun rank 0 logs
the numbers one process logs (latent shards gathered)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.saes import KINDS, train, train_config

pytestmark = pytest.mark.integration

SMALL = {"hookpoint": "blocks.0.hook_out", "latents": 32, "k": 4, "batch_size": 32, "eval_batches": 1,
         "kernel_impl": "reference", "tokens": 32 * 12, "log_every": 3, "device": "cpu"}


def records(out: Path) -> tuple[list[dict], list[dict]]:
    """(step records, evaluation records) of a run's metrics.jsonl."""
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "fvu" in r], [r for r in lines if "eval/seconds" in r]


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
def test_eval_every_logs_core_and_leaves_the_weights_bit_identical(tiny_lm_store, tmp_path, kind):
    store = tiny_lm_store[0]
    cd.train(store=store, out=tmp_path / "plain", kind=kind, **SMALL)
    cd.train(store=store, out=tmp_path / "eval", kind=kind, eval_every=4, metrics="core", eval_contexts=4, **SMALL)
    plain, evaluated = (load_file(tmp_path / n / "weights.safetensors") for n in ("plain", "eval"))
    assert plain.keys() == evaluated.keys()
    for key in plain:
        assert torch.equal(plain[key], evaluated[key]), f"{kind}: {key} changed by --eval-every"
    steps_plain, none = records(tmp_path / "plain")
    steps, evals = records(tmp_path / "eval")
    assert not none
    assert [{k: v for k, v in r.items() if k != "tok_s"} for r in steps] == \
        [{k: v for k, v in r.items() if k != "tok_s"} for r in steps_plain]
    assert [r["step"] for r in evals] == [4, 8, 12]
    for r in evals:  # core under SAEBench's names, and CE/KL with the dictionary spliced into the tiny causal LM
        assert {"eval/core.explained_variance", "eval/core.l0", "eval/core.kl_div_score", "eval/core.ce_loss_score",
                "eval/core.frac_alive"} <= r.keys() and "rows" not in r
    # the last evaluation measured the dictionary the run saved, on the same held-out rows
    held = json.loads((tmp_path / "eval" / "config.json").read_text())["training"]["heldout_eval"]
    assert evals[-1]["eval/core.explained_variance_textbook"] == pytest.approx(1 - held["fvu"], rel=1e-6)
    assert evals[-1]["eval/core.l0"] == pytest.approx(held["l0"], rel=1e-6)
    assert evals[-1]["eval/core.total_tokens"] == held["n_tokens"]


def test_metrics_the_run_cannot_feed_are_refused_before_training(tiny_lm_store, tmp_path):
    store = tiny_lm_store[0]
    with pytest.raises(ValueError, match=r"^sparse-probing: needs a labelled store \(per-row label columns\); "):
        cd.train(store=store, out=tmp_path / "a", eval_every=4, metrics="core,sparse-probing", **SMALL)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="ground-truth: needs a store that records its true features"):
        cd.train(store=store, out=tmp_path / "b", eval_every=4, metrics=["ground-truth"], **SMALL)
    with pytest.raises(ValueError, match="unknown metric 'cores'; known: core"):
        cd.train(store=store, out=tmp_path / "c", eval_every=4, metrics="cores", **SMALL)
    with pytest.raises(ValueError, match="pass --eval-every N"):
        cd.train(store=store, out=tmp_path / "d", metrics="core", **SMALL)
    with pytest.raises(ValueError, match="eval_batches=0 holds none out"):
        cd.train(store=store, out=tmp_path / "e", eval_every=4, **{**SMALL, "eval_batches": 0})


def test_sparse_probing_during_training_on_a_labelled_store(tiny_sentence_store, tmp_path):
    store = tiny_sentence_store[0]
    cd.train(store=store, out=tmp_path / "sae", latents=16, k=2, batch_size=8, tokens=8 * 6, eval_batches=1,
             kernel_impl="reference", device="cpu", eval_every=3, metrics="sparse-probing,core")
    _, evals = records(tmp_path / "sae")
    assert [r["step"] for r in evals] == [3, 6]
    assert "eval/sparse-probing.sae_top_1_test_accuracy" in evals[0] and "eval/core.l0" in evals[0]
    assert "eval/core.kl_div_score" not in evals[0]  # a sentence encoder: no causal LM to splice into


def test_train_command_takes_eval_every_and_metrics(tiny_lm_store, tmp_path, capsys):
    out = tmp_path / "sae"
    assert main(["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "32",
                 "--k", "4", "--batch-size", "32", "--tokens", "256", "--eval-batches", "1", "--device", "cpu",
                 "--eval-every", "4", "--metrics", "core", "--eval-contexts", "0", "--out", str(out)]) == 0
    _, evals = records(out)
    assert [r["step"] for r in evals] == [4, 8] and "eval/core.kl_div_score" not in evals[0]  # 0 contexts: no splice
    assert json.loads((out / "config.json").read_text())["training"]["config"]["metrics"] == ["core"]


def test_saes_train_logs_the_heldout_headline_without_an_evaluator(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(64, 8, generator=g) for _ in range(10)]
    cfg = train_config(latents=16, k=2, batch_size=64, eval_batches=1, kernel_impl="reference", device="cpu",
                       eval_every=3, checkpoint_every=0)
    train(cfg, batches, out=tmp_path / "sae")
    _, evals = records(tmp_path / "sae")
    assert [r["step"] for r in evals] == [3, 6, 9] and {"eval/fvu", "eval/l0", "eval/dead_fraction"} <= evals[0].keys()
    with pytest.raises(ValueError, match="the yardsticks are computed by conceptdict.train"):
        train(train_config(latents=16, k=2, eval_every=3, metrics="core", device="cpu"), batches)


@pytest.mark.parametrize("kind", sorted(k for k, spec in KINDS.items() if spec.trainable))
def test_every_kind_evaluates_during_training_without_changing_its_weights(kind, tmp_path):
    spec = KINDS[kind]
    sources = 4 if spec.layered else 2 if spec.transcodes or spec.sources == "several" else 1
    shape = (64, sources, 8) if sources > 1 else (64, 8)
    batches = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    base = {"kind": kind, "latents": 32, "k": 4, "batch_size": 64, "eval_batches": 1, "tokens": 64 * 9, "seed": 1,
            "kernel_impl": "reference", "device": "cpu", "checkpoint_every": 0}
    train(train_config(**base), batches, out=tmp_path / "plain")
    train(train_config(**base, eval_every=3), batches, out=tmp_path / "eval")
    plain, evaluated = (load_file(tmp_path / n / "weights.safetensors") for n in ("plain", "eval"))
    assert all(torch.equal(plain[k], evaluated[k]) for k in plain), f"{kind}: --eval-every changed the weights"
    _, evals = records(tmp_path / "eval")
    held = json.loads((tmp_path / "eval" / "config.json").read_text())["training"]["heldout_eval"]
    assert [r["step"] for r in evals] == [3, 6, 9]
    assert evals[-1]["eval/fvu"] == pytest.approx(held["fvu"], rel=1e-6)  # the saved dictionary, measured at step 9
    assert evals[-1]["eval/l0"] == pytest.approx(held["l0"], rel=1e-6)


@pytest.mark.equivalence
def test_rank0_logs_the_one_process_evaluations_under_torchrun(tiny_lm_store, tmp_path, capsys):
    from test_distributed_cli import _cli
    from test_distributed_train import failure

    args = ["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "64", "--k",
            "4", "--kind", "topk", "--batch-size", "64", "--tokens", "512", "--eval-batches", "1", "--device", "cpu",
            "--precision", "float64", "--eval-every", "4", "--eval-contexts", "4"]
    evals = {}
    for name, nproc, more in (("one", 1, []), ("shards", 2, ["--latent-shards", "2"]), ("data", 2, [])):
        proc = _cli([*args, *more, "--out", str(tmp_path / name)], nproc, tmp_path, capsys)
        assert proc.returncode == 0, failure(proc)
        evals[name] = records(tmp_path / name)[1]
    for name in ("shards", "data"):
        assert [r["step"] for r in evals[name]] == [4, 8]
        for got, want in zip(evals[name], evals["one"]):
            for key in ("eval/core.explained_variance", "eval/core.l0", "eval/core.kl_div_score",
                        "eval/core.average_max_decoder_cosine_sim", "eval/core.frac_alive"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key)


def test_a_run_from_the_models_forward_splices_into_that_model(tiny_lm_dir, tmp_path):
    from fixtures_models import tiny_corpus

    dataset = tmp_path / "docs.jsonl"
    dataset.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(80)))
    common = ["--model", str(tiny_lm_dir), "--hookpoint", "blocks.1.hook_out", "--dataset", str(dataset),
              "--context-length", "32", "--forward-batch-size", "4", "--latents", "32", "--k", "4", "--batch-size",
              "32", "--tokens", str(32 * 12), "--eval-batches", "1", "--device", "cpu", "--buffer-rows", "256"]
    assert main(["train", *common, "--out", str(tmp_path / "plain")]) == 0
    assert main(["train", *common, "--eval-every", "6", "--eval-contexts", "4", "--out", str(tmp_path / "eval")]) == 0
    plain, evaluated = (load_file(tmp_path / n / "weights.safetensors") for n in ("plain", "eval"))
    assert all(torch.equal(plain[k], evaluated[k]) for k in plain)
    _, evals = records(tmp_path / "eval")
    assert [r["step"] for r in evals] == [6, 12]
    assert all(0 < r["eval/core.kl_div_with_ablation"] and "eval/core.ce_loss_score" in r for r in evals)
