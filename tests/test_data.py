"""Datasets, tokenisation into contexts and the standard-library docstring corpus."""

from __future__ import annotations

import collections
import json

import pytest

from conceptdict.activations import stdlib_docstrings
from conceptdict.activations.data import FAMILIES, iter_contexts, iter_records, special_wrapping


@pytest.fixture(scope="module")
def gpt_tok(tiny_lm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_lm_dir))


@pytest.fixture(scope="module")
def bert_tok(tiny_bert_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_bert_dir))


@pytest.mark.unit
def test_stdlib_docstrings_deterministic_labelled_balanced():
    a, b = stdlib_docstrings(), stdlib_docstrings()
    assert a == b and len(a) > 1000
    assert all(set(r) == {"text", "module", "family"} for r in a)
    counts = collections.Counter(r["family"] for r in a)
    assert set(counts) == set(FAMILIES) and len(counts) == 8
    assert max(counts.values()) <= 2 * min(counts.values())
    assert not any(".test" in r["module"] or r["module"].startswith("test") for r in a)
    assert all(40 <= len(r["text"]) <= 1500 for r in a)
    assert any(r["module"] == "json" for r in a) and any(r["module"].startswith("asyncio") for r in a)


@pytest.mark.integration
def test_special_wrapping(gpt_tok, bert_tok):
    assert special_wrapping(gpt_tok) == ([gpt_tok.bos_token_id], [], gpt_tok.eos_token_id)
    assert special_wrapping(gpt_tok, prepend_bos=False)[0] == []
    assert special_wrapping(bert_tok) == ([bert_tok.cls_token_id], [bert_tok.sep_token_id], bert_tok.sep_token_id)


@pytest.mark.integration
def test_packing_and_per_document(gpt_tok, bert_tok):
    docs = [{"text": "cat dog bird " * 5, "topic": "a"}, {"text": "rain snow", "topic": "b"}]
    packed = list(iter_contexts(docs, gpt_tok, context_length=8, packing=True))
    bos = gpt_tok.bos_token_id
    assert all(c.ids[0] == bos and len(c.ids) == 8 for c in packed[:-1])
    body = [t for c in packed for t in c.ids[1:]]
    assert body == gpt_tok(docs[0]["text"])["input_ids"] + [gpt_tok.eos_token_id] + \
        gpt_tok("rain snow")["input_ids"] + [gpt_tok.eos_token_id]
    per_doc = list(iter_contexts(docs, bert_tok, context_length=6, packing=False))
    assert [len(c.ids) for c in per_doc] == [6, 4]
    assert per_doc[1].ids[0] == bert_tok.cls_token_id and per_doc[1].ids[-1] == bert_tok.sep_token_id
    assert per_doc[1].labels == {"topic": "b"} and per_doc[1].text == "rain snow"


@pytest.mark.integration
def test_pretokenised_column_used_as_is(gpt_tok):
    docs = [{"ids": [5, 6, 7, 8, 9]}, {"ids": [10, 11]}]
    got = list(iter_contexts(docs, None, context_length=3, packing=True, tokens_column="ids"))
    assert [c.ids for c in got] == [[5, 6, 7], [8, 9, 10], [11]]


@pytest.mark.integration
def test_missing_column_and_empty_dataset(gpt_tok):
    with pytest.raises(ValueError, match=r"no column 'body'.*\['text'\]"):
        list(iter_contexts([{"text": "x"}], gpt_tok, context_length=8, packing=True, text_column="body"))
    with pytest.raises(ValueError, match="empty"):
        list(iter_contexts([], gpt_tok, context_length=8, packing=True))
    with pytest.raises(ValueError, match="tokens-column"):
        list(iter_contexts([{"text": [1, 2]}], gpt_tok, context_length=8, packing=True))


@pytest.mark.integration
@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv", ".parquet"])
def test_local_files(tmp_path, suffix):
    rows = [{"text": "cat dog", "topic": "a"}, {"text": "rain snow", "topic": "b"}]
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(r["text"] for r in rows) + "\n")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".csv":
        path.write_text("text,topic\n" + "".join(f"{r['text']},{r['topic']}\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    got = list(iter_records(str(path)))
    assert [r["text"] for r in got] == ["cat dog", "rain snow"]
    if suffix != ".txt":
        assert [r["topic"] for r in got] == ["a", "b"]


@pytest.mark.unit
def test_in_memory_and_unknown_suffix(tmp_path):
    assert list(iter_records(["a", {"text": "b", "k": 1}])) == [{"text": "a"}, {"text": "b", "k": 1}]
    bad = tmp_path / "data.xlsx"
    bad.write_text("x")
    with pytest.raises(ValueError, match="expected one of"):
        list(iter_records(str(bad)))


@pytest.mark.unit
def test_unreachable_hub_dataset_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot load dataset 'no-such-user/no-such-dataset'"):
        list(iter_records("no-such-user/no-such-dataset"))
