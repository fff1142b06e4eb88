"""Naming on real stores of tiny random-init models (fixtures from tests/conftest.py): a token-level GPT-2
store (context / logit-lens namers, marked tokens, logit lens) and a sequence-level BERT store (vocabulary
namer through embed_texts, then a CBM on the store's topic labels)."""

from __future__ import annotations

import json

import pytest
import torch

from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


def _random_sae(directory, store, hookpoint, d, latents=24, k=3, seed=0):
    from conceptdict.saes import SparseCoder, save_dictionary

    torch.manual_seed(seed)
    model = SparseCoder(d, latents, k, kind="topk")
    return save_dictionary(model, directory, extra={"stores": [str(store)], "hookpoints": [hookpoint]})


def test_token_store_context_and_logit_lens_namers(tiny_lm_store, tmp_path, capsys):
    from conceptdict.activations import ActivationStore

    store_dir, model_dir = tiny_lm_store
    hp = "blocks.1.hook_out"
    store = ActivationStore(store_dir)
    sae = _random_sae(tmp_path / "sae", store_dir, hp, store.d_in(hp))
    out = tmp_path / "ctx"
    assert main(["name", str(sae), "--namer", "context", "--model", str(model_dir), "--top-k", "6",
                 "--out", str(out)]) == 0, capsys.readouterr()  # fmt: skip
    doc = json.loads((out / "concepts.json").read_text())
    firing = [c for c in doc["concepts"] if c["frequency"] > 0]
    assert firing and all(c["name"] for c in firing)
    for c in firing:
        ex = c["top_examples"][0]
        assert ex["tokens"][ex["marked"]].strip()  # the activating token is marked in its context
        ctx = store.row_context(ex["row"], before=8, after=4)
        assert ex["tokens"] == list(ctx.tokens) and ex["activation"] == pytest.approx(c["stats"]["max"], rel=1e-4)
        assert len(c["logit_top"]) == 10 and len(c["logit_bottom"]) == 10  # the LM has an unembedding
    out2 = tmp_path / "lens"
    assert main(["name", str(sae), "--namer", "logit-lens", "--model", str(model_dir), "--out", str(out2)]) == 0
    doc2 = json.loads((out2 / "concepts.json").read_text())
    assert all(c["name"] == c["logit_top"][0].strip() or not c["logit_top"][0].strip() for c in doc2["concepts"])


def test_sentence_store_vocab_namer_and_cbm(tiny_sentence_store, tmp_path, capsys):
    from conceptdict.activations import ActivationStore

    store_dir, model_dir = tiny_sentence_store
    hp = "sentence.mean_normalized"
    store = ActivationStore(store_dir)
    sae = _random_sae(tmp_path / "sae", store_dir, hp, store.d_in(hp), latents=16, k=4)
    words = tmp_path / "words.txt"
    words.write_text("cat\ndog\nrain\nsnow\nbread\ncheese\nthe\nof\n")
    out = tmp_path / "concepts"
    rc = main(["name", str(sae), "--vocab", str(words), "--model", str(model_dir), "--cache-dir",
               str(tmp_path / "cache"), "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    doc = json.loads((out / "concepts.json").read_text())
    assert {c["name"] for c in doc["concepts"]} <= {"cat", "dog", "rain", "snow", "bread", "cheese", "the", "of"}
    assert all(-1 <= c["score"] <= 1 for c in doc["concepts"]) and doc["meta"]["level"] == "sequence"
    assert list((tmp_path / "cache").glob("vocab-*.safetensors"))  # embeddings cached for the next run
    rc = main(["cbm", str(out), "--label-column", "topic", "--lam", "0.01",
               "--min-class-size", "3", "--out", str(tmp_path / "cbm")])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    cbm = json.loads((tmp_path / "cbm" / "cbm.json").read_text())
    assert set(cbm["classes"]) == {"animals", "food", "weather"} and 0 <= cbm["metrics"]["accuracy"] <= 1
