"""`conceptdict train` and `conceptdict eval` on stores: an imported array store and a cached tiny-LM store."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.cli.main import main
from conceptdict.saes import load_dictionary, load_dictionary_config
from generators.synthetic import SyntheticSpec, synthetic_batches

SPEC = SyntheticSpec(n_atoms=64, d=16, active=3, batch_size=256, n_batches=12, seed=5)
FAST = ["--kernel-impl", "reference", "--batch-size", "256", "--eval-batches", "2", "--log-every", "5"]


@pytest.fixture(scope="module")
def array_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("arr")
    x = torch.cat(list(synthetic_batches(SPEC)))
    save_file({"acts": x.contiguous(), "twin": (2 * x.flip(1)).contiguous()}, str(root / "acts.safetensors"))
    assert main(["store", "import", str(root / "acts.safetensors"), "--out", str(root / "store")]) == 0
    return root / "store"


@pytest.mark.integration
def test_train_then_eval_on_an_imported_store(tmp_path, array_store, capsys):
    out = tmp_path / "sae"
    rc = main(["train", "--store", str(array_store), "--hookpoint", "acts", "--latents", "64", "--k", "4",
               "--kind", "batchtopk", "--out", str(out), *FAST])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "held-out evaluation" in text and "FVU (textbook)" in text and "L0 (inference)" in text
    cfg = load_dictionary_config(out)
    assert cfg["hookpoints"] == ["acts"] and cfg["stores"] == [str(array_store.resolve())]
    # default tokens: 100 passes over the training rows (2 batches held out for evaluation, 1 to calibrate the
    # threshold, sized to the 12-batch store (saes.config.CALIBRATION_SHARE), 9 to train on: fewer than
    # saes.config.TARGET_STEPS in 100 passes)
    assert cfg["training"]["rows"] == 100 * (3072 // 256 - 3) * 256
    assert json.loads((out / "train_config.json").read_text())["train"]["k"] == 4
    assert (out / "metrics.jsonl").read_text().count("\n") == 900 // 5  # 900 steps, a line every 5

    # by default eval rebuilds training's held-out batches: the same rows, so the same numbers
    assert main(["eval", str(out)]) == 0
    text = capsys.readouterr().out
    assert "explained variance (SAEBench formula)" in text and "CE loss recovered" not in text
    assert "held-out batches" in text
    record = json.loads((out / "eval.json").read_text())
    assert record["hookpoint"] == "acts" and record["metrics"]["n_tokens"] == 2 * 256
    held = cfg["training"]["heldout_eval"]
    assert abs(record["metrics"]["fvu"] - held["fvu"]) < 1e-5 and abs(record["metrics"]["l0"] - held["l0"]) < 1e-4
    assert len(record["metrics"]["density"]) == 64
    assert record["metrics"]["fvu"] < 0.9
    assert main(["eval", str(out), "--rows-from", "start"]) == 0
    assert "first rows of the store" in capsys.readouterr().out
    assert json.loads((out / "eval.json").read_text())["metrics"]["n_tokens"] == 3072

    # a finished run resumes to the same weights; an existing dictionary is not overwritten silently
    before = load_dictionary(out).W_dec.clone()
    assert main(["train", "--store", str(array_store), "--hookpoint", "acts", "--latents", "64", "--k", "4",
                 "--kind", "batchtopk", "--out", str(out), "--resume", *FAST]) == 0
    assert torch.equal(load_dictionary(out).W_dec, before)
    assert main(["train", "--store", str(array_store), "--hookpoint", "acts", "--latents", "64", "--k", "4",
                 "--out", str(out), *FAST]) == 1
    assert "already holds a dictionary" in capsys.readouterr().err


@pytest.mark.integration
def test_two_hookpoints_train_a_crosscoder(tmp_path, array_store, capsys):
    out = tmp_path / "cc"
    assert main(["train", "--store", str(array_store), "--hookpoint", "acts", "--hookpoint", "twin",
                 "--kind", "crosscoder", "--latents", "64", "--k", "4", "--out", str(out), *FAST]) == 0
    assert "sources=2" in capsys.readouterr().out
    model = load_dictionary(out)
    assert model.n_sources == 2 and model.decoder_directions().shape == (64, 2, 16)
    cfg = load_dictionary_config(out)
    assert cfg["hookpoints"] == ["acts", "twin"] and len(cfg["normalisation"]["scale_per_source"]) == 2
    assert len(cfg["training"]["heldout_eval"]["per_source_fvu"]) == 2


@pytest.mark.integration
def test_jumprelu_thresholds_are_calibrated_and_reported(tmp_path, array_store, capsys):
    """JumpReLU's learned thresholds are scaled by one factor on rows never trained on, and both train and eval
    say so (with the same held-out figures)."""
    out = tmp_path / "jr"
    assert main(["train", "--store", str(array_store), "--hookpoint", "acts", "--latents", "64", "--k", "4",
                 "--kind", "jumprelu", "--out", str(out), *FAST]) == 0
    text = capsys.readouterr().out
    # one calibration batch: 2.5% of the 12-batch store rounds up to one (saes.config.CALIBRATION_SHARE)
    assert "inference thresholds learned per latent" in text and "for mean L0 = k = 4 on 256 rows" in text
    info = load_dictionary_config(out)["training"]["threshold"]
    assert info["calibrated_on_rows"] == 256 and info["factor"] > 0
    assert main(["eval", str(out)]) == 0
    assert "scaled by one factor" in capsys.readouterr().out


@pytest.mark.unit
def test_train_cli_refusals(tmp_path, array_store, capsys):
    assert main(["train", "--store", str(array_store), "--latents", "8", "--k", "8", "--out", str(tmp_path)]) == 1
    assert "k=8 must be at least 1 and below latents=8" in capsys.readouterr().err
    assert main(["train", "--store", str(array_store), "--k", "8", "--out", str(tmp_path)]) == 1
    assert "needs --latents" in capsys.readouterr().err
    assert main(["train", "--store", str(array_store), "--latents", "32", "--k", "2", "--out", str(tmp_path)]) == 1
    assert "holds hookpoints ['acts', 'twin']; pick with --hookpoint" in capsys.readouterr().err
    assert main(["train", "--store", str(array_store), "--hookpoint", "acts", "--latents", "32", "--k", "2",
                 "--d-in", "17", "--out", str(tmp_path / "x"), *FAST]) == 1
    assert f"config d_in=17 but store {array_store}, hookpoint acts has D=16" in capsys.readouterr().err


@pytest.mark.integration
def test_train_and_eval_with_ce_loss_on_a_cached_lm_store(tmp_path, tiny_lm_store, capsys):
    store, model_dir = tiny_lm_store
    out = tmp_path / "sae"
    rc = main(["train", "--store", str(store), "--hookpoint", "blocks.1.hook_out", "--latents", "64", "--k", "4",
               "--out", str(out), "--batch-size", "128", "--eval-batches", "1", "--kernel-impl", "reference"])
    assert rc == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(["eval", str(out), "--model", str(model_dir), "--contexts", "8"]) == 0
    text = capsys.readouterr().out
    assert "CE loss recovered" in text and "KL score" in text
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    splice = metrics["splice"]
    want = (splice["ce_zero"] - splice["ce_replaced"]) / (splice["ce_zero"] - splice["ce_clean"])
    assert metrics["ce_loss_recovered"] == pytest.approx(want)
    assert main(["eval", str(out), "--hookpoint", "blocks.9.hook_out"]) == 1
    assert "hookpoint 'blocks.9.hook_out' is not in store" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--store" in text and ("--latents" in text) == (command == "train")
