"""`conceptdict diff` end to end: a tiny random-init GPT-2 against a briefly fine-tuned copy of it, over the same
tokens, through the command line; tokenizer refusal; the report's escaping."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conceptdict.cli.main import main


def _fine_tune(base_dir: Path, out: Path, steps: int = 8) -> Path:
    """A copy of the tiny LM after a few AdamW steps on animal sentences (same tokenizer)."""
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = GPT2LMHeadModel.from_pretrained(str(base_dir))
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = ["the cat and the dog saw a bird", "a horse and a cow and a lion", "the bear and the wolf ate a fish"]
    ids = tok(text, return_tensors="pt", padding=True)
    model.train()
    for _ in range(steps):
        loss = model(**ids, labels=ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from fixtures_models import tiny_corpus

    path = tmp_path_factory.mktemp("diff_corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in tiny_corpus(120, seed=1)))
    return path


@pytest.mark.integration
def test_diff_two_tiny_models_through_the_cli(tiny_lm_dir, corpus_file, tmp_path, capsys):
    tuned = _fine_tune(tiny_lm_dir, tmp_path / "tuned")
    out = tmp_path / "diff"
    argv = ["diff", "--model", str(tiny_lm_dir), "--model", str(tuned), "--hookpoint", "blocks.1.hook_out",
            "--dataset", str(corpus_file), "--context-length", "32", "--cache-batch-size", "16",
            "--latents", "64", "--k", "4", "--batch-size", "128", "--tokens", "12800", "--eval-batches", "1",
            "--checkpoint-every", "0", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "B-only" in printed and "report.html" in printed

    doc = json.loads((out / "diff.json").read_text())
    assert doc["format"] == "conceptdict-diff" and doc["kind"] == "crosscoder" and doc["n_latents"] == 64
    assert doc["sources"] == {"A": str(tiny_lm_dir), "B": str(tuned)}
    records = doc["latents"]
    assert [r["latent"] for r in records] == list(range(64))
    assert sum(doc["counts"][t] for t in ("B-only", "A-only", "shared", "other")) == 64
    for r in records:
        assert 0.0 <= r["delta"] <= 1.0 and -1.0 - 1e-6 <= r["cosine"] <= 1.0 + 1e-6
        assert r["tag"] in ("B-only", "A-only", "shared", "other")
        assert set(r) >= {"nu_eps", "nu_r", "beta_r_a", "model_specific", "complete_shrinkage"}
    # the two stores hold the same tokens, the crosscoder is saved with both sources
    manifests = [json.loads((out / "stores" / n / "manifest.json").read_text()) for n in ("A", "B")]
    assert manifests[0]["num_rows"] == manifests[1]["num_rows"] > 1000
    assert doc["eval"]["l0"] > 0 and len(doc["eval"]["per_source_fvu"]) == 2 and doc["eval"]["fvu"] < 1.0
    assert doc["heldout_eval"]["l0"] > 0 and doc["heldout_eval"]["fvu"] < 1.0  # training's own held-out rows
    cc = json.loads((out / "crosscoder" / "config.json").read_text())
    assert cc["kind"] == "crosscoder" and cc["n_sources"] == 2 and cc["d_in"] == 32
    with (out / "latents.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 64 and rows[0]["tag"] == records[0]["tag"]
    report = (out / "report.html").read_text()
    assert report.count("<svg") == 2 and "Counts" in report
    assert json.loads((out / "diff_config.json").read_text())["train"]["kind"] == "crosscoder"
    # a second run into the same directory is refused without --overwrite
    assert main(argv) == 1
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.integration
def test_diff_from_two_stores_of_one_model(tiny_lm_store, tmp_path, capsys):
    """--store mode on two stores over the same tokens (here: the same store twice, so nothing is model-specific
    by construction except noise: every latent's decoder is shared)."""
    store, _ = tiny_lm_store
    out = tmp_path / "diff"
    argv = ["diff", "--store", str(store), "--store", str(store), "--hookpoint", "blocks.0.hook_out",
            "--latents", "32", "--k", "4", "--batch-size", "64", "--tokens", "3200", "--eval-batches", "1",
            "--checkpoint-every", "0", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "diff.json").read_text())
    fired = [r for r in doc["latents"] if r["fires"]]
    assert fired and all(abs(r["delta"] - 0.5) < 0.1 for r in fired)
    assert doc["counts"]["model_specific"] == 0
    # the most changed decoders are listed (fired latents, largest relative change first) and printed
    changes = [r["change"] for r in doc["changed"]]
    assert changes and changes == sorted(changes, reverse=True) and all(r["fires"] for r in doc["changed"])
    assert "most changed decoders" in capsys.readouterr().out
    assert "change" in (out / "latents.csv").read_text().splitlines()[0].split(",")


@pytest.mark.unit
def test_models_with_different_tokenizers_are_refused(tiny_lm_dir, tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "diff"
    rc = main(["diff", "--model", str(tiny_lm_dir), "--model", str(tiny_bert_dir), "--hookpoint",
               "blocks.0.hook_out", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "different tokenizers" in err and "same tokens" in err
    assert not (out / "stores").exists()


@pytest.mark.unit
def test_tokenizer_difference_names_the_reason():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conceptdict.activations.tokens import tokenizer_difference

    def tok(words):
        t = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")

    assert tokenizer_difference(tok(["<unk>", "a", "b"]), tok(["<unk>", "a", "b"])) is None
    assert "sizes differ" in tokenizer_difference(tok(["<unk>", "a", "b"]), tok(["<unk>", "a"]))
    assert "'a' has id 1 in A but 2 in B" in tokenizer_difference(tok(["<unk>", "a", "b"]), tok(["<unk>", "b", "a"]))
    assert "no tokenizer" in tokenizer_difference(None, tok(["<unk>"]))


@pytest.mark.unit
def test_diff_flags_are_validated(tmp_path, capsys):
    assert main(["diff", "--model", "x", "--out", str(tmp_path / "d")]) == 1
    assert "exactly two" in capsys.readouterr().err
    assert main(["diff", "--model", "x", "--model", "y", "--out", str(tmp_path / "d")]) == 1
    assert "--hookpoint" in capsys.readouterr().err
    assert main(["diff", "--store", "a", "--store", "b", "--kind", "topk", "--out", str(tmp_path / "d")]) == 1
    assert "not a crosscoder kind" in capsys.readouterr().err


@pytest.mark.unit
def test_report_escapes_every_data_string():
    from conceptdict.naming.reports.diff_report import render_diff_report as render_report

    evil = "<script>alert(1)</script>"
    summary = {"sources": {"A": evil, "B": "b&b"}, "hookpoint": "<h>", "kind": "crosscoder", "n_latents": 2, "k": 1,
               "thresholds": {"nu_eps_max": 0.2, "nu_r_max": 0.5}, "counts": {"B-only": 1, evil: 1},
               "eval": None}
    records = [{"latent": 0, "tag": "B-only", "delta": 1.0, "cosine": 0.0, "norm_a": 0.0, "norm_b": 1.0,
                "nu_eps": None, "nu_r": 0.1, "model_specific": False},
               {"latent": 1, "tag": "shared", "delta": 0.5, "cosine": 1.0, "norm_a": 1.0, "norm_b": 1.0,
                "nu_eps": 0.5, "nu_r": 0.4, "model_specific": False}]
    page = render_report(summary, records)
    assert evil not in page and "&lt;script&gt;" in page and "b&amp;b" in page and "&lt;h&gt;" in page
    assert page.count("<svg") == 2
