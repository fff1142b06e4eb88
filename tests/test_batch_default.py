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
from conceptdict.saes.config import default_batch_size, default_tokens, fit_to_store


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
    tiny = fit_to_store(TrainConfig(latents=64, k=4, kind="batchtopk"), 1500)  # 4 + 2 held out: 256 does not fit
    assert tiny.batch_size == 1500 // (6 + 4) and tiny.tokens == 100 * (10 - 6) * tiny.batch_size
    with pytest.raises(ValueError, match="the store has 40 rows, too few to train on"):
        fit_to_store(cfg, 40)
    with pytest.raises(ValueError, match="batch_size=0"):
        TrainConfig(latents=64, k=4, batch_size=0)


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
