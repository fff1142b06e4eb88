"""Dictionary artifacts: native save/load (schema + golden bytes), SAELens export/import round trips."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from conceptdict.saes import (SparseCoder, export_saelens, import_saelens, load_dictionary, load_dictionary_config,
                              save_dictionary)

pytestmark = pytest.mark.unit


def _model(kind="topk", S=1, D=5, L=7, k=2, seed=0):
    m = SparseCoder(D, L, k, kind, n_sources=S)
    m.reset_parameters(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        m.b_enc.copy_(torch.randn(L, generator=g) * 0.1)
        m.b_dec.copy_(torch.randn(S * D, generator=g) * 0.1)
        m.threshold.fill_(0.05)
    return m


def _x(S=1, D=5, n=12):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, D, generator=g) if S == 1 else torch.randn(n, S, D, generator=g)


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "batchtopk-absolute", "relu", "crosscoder"])
def test_save_load_round_trip(tmp_path, kind):
    S = 2 if kind == "crosscoder" else 1
    m = _model(kind, S=S)
    save_dictionary(m, tmp_path, extra={"hookpoints": ["h"], "stores": ["runs/s"]})
    back = load_dictionary(tmp_path)
    for name, t in m.state_dict().items():
        if (name != "threshold" or m.spec.uses_threshold) and (name != "norm_scale" or m.spec.relative):
            assert torch.equal(back.state_dict()[name], t), name
    x = _x(S)
    assert torch.equal(back(x), m(x).detach())
    cfg = load_dictionary_config(tmp_path)
    assert cfg["hookpoints"] == ["h"] and cfg["stores"] == ["runs/s"] and cfg["kind"] == kind


def test_schema_and_golden_bytes(tmp_path):
    """The on-disk layout is a contract (DESIGN.md "Dictionary artifact"); a change here must be deliberate."""
    m = SparseCoder(3, 4, 1, "batchtopk-absolute", n_sources=2)
    with torch.no_grad():
        for i, p in enumerate([m.W_enc, m.b_enc, m.W_dec, m.b_dec, m.threshold]):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) / 8 + i)
    save_dictionary(m, tmp_path)
    with safe_open(str(tmp_path / "weights.safetensors"), framework="pt") as fh:
        shapes = {k: list(fh.get_tensor(k).shape) for k in fh.keys()}
        dtypes = {str(fh.get_tensor(k).dtype) for k in fh.keys()}
        meta = fh.metadata()
        W_dec = fh.get_tensor("W_dec")
    assert shapes == {"W_enc": [2, 3, 4], "b_enc": [4], "W_dec": [2, 4, 3], "b_dec": [2, 3], "threshold": [4]}
    assert dtypes == {"torch.float32"}
    assert meta == {"format": "conceptdict-dictionary", "format_version": "2", "kind": "batchtopk-absolute"}
    # W_dec[s, j] is latent j's direction in source s
    assert torch.equal(W_dec[1, 2], m.W_dec[2, 3:6].detach())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == {"format": "conceptdict-dictionary", "format_version": 2, "kind": "batchtopk-absolute", "d_in": 3,
                   "n_latents": 4, "k": 1, "n_sources": 2,
                   "normalisation": {"scale_per_source": [1.0, 1.0], "folded_into_weights": True}}
    # safetensors writes its JSON header in hash-map order, so compare the header as JSON and the data bytes exactly
    raw = (tmp_path / "weights.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == meta
    assert header == GOLDEN_HEADER
    assert hashlib.sha256(raw[8 + n:]).hexdigest() == GOLDEN_DATA_SHA256


GOLDEN_HEADER = {
    "W_dec": {"dtype": "F32", "shape": [2, 4, 3], "data_offsets": [0, 96]},
    "W_enc": {"dtype": "F32", "shape": [2, 3, 4], "data_offsets": [96, 192]},
    "b_dec": {"dtype": "F32", "shape": [2, 3], "data_offsets": [192, 216]},
    "b_enc": {"dtype": "F32", "shape": [4], "data_offsets": [216, 232]},
    "threshold": {"dtype": "F32", "shape": [4], "data_offsets": [232, 248]},
}
GOLDEN_DATA_SHA256 = "8d4620a14895e575c2f057ec0ad42a6de3e54fda1d6d34d9d34d9b68a31dc707"


def test_refusals(tmp_path):
    m = _model()
    with pytest.raises(ValueError, match="would overwrite"):
        save_dictionary(m, tmp_path, extra={"kind": "x"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dictionary(tmp_path / "nothing")
    save_dictionary(m, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"format_version": 99}))
    with pytest.raises(ValueError, match="upgrade conceptdict"):
        load_dictionary(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"d_in": 6}))
    with pytest.raises(ValueError, match="W_enc has shape"):
        load_dictionary(tmp_path)


@pytest.mark.parametrize("kind,arch", [("topk", "topk"), ("batchtopk-absolute", "jumprelu"), ("relu", "standard")])
def test_saelens_export_import_round_trip(tmp_path, kind, arch):
    m = _model(kind)
    export_saelens(m, tmp_path, {"model_name": "tiny", "hook_name": "blocks.0.hook_resid_post", "context_size": 16})
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["architecture"] == arch and cfg["d_in"] == 5 and cfg["d_sae"] == 7
    assert cfg["apply_b_dec_to_input"] is True and cfg["normalize_activations"] == "none"
    assert cfg["metadata"]["hook_name"] == "blocks.0.hook_resid_post"
    assert (cfg.get("k") == 2) == (kind == "topk")
    with safe_open(str(tmp_path / "sae_weights.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
        assert list(fh.get_tensor("W_enc").shape) == [5, 7] and list(fh.get_tensor("W_dec").shape) == [7, 5]
    assert keys == {"W_enc", "b_enc", "W_dec", "b_dec"} | ({"threshold"} if kind == "batchtopk-absolute" else set())
    back = import_saelens(tmp_path)
    assert back.kind == kind and back.k == m.k
    x = _x()
    assert torch.equal(back.encode(x), m.encode(x).detach())
    assert torch.equal(back(x), m(x).detach())


def test_relative_batchtopk_saves_norm_scale_and_refuses_saelens(tmp_path):
    m = _model("batchtopk")
    with torch.no_grad():
        m.threshold.fill_(0.1)
    m.fold_input_scale(torch.tensor([2.5]))
    save_dictionary(m, tmp_path / "native")
    back = load_dictionary(tmp_path / "native")
    assert back.kind == "batchtopk" and float(back.norm_scale[0]) == 2.5
    x = _x()
    assert torch.equal(back.encode(x), m.encode(x).detach())
    with pytest.raises(ValueError, match="no SAELens equivalent.*--kind batchtopk-absolute"):
        export_saelens(m, tmp_path / "saelens")


def test_version_1_batchtopk_reads_as_the_classical_rule(tmp_path):
    """Dictionaries saved before format 2 ran BatchTopK's absolute threshold: they must keep doing so."""
    m = _model("batchtopk-absolute")
    with torch.no_grad():
        m.threshold.fill_(0.05)
    save_dictionary(m, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"format_version": 1, "kind": "batchtopk"}))
    back = load_dictionary(tmp_path)
    assert back.kind == "batchtopk-absolute"
    x = _x()
    assert torch.equal(back.encode(x), m.encode(x).detach())


def test_saelens_import_folds_b_dec_when_not_applied_to_input(tmp_path):
    m = _model("relu")
    export_saelens(m, tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"apply_b_dec_to_input": False}))
    back = import_saelens(tmp_path)
    x = _x()
    # SAELens without b_dec on the input: f = relu(x W_enc + b_enc)
    want = torch.relu(x @ m.W_enc + m.b_enc)
    assert torch.allclose(back.encode(x), want.detach(), atol=1e-6)


def test_saelens_refusals(tmp_path):
    with pytest.raises(ValueError, match="no crosscoder layout"):
        export_saelens(_model("crosscoder", S=2), tmp_path)
    export_saelens(_model(), tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"normalize_activations": "layer_norm"}))
    with pytest.raises(ValueError, match="rescales every input by its own statistics"):
        import_saelens(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"architecture": "transcoder"}))
    with pytest.raises(ValueError, match="'transcoder' is not supported"):
        import_saelens(tmp_path)
