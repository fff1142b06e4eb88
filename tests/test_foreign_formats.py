"""Dictionaries made by other libraries load, encode and decode as those libraries do, and run through the CLI.

The fixtures in tests/fixtures/foreign were written by sae-lens, eai-sparsify and dictionary-learning
themselves (tests/fixtures/foreign/make_fixtures.py, versions in versions.json), with each library's own
encode/decode outputs on fixed inputs in reference.safetensors. The slow test reruns that script in the side
environment ``.venv-interop`` and checks the regenerated outputs agree.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conceptdict.cli.main import main
from conceptdict.saes import FormatError, SparseCoder, load_dictionary, load_dictionary_config, open_dictionary
from conceptdict.saes.formats import detect_format

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "foreign"
SIDE_PYTHON = ROOT / ".venv-interop" / "bin" / "python"
REF = load_file(str(FIXTURES / "reference.safetensors"))
GEMMA = "gemma-scope-2b-pt-res/layer_0/width_16k/average_l0_5"
# fixture -> (format, kind it becomes, k, folder to pass)
CASES = {
    "saelens-standard": ("saelens", "relu", 1, "saelens-standard"),
    "saelens-topk": ("saelens", "topk", 4, "saelens-topk"),
    "saelens-topk-rescaled": ("saelens", "topk", 4, "saelens-topk-rescaled"),
    "saelens-jumprelu": ("saelens", "jumprelu", 1, "saelens-jumprelu"),
    "saelens-gated": ("saelens", "gated", 1, "saelens-gated"),
    "saelens-normalized": ("saelens", "relu", 1, "saelens-normalized"),
    "sparsify": ("sparsify", "topk", 4, "sparsify"),
    "sparsify-multi-topk": ("sparsify", "topk", 4, "sparsify-multi-topk/h.0"),
    "dl-autoencoder": ("dictionary-learning", "relu", 1, "dl-autoencoder"),
    "dl-topk": ("dictionary-learning", "topk", 4, "dl-topk"),
    "dl-batchtopk": ("dictionary-learning", "batchtopk-absolute", 4, "dl-batchtopk"),
    "dl-jumprelu": ("dictionary-learning", "jumprelu", 1, "dl-jumprelu"),
    "dl-gated": ("dictionary-learning", "gated", 1, "dl-gated"),
    "gemma-scope": ("gemma-scope", "jumprelu", 1, GEMMA),
}
ATOL = 1e-5  # folding b_dec / normalisation into the weights reorders float32 sums; measured max 2.4e-6


def max_differences(root: Path, ref: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """fixture -> (max |codes - library codes|, max |recon - library recon|) for the dictionaries under root."""
    out = {}
    for name, (_, _, _, folder) in CASES.items():
        model = load_dictionary(root / folder)
        with torch.no_grad():
            f = model.encode(ref["x"])
            out[name] = (float((f - ref[f"{name}/codes"]).abs().max()),
                         float((model.decode(f) - ref[f"{name}/recon"]).abs().max()))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CASES))
def test_load_encode_decode_match_the_library(name):
    fmt, kind, k, folder = CASES[name]
    model, config = open_dictionary(FIXTURES / folder)
    assert (config["source_format"], model.kind, model.k, model.d_in, model.n_latents) == (fmt, kind, k, 32, 40)
    assert config["hookpoints"] == ["blocks.0.hook_out"]  # every fixture sits at layer 0's residual output
    codes, recon = max_differences(FIXTURES, REF)[name]
    print(f"{name}: max abs difference codes {codes:.2e}, reconstruction {recon:.2e}")
    assert codes <= ATOL and recon <= ATOL


@pytest.mark.unit
def test_formats_are_recognised_by_their_files_and_hookpoints_mapped(caplog, tmp_path):
    assert detect_format(FIXTURES / "saelens-topk") == "saelens"
    assert detect_format(FIXTURES / "sparsify") is None  # the run folder: one subfolder per hookpoint
    assert detect_format(FIXTURES / "sparsify" / "h.0") == "sparsify"
    assert detect_format(FIXTURES / "dl-gated") == "dictionary-learning"
    assert detect_format(FIXTURES / GEMMA) == "gemma-scope"
    fresh = shutil.copytree(FIXTURES / "saelens-jumprelu", tmp_path / "jumprelu")  # the mapping is shown once
    with caplog.at_level("INFO", logger="conceptdict.saes.formats"):
        config = load_dictionary_config(fresh)
        load_dictionary(fresh)
    assert config["hookpoint_mapping"] == {"blocks.0.hook_resid_post": "blocks.0.hook_out"}
    assert caplog.text.count("'blocks.0.hook_resid_post' -> conceptdict hookpoint 'blocks.0.hook_out'") == 1
    assert load_dictionary_config(FIXTURES / "sparsify")["hookpoint_mapping"] == {"h.0": "blocks.0.hook_out"}
    assert load_dictionary_config(FIXTURES / "dl-topk")["hookpoint_mapping"] == {
        "resid_post_layer_0": "blocks.0.hook_out"}
    gemma = load_dictionary_config(FIXTURES / GEMMA)
    assert gemma["model"] == "google/gemma-2-2b" and gemma["hookpoints"] == ["blocks.0.hook_out"]


@pytest.mark.unit
def test_saelens_jumprelu_without_our_metadata_keeps_its_thresholds():
    model = load_dictionary(FIXTURES / "saelens-jumprelu")
    thr = load_file(str(FIXTURES / "saelens-jumprelu" / "sae_weights.safetensors"))["threshold"]
    assert model.kind == "jumprelu" and torch.equal(model.threshold, thr)
    with pytest.raises(ValueError, match="imported for inference only"):
        from conceptdict.saes import TrainConfig

        TrainConfig(kind="gated", latents=40, k=4)


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / CASES[name][3], tmp_path / name))


@pytest.mark.unit
def test_bad_files_get_clear_errors_naming_the_file(tmp_path):
    d = _copy("saelens-topk", tmp_path)
    weights = d / "sae_weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(pickle.dumps({"W_enc": [1.0, 2.0]}))
    with pytest.raises(FormatError, match=rf"{weights}.*should be safetensors but is a Python pickle"):
        load_dictionary(d)
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(FormatError, match=rf"{weights} is not a readable safetensors file.*truncated"):
        load_dictionary(d)
    weights.write_bytes(good)
    cfg = json.loads((d / "cfg.json").read_text())
    (d / "cfg.json").write_text(json.dumps(cfg | {"d_sae": 48}))
    with pytest.raises(FormatError, match=rf"{weights}: tensor 'W_enc' has shape \[32, 40\] but .*cfg.json implies "
                                          rf"\[32, 48\]"):
        load_dictionary(d)
    ae = _copy("dl-topk", tmp_path) / "ae.pt"
    ae.write_bytes(ae.read_bytes()[:300])
    with pytest.raises(FormatError, match=rf"{ae} could not be read as a torch.save file.*truncated"):
        load_dictionary(ae.parent)

    torch.save({"W_enc": Path("/etc")}, ae)  # a pickle that needs a Python class: refused, never unpickled
    with pytest.raises(FormatError, match=rf"{ae} holds Python objects other than tensors"):
        load_dictionary(ae.parent)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(FormatError, match=r"is not a dictionary in any format.*'model.bin'.*saelens needs cfg.json.*"
                                          r"sparsify needs .*dictionary-learning needs ae.pt.*gemma-scope needs"):
        load_dictionary(unknown)


@pytest.mark.unit
def test_refusals_name_the_reason(tmp_path):
    d = _copy("saelens-normalized", tmp_path)
    (d / "activation_scaler.json").unlink()
    with pytest.raises(FormatError, match="stores no scaling factor"):
        load_dictionary(d)
    cfg = json.loads((d / "cfg.json").read_text())
    (d / "cfg.json").write_text(json.dumps(cfg | {"normalize_activations": "constant_norm_rescale"}))
    with pytest.raises(FormatError, match="not an affine map"):
        load_dictionary(d)
    s = _copy("sparsify-multi-topk", tmp_path)
    cfg = json.loads((s / "cfg.json").read_text())
    (s / "cfg.json").write_text(json.dumps(cfg | {"skip_connection": True}))
    with pytest.raises(FormatError, match="W_skip"):
        load_dictionary(s)
    (s / "cfg.json").write_text(json.dumps(cfg | {"transcode": True}))
    loaded = open_dictionary(s)
    assert loaded.config["transcoder"] is True  # encodes x without subtracting b_dec, folded exactly
    t = load_file(str(s / "sae.safetensors"))
    x = REF["x"]
    want = torch.relu(x @ t["encoder.weight"].T + t["encoder.bias"])
    top = want.topk(4, dim=1)
    want = torch.zeros_like(want).scatter_(1, top.indices, top.values)
    assert torch.allclose(loaded.model.encode(x), want, atol=1e-5)


@pytest.mark.unit
def test_several_hookpoints_need_one_to_be_picked(tmp_path):
    run = tmp_path / "run"
    for hp in ("h.0", "h.1"):
        shutil.copytree(FIXTURES / "sparsify" / "h.0", run / hp)
    with pytest.raises(FormatError, match=r"holds 2 dictionaries, one per hookpoint: .*h.0, .*h.1; pass one"):
        load_dictionary(run)
    assert load_dictionary_config(run / "h.1")["hookpoints"] == ["blocks.1.hook_out"]


def _fake_hub_cache(cache: Path, repo: str, commit: str, files: dict[str, Path]) -> None:
    """The layout huggingface_hub's cache uses: refs/main -> snapshots/COMMIT/<files>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for rel, src in files.items():
        dst = root / "snapshots" / commit / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)


@pytest.mark.unit
def test_hub_names_read_the_cache_offline_and_say_when_the_network_is_needed(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    src = FIXTURES / "saelens-gated"
    _fake_hub_cache(cache, "someone/tiny-saes", "a" * 40,
                    {f"layer_0/{f.name}": f for f in src.iterdir()})  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = load_dictionary("hf:someone/tiny-saes/layer_0")
    assert model.kind == "gated" and torch.equal(model.W_dec, load_dictionary(src).W_dec)
    assert load_dictionary(Path("hf:someone/tiny-saes/layer_0@main")).kind == "gated"  # argparse gives a Path
    with pytest.raises(FormatError, match=r"hf:someone/absent: repo 'someone/absent' is not in the Hugging Face cache "
                                          r"and downloading it needs the network"):
        load_dictionary("hf:someone/absent")
    with pytest.raises(FormatError, match="write hf:OWNER/REPO"):
        load_dictionary("hf:justaname")


@pytest.mark.integration
@pytest.mark.parametrize("name", ["saelens-jumprelu", "sparsify", "dl-gated", "gemma-scope"])
def test_cli_eval_name_cbm_export_on_foreign_dictionaries(name, tiny_lm_store, tiny_sentence_store, tmp_path,
                                                          capsys):  # fmt: skip
    store, model_dir = tiny_lm_store
    sae = str(FIXTURES / CASES[name][3])
    rc = main(["eval", sae, "--store", str(store), "--model", str(model_dir), "--contexts", "4",
               "--out", str(tmp_path / "eval.json")])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["hookpoint"] == "blocks.0.hook_out" and "ce_loss_recovered" in record["metrics"]
    # the labelled store is the tiny BERT's sentence embeddings (D = 32 too): name and cbm there, by flag
    sentences, bert = tiny_sentence_store
    concepts = tmp_path / "concepts"
    rc = main(["name", sae, "--store", str(sentences), "--hookpoint", "sentence.mean_normalized", "--namer",
               "logit-lens", "--model", str(model_dir), "--out", str(concepts)])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    assert len(json.loads((concepts / "concepts.json").read_text())["concepts"]) == 40
    rc = main(["cbm", str(concepts), "--label-column", "topic", "--lam",
               "0.01", "--min-class-size", "3", "--out", str(tmp_path / "cbm")])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    assert json.loads((tmp_path / "cbm" / "cbm.json").read_text())["classes"] == ["animals", "food", "weather"]
    assert main(["export", str(concepts), "--format", "html", "--out", str(tmp_path / "html")]) == 0
    assert (tmp_path / "html" / "index.html").exists()


@pytest.mark.slow
def test_fixtures_regenerate_with_the_real_libraries(tmp_path):
    if not SIDE_PYTHON.exists():
        pytest.skip("no .venv-interop (see tests/fixtures/foreign/make_fixtures.py for how to make it)")
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([str(SIDE_PYTHON), str(FIXTURES / "make_fixtures.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = load_file(str(tmp_path / "reference.safetensors"))
    assert set(ref) == set(REF) and all(torch.allclose(ref[k], REF[k], atol=1e-6) for k in REF)
    diffs = max_differences(tmp_path, ref)
    print(json.dumps(diffs, indent=1))
    assert all(c <= ATOL and r <= ATOL for c, r in diffs.values())


def test_fixture_names_cover_every_reference():
    assert {k.split("/")[0] for k in REF if "/" in k} == set(CASES)
    assert SparseCoder  # the loaders return the project's one module


@pytest.mark.unit
def test_saelens_gated_without_b_dec_on_the_input_folds_both_paths(tmp_path):
    d = _copy("saelens-gated", tmp_path)
    cfg = json.loads((d / "cfg.json").read_text())
    (d / "cfg.json").write_text(json.dumps(cfg | {"apply_b_dec_to_input": False}))
    t = load_file(str(d / "sae_weights.safetensors"))
    x = REF["x"]
    # sae-lens GatedSAE.encode with apply_b_dec_to_input false: sae_in = x
    gate = x @ t["W_enc"] + t["b_gate"] > 0
    want = gate * torch.relu(x @ (t["W_enc"] * t["r_mag"].exp()) + t["b_mag"])
    assert torch.allclose(load_dictionary(d).encode(x), want, atol=1e-5)


@pytest.mark.integration
def test_cli_eval_on_a_hub_name_from_the_cache(tiny_lm_store, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    store, _ = tiny_lm_store
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "someone/tiny-saes", "b" * 40,
                    {f"h.0/{f.name}": f for f in (FIXTURES / "sparsify" / "h.0").iterdir()})  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["eval", "hf:someone/tiny-saes/h.0", "--store", str(store), "--contexts", "0"]) == 1
    assert "pass --out" in capsys.readouterr().err
    rc = main(["eval", "hf:someone/tiny-saes/h.0", "--store", str(store), "--contexts", "0",
               "--out", str(tmp_path / "eval.json")])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    assert json.loads((tmp_path / "eval.json").read_text())["hookpoint"] == "blocks.0.hook_out"
    assert main(["eval", "hf:someone/other", "--store", str(store), "--out", str(tmp_path / "e.json")]) == 1
    assert "needs the network" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("name, file", [("saelens-topk", "cfg.json"), ("sparsify-multi-topk", "h.0/cfg.json"),
                                        ("dl-topk", "config.json"), ("gemma-scope", "params.npz")])
@pytest.mark.parametrize("command", ["eval", "name"])
def test_no_store_message_names_the_formats_own_config_file(name, file, command, tmp_path, capsys):
    sae = FIXTURES / CASES[name][3]
    args = ["--out", str(tmp_path / "o.json")] if command == "eval" else ["--out", str(tmp_path / "o")]
    assert main([command, str(sae), *args]) == 1
    err = capsys.readouterr().err.strip()
    fmt = CASES[name][0]
    expected = f"{FIXTURES / CASES[name][3] / Path(file).name} ({fmt} format) records no store; pass --store STORE_DIR"
    assert expected in err, err
    assert len(err.splitlines()) == 1
