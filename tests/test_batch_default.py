"""The default batch size and run length (``TrainConfig.batch_size`` and ``tokens`` None;
``saes.config.default_batch_size`` and ``default_tokens``): 4096 rows on long runs, halved down to 1024 while a run
would take fewer than 2000 steps and down to 256 on a store of fewer than 64 batches; one pass, or up to 2000 steps
and 100 passes over a smaller store (docs/results/batchtopk.md, "The default batch size and run length"). ``fit_to_store``
fills them in for ``conceptdict train`` and ``conceptdict diff``; training from a model takes the batch from
``--tokens``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.cli.main import main
from conceptdict.saes import TrainConfig
from conceptdict.saes.config import (default_batch_size, default_tokens, fit_to_store, heldout_batch_count,
                                     one_pass_rows)


@pytest.mark.unit
@pytest.mark.parametrize("rows,batch", [(None, 4096), (100_000_000, 4096), (8_192_000, 4096), (8_191_999, 2048),
                                        (4_096_000, 2048), (4_095_999, 1024), (2_000_000, 1024), (1000, 1024)])
def test_the_default_batch_halves_until_the_run_has_2000_steps_or_reaches_1024(rows, batch):
    assert default_batch_size(rows) == batch


@pytest.mark.unit
@pytest.mark.parametrize("store,batch", [(None, 1024), (10**9, 1024), (65_536, 1024), (65_535, 512), (32_767, 256),
                                         (1000, 256)])
def test_a_small_store_halves_the_batch_until_it_holds_64_batches_or_reaches_256(store, batch):
    assert default_batch_size(1_000_000, store) == batch


@pytest.mark.unit
def test_default_tokens_is_2000_steps_or_100_passes_and_never_less_than_one_pass():
    assert default_tokens(10_000_000, 4096) == 10_000_000  # one pass of 2441 steps
    assert default_tokens(200_000, 1024) == 2000 * 1024  # ten passes of 195 steps
    assert default_tokens(3000, 256) == 100 * 3000  # a small corpus: 100 passes, 1172 steps


@pytest.mark.unit
def test_fit_to_store_fills_the_batch_and_the_length_and_keeps_given_ones():
    cfg = TrainConfig(latents=64, k=4, kind="topk")  # holds out 4 eval batches, no calibration
    assert cfg.batch_size is None and cfg.tokens is None
    big = fit_to_store(cfg, 9_000_000)
    assert big.batch_size == 4096 and big.tokens == (9_000_000 // 4096 - 4) * 4096  # one pass: 2193 steps
    mid = fit_to_store(cfg, 3_000_000)
    assert mid.batch_size == 1024 and mid.tokens == (3_000_000 // 1024 - 4) * 1024  # one pass: 2925 steps
    small = fit_to_store(cfg, 200_000)
    assert small.batch_size == 1024 and small.tokens == 2000 * 1024  # ~10.5 passes
    long = fit_to_store(TrainConfig(latents=64, k=4, tokens=50_000_000), 3_000_000)
    assert (long.batch_size, long.tokens) == (4096, 50_000_000)  # given tokens decide the batch: 12k steps of 4096
    given = fit_to_store(TrainConfig(latents=64, k=4, batch_size=4096, tokens=1_000_000), 3_000_000)
    assert (given.batch_size, given.tokens) == (4096, 1_000_000)
    tiny = fit_to_store(TrainConfig(latents=64, k=4, kind="batchtopk", eval_batches=4, calibration_batches=2,
                                    batch_size=256), 1500)  # 4 + 2 held out: 256 does not fit
    assert tiny.batch_size == 1500 // (6 + 4) and tiny.tokens == 100 * (10 - 6) * tiny.batch_size
    with pytest.raises(ValueError, match="the store has 39 rows, too few to train on"):
        fit_to_store(cfg, 39)  # one evaluation batch held out: at least (1 + 4) * 8 rows
    with pytest.raises(ValueError, match="batch_size=0"):
        TrainConfig(latents=64, k=4, batch_size=0)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_heldout_rows_are_sized_to_the_store(kind, caplog):
    # a 2,000-row store used to hold out 4 x 256 evaluation + 2 x 256 calibration rows and train on ONE batch a
    # hundred times; now the held-out rows are a share of the store (saes.config.heldout_for_store) and the default
    # batch halves until they stay under a tenth of it
    small = fit_to_store(TrainConfig(latents=64, k=4, kind=kind), 2000)
    held = heldout_batch_count(small) * small.batch_size
    assert (small.batch_size, small.eval_batches, small.calibration_batches) == (64, 2, 1)  # any kind: one batch
    assert held <= 0.1 * 2000 and one_pass_rows(small, 2000) >= 1700
    # a large store keeps 4 evaluation + 2 calibration batches, as before
    large = fit_to_store(TrainConfig(latents=64, k=4, kind=kind), 1_000_000)
    assert (large.eval_batches, large.calibration_batches) == (4, 2)
    # given counts are kept; over a tenth held out is said
    with caplog.at_level("WARNING", logger="conceptdict.saes.config"):
        given = fit_to_store(TrainConfig(latents=64, k=4, kind=kind, eval_batches=4, batch_size=64), 2000)
    assert given.eval_batches == 4 and given.calibration_batches == 1
    assert "are held out of training" in caplog.text and "of the store's 2000 rows" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="conceptdict.saes.config"):
        fit_to_store(TrainConfig(latents=64, k=4, kind=kind), 1_000_000)
    assert "held out" not in caplog.text


@pytest.mark.integration
def test_train_without_batch_size_records_the_batch_it_chose(tmp_path, capsys):
    x = torch.randn(6000, 8, generator=torch.Generator().manual_seed(0))  # 23 batches of 256
    save_file({"acts": x}, str(tmp_path / "acts.safetensors"))
    assert main(["store", "import", str(tmp_path / "acts.safetensors"), "--out", str(tmp_path / "store")]) == 0
    assert main(["train", "--store", str(tmp_path / "store"), "--latents", "32", "--k", "2", "--kind", "topk",
                 "--eval-batches", "1", "--kernel-impl", "reference", "--out", str(tmp_path / "sae")]) == 0
    capsys.readouterr()
    train = json.loads((tmp_path / "sae" / "train_config.json").read_text())["train"]
    assert (train["batch_size"], train["tokens"]) == (256, 2000 * 256)  # 22 training batches: 91 passes
