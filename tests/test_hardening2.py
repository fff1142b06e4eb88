"""Hardening, round two (issue 39, first part): bad values refused at the door with one line naming them, and no
exit 0 on a result that is wrong or empty (each case failed, or exited 0, before)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import conceptdict as cd
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("h2")
    np.save(root / "rows.npy", np.random.default_rng(0).standard_normal((2048, 8)).astype(np.float32))
    assert main(["store", "import", str(root / "rows.npy"), "--out", str(root / "store")]) == 0
    return root / "store"


def one_line(capsys) -> str:
    """The command's error: one line, no traceback (progress bars on stderr aside)."""
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if " error: " in ln]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("flag,value,says", [
    ("--lr", "inf", "lr=inf must be a finite number"),
    ("--lr", "nan", "lr=nan must be a finite number"),
    ("--aux-alpha", "inf", "aux_alpha=inf must be a finite number"),
    ("--code-l1", "nan", "code_l1=nan must be a finite number"),
])
def test_non_finite_numbers_are_refused_at_the_door(small_store, tmp_path, capsys, flag, value, says):
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", flag, value,
                 "--out", str(tmp_path / "sae")]) == 1
    assert says in one_line(capsys)
    assert not (tmp_path / "sae" / "weights.safetensors").exists()


def test_a_kind_setting_that_is_not_finite_is_refused():
    with pytest.raises(ValueError, match="l0_coeff=inf must be a finite number"):
        cd.train(store="unused", latents=16, k=2, kind="jumprelu", l0_coeff=float("inf"), out="unused")


def test_a_config_file_value_of_the_wrong_type_is_one_line(small_store, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"k": "eight", "latents": 16}))
    assert main(["train", "--store", str(small_store), "--config", str(cfg), "--out", str(tmp_path / "sae")]) == 1
    assert "k='eight' must be an integer, not str" in one_line(capsys)
    cfg.write_text(json.dumps({"k": 2, "latents": 16, "tokens": 4096.0, "lr": 1}))  # JSON numbers that fit are fine
    assert main(["train", "--store", str(small_store), "--config", str(cfg), "--out", str(tmp_path / "ok"),
                 "--kernel-impl", "reference"]) == 0


@pytest.mark.parametrize("kind", ["crosscoder", "crosscoder-l1"])
def test_a_crosscoder_over_one_source_is_refused(small_store, tmp_path, capsys, kind):
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--kind", kind,
                 "--out", str(tmp_path / "cc")]) == 1
    assert f"kind {kind!r} is a crosscoder" in one_line(capsys)


def test_an_empty_array_is_not_a_store(tmp_path, capsys):
    np.save(tmp_path / "empty.npy", np.zeros((0, 8), dtype=np.float32))
    assert main(["store", "import", str(tmp_path / "empty.npy"), "--out", str(tmp_path / "s")]) == 1
    assert "holds 0 rows" in one_line(capsys)
    assert not (tmp_path / "s").exists()


def test_a_dataset_of_blank_lines_caches_nothing_and_says_so(tmp_path, tiny_bert_dir, capsys):
    (tmp_path / "blank.txt").write_text("\n\n   \n\n")
    assert main(["cache", "--model", str(tiny_bert_dir), "--hookpoint", "sentence.mean_normalized", "--dataset",
                 str(tmp_path / "blank.txt"), "--out", str(tmp_path / "s")]) == 1
    assert "holds no text: all" in one_line(capsys)


def test_blank_records_are_skipped_not_cached(tmp_path, tiny_bert_dir):
    (tmp_path / "d.txt").write_text("alpha beta gamma\n\n   \ndelta epsilon\n")
    store = cd.cache(model=str(tiny_bert_dir), hookpoint="sentence.mean_normalized", dataset=str(tmp_path / "d.txt"),
                     out=tmp_path / "s")
    assert store.num_rows == 2 and store.row_context(1).text.strip() == "delta epsilon"


def test_a_label_column_the_dataset_lacks_is_refused_at_cache(tmp_path, tiny_bert_dir, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "hello world", "family": "a"}\n{"text": "more", "family": "b"}\n')
    assert main(["cache", "--model", str(tiny_bert_dir), "--hookpoint", "sentence.mean_normalized", "--dataset",
                 str(tmp_path / "d.jsonl"), "--label-column", "topic", "--out", str(tmp_path / "s")]) == 1
    err = one_line(capsys)
    assert "label column 'topic' is not in record 0" in err and "'family'" in err


def test_a_run_whose_loss_becomes_nan_stops_with_the_step(small_store, tmp_path, capsys, monkeypatch):
    from conceptdict.saes import training

    real = training.step
    calls = {"n": 0}

    def poisoned(run, x, cfg, lr, comm):
        calls["n"] += 1
        out = real(run, x, cfg, lr, comm)
        return {**out, "loss": float("nan")} if calls["n"] == 5 else out

    monkeypatch.setattr(training, "step", poisoned)
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--tokens", str(20 * 64),
                 "--batch-size", "64", "--kernel-impl", "reference", "--out", str(tmp_path / "sae")]) == 1
    err = one_line(capsys)
    assert "training diverged at step 5: the loss is nan" in err and "lower --lr" in err
    assert not (tmp_path / "sae" / "weights.safetensors").exists()  # no dictionary reported as trained
