"""`eval` and `compare` on every store a user can make: a packed store of short documents (its contexts rebuilt
around the separators it leaves out), a dictionary trained from a live model (no store), and dictionaries whose
recorded stores differ."""

from __future__ import annotations

import json

import pytest

import conceptdict as cd
from conceptdict.activations import ActivationStore, load_model, spliced_losses
from conceptdict.activations import data as data_mod
from conceptdict.activations.cache import CacheConfig, cache_activations
from conceptdict.activations.tokens import pad_sequences, rebuild_contexts, separator_id
from conceptdict.cli.main import main
from fixtures_models import tiny_corpus

pytestmark = pytest.mark.integration

HP = "blocks.0.hook_out"


def _short_docs(n: int = 120, seed: int = 0) -> list[dict]:
    """Documents of a few words: every packed context of 32 tokens holds several, so every one has gaps."""
    return [{"text": " ".join(d["text"].split()[:5])} for d in tiny_corpus(n, seed=seed)]


def _train(store, out):
    return cd.train(store=store, out=out, latents=32, k=4, batch_size=64, tokens=64 * 10, eval_batches=2,
                    checkpoint_every=0, seed=0, device="cpu")


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_lm_dir):
    """(store, dictionary trained on it, model dir): a default (packed) store of short documents."""
    root = tmp_path_factory.mktemp("packed")
    store = cache_activations(CacheConfig(model=str(tiny_lm_dir), hookpoints=[HP], dataset="", out=root / "store",
                                          context_length=32, batch_size=8, progress=False), records=_short_docs())
    _train(store, root / "sae")
    return store, root / "sae", tiny_lm_dir


def test_a_packed_store_of_short_documents_rebuilds_the_contexts_the_cache_ran(packed):
    store, _, model_dir = packed
    lm = load_model(str(model_dir))
    ran = list(data_mod.iter_contexts(_short_docs(), lm.tokenizer, context_length=32, packing=True))
    ids, mask = rebuild_contexts(ActivationStore(store), 6, *lm.bos_pad_ids(), separator_id(lm))
    assert ids.shape[0] == 6
    for row, m, context in zip(ids, mask, ran):
        n = int(m.sum())
        assert n >= 31 and row[:n].tolist() == context.ids[:n]  # up to the last stored row (a trailing separator)
    assert sum(row.tolist().count(separator_id(lm)) for row in ids) >= 6  # separators put back between documents


def test_eval_on_a_packed_store_reports_the_spliced_losses_of_the_model_on_those_contexts(packed, tmp_path, capsys):
    store, sae_dir, model_dir = packed
    assert main(["eval", str(sae_dir), "--contexts", "4", "--out", str(tmp_path / "eval.json")]) == 0
    assert "CE loss recovered" in capsys.readouterr().out
    ev = cd.evaluate(sae_dir, contexts=4, out=tmp_path / "e.json")
    # the same contexts evaluated directly: the model's own forward on the packed contexts, the dictionary spliced in
    lm = load_model(str(model_dir))
    ran = list(data_mod.iter_contexts(_short_docs(), lm.tokenizer, context_length=32, packing=True))[:4]
    stored = ActivationStore(store)
    last = [int(stored.position(0, stored.num_rows)[stored.context_index(0, stored.num_rows) == c].max())
            for c in range(4)]
    ids, mask = pad_sequences([c.ids[:n + 1] for c, n in zip(ran, last)], lm.bos_pad_ids()[1])
    sae = cd.load(sae_dir)
    direct = spliced_losses(lm, HP, ids, lambda x: sae(x), attention_mask=mask)
    got = ev.metrics.splice
    assert got["ce_clean"] == pytest.approx(direct.ce_clean, rel=1e-5)
    assert got["ce_replaced"] == pytest.approx(direct.ce_replaced, rel=1e-5)
    assert got["kl_replaced"] == pytest.approx(direct.kl_replaced, rel=1e-5)
    assert ev.metrics.kl_score is not None and ev.metrics.ce_loss_recovered is not None
    # compare splices each dictionary into the same rebuilt contexts
    got = cd.compare([sae_dir, sae_dir], model=str(model_dir), contexts=4, out=tmp_path / "cmp").result
    assert [row["metrics"]["splice"]["kl_replaced"] for row in got["dictionaries"]] == \
        pytest.approx([direct.kl_replaced] * 2, rel=1e-5)


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory):
    """(crosscoder over stores A and B, an SAE trained on B alone, A, B): imported arrays of one hookpoint name."""
    from fixtures_planted import planted_pair_stores

    tmp = tmp_path_factory.mktemp("two")
    stores, _ = planted_pair_stores(tmp, 8, one_name=True)  # 2,048 rows
    cd.diff(store=stores, out=tmp / "diff", latents=32, k=3, batch_size=128, tokens=2048, eval_batches=2,
            checkpoint_every=0, seed=0, device="cpu")
    cd.train(store=stores[1], out=tmp / "sae_b", latents=32, k=3, batch_size=128, tokens=2048, eval_batches=2,
             checkpoint_every=0, seed=0, device="cpu")
    return tmp / "diff" / "crosscoder", tmp / "sae_b", *stores


def test_compare_evaluates_each_dictionary_on_its_own_recorded_store(two_stores, tmp_path, capsys):
    cc, sae_b, a, b = two_stores
    assert main(["compare", str(cc), str(sae_b), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "each one's own store" in out
    rows = {r["name"]: r for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())["dictionaries"]}
    assert rows["crosscoder"]["store"] == [str(a), str(b)] and rows["sae_b"]["store"] == [str(b)]
    for name, path in (("crosscoder", cc), ("sae_b", sae_b)):  # each on its own held-out rows, as `eval` reads them
        alone = cd.evaluate(path, out=tmp_path / f"{name}.json").metrics
        assert rows[name]["metrics"]["fvu"] == pytest.approx(alone.fvu, rel=1e-6) and alone.fvu < 1


@pytest.mark.parametrize("command", ["compare", "eval"])
def test_a_store_other_than_the_recorded_one_is_refused_in_one_line(two_stores, tmp_path, capsys, command):
    cc, sae_b, a, b = two_stores
    dicts = [str(cc), str(sae_b)] if command == "compare" else [str(sae_b)]
    for store in (b, a):  # B replaces the crosscoder's store A; A replaces sae_b's store B
        if command == "eval" and store == b:
            continue
        assert main([command, *dicts, "--store", str(store), "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert f"--store {store} is not the store" in err and "drop --store" in err
        assert str(a if store == b else b) in err
    assert main([command, *dicts, "--store", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err  # a store that is not one: the store's own error, not a comparison of models
    assert "nowhere has no manifest.json" in err and "is not the store" not in err


def test_a_store_of_the_same_model_over_other_text_is_read_with_a_warning(packed, tmp_path, caplog):
    store, sae_dir, model_dir = packed
    other = cache_activations(CacheConfig(model=str(model_dir), hookpoints=[HP], dataset="", out=tmp_path / "other",
                                          context_length=32, batch_size=8, progress=False),
                              records=_short_docs(40, seed=5))
    with caplog.at_level("WARNING"):
        ev = cd.evaluate(sae_dir, store=other, contexts=0, out=tmp_path / "e.json")
    assert ev.store == other and ev.metrics.n_tokens > 0
    assert any(str(store) in r.getMessage() and str(other) in r.getMessage() for r in caplog.records)
    # another model's store (a second tiny LM of the same width) is refused, naming both models
    from fixtures_models import build_tiny_lm

    lm_b = build_tiny_lm(tmp_path / "lm_b", seed=1)
    theirs = cache_activations(CacheConfig(model=str(lm_b), hookpoints=[HP], dataset="", out=tmp_path / "theirs",
                                           context_length=32, batch_size=8, progress=False),
                               records=_short_docs(40, seed=5))
    with pytest.raises(ValueError, match=f"it holds model {lm_b}'s activations, {store} model {model_dir}'s"):
        cd.evaluate(sae_dir, store=theirs, contexts=0, out=tmp_path / "t.json")


def test_a_dictionary_trained_from_a_live_model_is_evaluated_on_the_rows_training_held_out(tiny_lm_dir, tmp_path,
                                                                                           capsys):
    docs, other = tmp_path / "docs.jsonl", tmp_path / "other.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(120)))
    other.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(60, seed=7)))
    out = tmp_path / "live"
    assert main(["train", "--model", str(tiny_lm_dir), "--hookpoint", HP, "--dataset", str(docs), "--context-length",
                 "32", "--forward-batch-size", "4", "--latents", "32", "--k", "4", "--batch-size", "64", "--tokens",
                 str(64 * 10), "--eval-batches", "2", "--buffer-rows", "512", "--device", "cpu",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--model", str(tiny_lm_dir), "--dataset", str(docs), "--contexts", "4",
                 "--out", str(tmp_path / "eval.json")]) == 0
    text = capsys.readouterr().out
    assert "training's held-out batches" in text and "KL score" in text
    record = json.loads((tmp_path / "eval.json").read_text())
    held = cd.load(out).training_summary["heldout_eval"]  # training measured these same rows before saving
    assert record["metrics"]["n_tokens"] == held["n_tokens"] == 128
    assert record["metrics"]["fvu"] == pytest.approx(held["fvu"], rel=1e-5)
    assert record["metrics"]["l0"] == pytest.approx(held["l0"], rel=1e-6)
    elsewhere = cd.evaluate(out, dataset=str(other), rows=256, batch_size=64, contexts=0, out=tmp_path / "o.json")
    assert elsewhere.rows_from == f"the first rows of {other} (a dataset it did not train on)"
    assert elsewhere.metrics.n_tokens == 256 and elsewhere.metrics.splice is None
    # a dictionary that records no training data (e.g. another library's): the first rows, said so
    config = json.loads((out / "config.json").read_text())
    for key in ("live", "dataset"):
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    unknown = cd.evaluate(out, model=str(tiny_lm_dir), dataset=str(docs), rows=128, batch_size=64, contexts=0,
                          out=tmp_path / "u.json")
    assert unknown.rows_from == f"the first rows of {docs} (its training data is not recorded)"
