"""Exports to SAELens, sparsify and dictionary_learning layouts read back bit for bit, with a model card."""

from __future__ import annotations

import json

import pytest
import torch

from conceptdict.cli.main import main
from conceptdict.saes import SparseCoder, load_dictionary, open_dictionary, save_dictionary
from conceptdict.saes.formats.export import export_dictionary

pytestmark = pytest.mark.unit

CONFIG = {"hookpoints": ["blocks.0.hook_out"], "model": {"id": "tiny-gpt2", "source": "/models/tiny"},
          "stores": ["/stores/tiny"], "training": {"steps": 10, "rows": 640}}
CASES = [("saelens", "topk"), ("saelens", "batchtopk-absolute"), ("saelens", "relu"), ("saelens", "gated"),
         ("sparsify", "topk"), ("dictionary-learning", "topk"), ("dictionary-learning", "batchtopk-absolute"),
         ("dictionary-learning", "relu"), ("dictionary-learning", "gated")]


def _model(kind: str, seed: int = 0) -> SparseCoder:
    m = SparseCoder(12, 20, 3, kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.reset_parameters(g)
        m.W_enc.add_(0.1 * torch.randn(m.W_enc.shape, generator=g))
        m.b_enc.normal_(0, 0.1, generator=g)
        m.b_dec.normal_(0, 0.2, generator=g)
        m.threshold.fill_(0.15 if m.spec.uses_threshold else -1.0)  # unused (and not exported) otherwise
        for name in m.spec.buffers:
            getattr(m, name).normal_(0, 0.1, generator=g)
    return m


@pytest.mark.parametrize("fmt,kind", CASES)
def test_round_trips_are_exact(tmp_path, fmt, kind):
    m = _model(kind)
    export_dictionary(m, CONFIG, fmt, tmp_path)
    back, config = open_dictionary(tmp_path)
    assert (back.kind, back.k, config["hookpoints"], config["model"]) == (kind, 3, ["blocks.0.hook_out"], "tiny-gpt2")
    mine, theirs = m.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine), fmt
    card = (tmp_path / "README.md").read_text()
    assert f"# {kind} sparse autoencoder on tiny-gpt2 at blocks.0.hook_out" in card
    assert "10 steps over 640 rows" in card and "/stores/tiny" in card


def test_saelens_metadata_is_kept_by_sae_lens_6(tmp_path):
    export_dictionary(_model("topk"), CONFIG, "saelens", tmp_path)
    meta = json.loads((tmp_path / "cfg.json").read_text())["metadata"]
    assert meta["sae_lens_version"].startswith("6.")  # else sae-lens rebuilds metadata from top-level keys
    assert meta["model_name"] == "tiny-gpt2" and meta["hook_name"] == "blocks.0.hook_resid_post"
    with pytest.raises(ValueError, match="model's name string"):
        from conceptdict.saes import export_saelens

        export_saelens(_model("topk"), tmp_path / "bad", {"model_name": {"id": "tiny"}})


def test_model_card_lists_the_evals(tmp_path):
    evals = {"store": "/stores/tiny", "hookpoint": "blocks.0.hook_out", "rows_from": "the first rows",
             "metrics": {"l0": 3.0, "fvu": 0.125, "ce_loss_recovered": 0.9}}
    export_dictionary(_model("topk"), CONFIG, "sparsify", tmp_path, evals=evals)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: sparsify" in card and "| fvu | 0.125 |" in card and "| ce_loss_recovered | 0.9 |" in card
    assert (tmp_path / "blocks.0.hook_out" / "sae.safetensors").exists()


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="sparsify holds single-source TopK SAEs and transcoders"):
        export_dictionary(_model("batchtopk-absolute"), CONFIG, "sparsify", tmp_path / "a")
    with pytest.raises(ValueError, match="row-relative.*no SAELens equivalent"):
        export_dictionary(_model("batchtopk"), CONFIG, "saelens", tmp_path / "r")
    with pytest.raises(ValueError, match="no exact dictionary_learning class"):
        export_dictionary(_model("jumprelu"), CONFIG, "dictionary-learning", tmp_path / "b")
    m = _model("batchtopk-absolute")
    with torch.no_grad():
        m.threshold[0] = 0.5
    with pytest.raises(ValueError, match="one scalar threshold"):
        export_dictionary(m, CONFIG, "dictionary-learning", tmp_path / "c")


def test_cli_exports_every_layout_and_reads_them_back(tmp_path, capsys):
    sae = save_dictionary(_model("topk"), tmp_path / "sae", extra={k: v for k, v in CONFIG.items() if k != "training"})
    (sae / "eval.json").write_text(json.dumps({"store": "s", "hookpoint": "h", "rows_from": "r",
                                               "metrics": {"fvu": 0.25}}))
    for fmt in ("saelens", "sparsify", "dictionary-learning"):
        assert main(["export", str(sae), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0, capsys.readouterr()
        assert torch.equal(load_dictionary(tmp_path / fmt).W_enc, load_dictionary(sae).W_enc)
        assert "| fvu | 0.25 |" in (tmp_path / fmt / "README.md").read_text()
        # and back again from the foreign layout to ours
        assert main(["export", str(tmp_path / fmt), "--format", "saelens", "--out", str(tmp_path / f"{fmt}-2")]) == 0
        assert torch.equal(load_dictionary(tmp_path / f"{fmt}-2").W_dec, load_dictionary(sae).W_dec)


def test_native_gated_and_jumprelu_round_trip(tmp_path):
    for kind in ("gated", "jumprelu"):
        m = _model(kind)
        back = load_dictionary(save_dictionary(m, tmp_path / kind))
        mine, theirs = m.state_dict(), back.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine) and back.kind == kind


LIBRARY_CHECK = r"""
import json, os, sys, torch
os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")
from safetensors.torch import load_file
torch.set_grad_enabled(False)
out = {}
for fmt, d in json.loads(sys.argv[2]).items():
    t = load_file(d + "/../probe.safetensors")
    if fmt == "sparsify":
        from sparsify import SparseCoder
        sae = SparseCoder.load_from_disk(d)
        enc = sae.encode(t["x"])
        f = torch.zeros_like(t["f"]).scatter_(1, enc.top_indices, enc.top_acts)
        x_hat = sae.decode(enc.top_acts, enc.top_indices)
    else:
        from dictionary_learning.dictionary import AutoEncoder, GatedAutoEncoder
        from dictionary_learning.trainers.batch_top_k import BatchTopKSAE
        from dictionary_learning.trainers.top_k import AutoEncoderTopK
        cfg = json.load(open(d + "/config.json"))["trainer"]
        cls = {c.__name__: c for c in (AutoEncoder, GatedAutoEncoder, BatchTopKSAE, AutoEncoderTopK)}[cfg["dict_class"]]
        args = (cfg["activation_dim"], cfg["dict_size"]) + ((cfg["k"],) if "TopK" in cls.__name__ else ())
        ae = cls(*args)
        ae.load_state_dict(torch.load(d + "/ae.pt", weights_only=True))
        f = ae.encode(t["x"])
        x_hat = ae.decode(f)
    out[fmt] = [float((f - t["f"]).abs().max()), float((x_hat - t["x_hat"]).abs().max())]
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_exports_load_in_the_real_libraries(tmp_path):
    import subprocess
    from pathlib import Path

    from safetensors.torch import save_file

    side = Path(__file__).resolve().parents[1] / ".venv-interop" / "bin" / "python"
    if not side.exists():
        pytest.skip("no .venv-interop (see tests/fixtures/foreign/make_fixtures.py for how to make it)")
    dirs = {}
    for fmt, kind in [("sparsify", "topk"), ("dl-topk", "topk"), ("dl-batchtopk", "batchtopk-absolute"),
                      ("dl-relu", "relu"), ("dl-gated", "gated")]:
        m, root = _model(kind), tmp_path / fmt
        where = export_dictionary(m, CONFIG, "sparsify" if fmt == "sparsify" else "dictionary-learning", root / "d")
        x = torch.randn(32, 12, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            f = m.encode(x)
            save_file({"x": x, "f": f, "x_hat": m.decode(f)}, str(where.parent / "probe.safetensors"))
        dirs[fmt] = str(where)
    result = tmp_path / "result.json"
    proc = subprocess.run([str(side), "-c", LIBRARY_CHECK, str(result), json.dumps(dirs)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())
    print(got)
    assert all(codes < 1e-5 and recon < 1e-5 for codes, recon in got.values()), got
