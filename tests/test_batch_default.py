"""The default batch size (``TrainConfig.batch_size`` None, ``saes.config.default_batch_size``): 4096 rows on long
runs, halved down to 1024 while a run would take fewer than 2000 steps (docs/batchtopk.md, "The default batch
size"), filled in by ``fit_to_store`` for ``conceptdict train`` and ``conceptdict diff`` and from ``--tokens`` for
training from a model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.cli.main import main
from conceptdict.saes import TrainConfig
from conceptdict.saes.config import default_batch_size, fit_to_store


@pytest.mark.unit
@pytest.mark.parametrize("rows,batch", [(None, 4096), (100_000_000, 4096), (8_192_000, 4096), (8_191_999, 2048),
                                        (4_096_000, 2048), (4_095_999, 1024), (2_000_000, 1024), (1000, 1024)])
def test_the_default_batch_halves_until_the_run_has_2000_steps_or_reaches_1024(rows, batch):
    assert default_batch_size(rows) == batch


@pytest.mark.unit
def test_fit_to_store_fills_the_batch_from_tokens_or_one_pass_and_keeps_a_given_one():
    cfg = TrainConfig(latents=64, k=4, kind="topk")  # holds out 4 eval batches, no calibration
    assert cfg.batch_size is None
    one_pass = fit_to_store(cfg, 3_000_000)
    assert one_pass.batch_size == 1024 and one_pass.tokens == (3_000_000 // 1024 - 4) * 1024
    long = fit_to_store(TrainConfig(latents=64, k=4, tokens=50_000_000), 3_000_000)
    assert (long.batch_size, long.tokens) == (4096, 50_000_000)  # more passes over the store: 12k steps of 4096
    given = fit_to_store(TrainConfig(latents=64, k=4, batch_size=4096), 3_000_000)
    assert given.batch_size == 4096 and given.tokens == (3_000_000 // 4096 - 4) * 4096
    small = fit_to_store(TrainConfig(latents=64, k=4, kind="batchtopk"), 3072)  # 4 + 2 held out: 1024 does not fit
    assert small.batch_size == 3072 // (6 + 4) and small.tokens == (10 - 6) * small.batch_size
    with pytest.raises(ValueError, match="the store has 40 rows, too few to train on"):
        fit_to_store(cfg, 40)
    with pytest.raises(ValueError, match="batch_size=0"):
        TrainConfig(latents=64, k=4, batch_size=0)


@pytest.mark.integration
def test_train_without_batch_size_records_the_batch_it_chose(tmp_path, capsys):
    x = torch.randn(6000, 8, generator=torch.Generator().manual_seed(0))
    save_file({"acts": x}, str(tmp_path / "acts.safetensors"))
    assert main(["store", "import", str(tmp_path / "acts.safetensors"), "--out", str(tmp_path / "store")]) == 0
    assert main(["train", "--store", str(tmp_path / "store"), "--latents", "32", "--k", "2", "--kind", "topk",
                 "--eval-batches", "1", "--kernel-impl", "reference", "--out", str(tmp_path / "sae")]) == 0
    capsys.readouterr()
    train = json.loads((tmp_path / "sae" / "train_config.json").read_text())["train"]
    assert (train["batch_size"], train["tokens"]) == (1024, (6000 // 1024 - 1) * 1024)
