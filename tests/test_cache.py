"""``cache_activations`` / ``conceptdict cache`` end to end on tiny local models and on the MiniLM default."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures_models import tiny_corpus

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, load_model
from conceptdict.activations.data import iter_contexts
from conceptdict.activations.models import capture
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parent


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tiny_lm_store_matches_a_direct_forward(tiny_lm_store):
    path, model_dir = tiny_lm_store
    store = ActivationStore(path)
    m = store.manifest
    assert store.level == "token" and store.hookpoints == ["blocks.0.hook_out", "blocks.1.hook_out"]
    assert len(m["shards"]) >= 3 and m["complete"] and m["context_length"] == 32
    assert m["model"]["loader"].endswith("boot_transformers") and m["model"]["dtype"] == "float32"
    assert m["excluded_tokens"]["strings"][0] == "<|endoftext|>" and m["excluded_tokens"]["rows"] > 0
    assert (path / "tokenizer").is_dir()
    store.verify()
    model = load_model(str(model_dir))
    first = store.context_index(0, store.num_rows) == 0
    n = int(first.sum())
    context0 = next(iter_contexts(tiny_corpus(60), model.tokenizer, context_length=32, packing=True)).ids
    ids = torch.tensor([context0])
    want = capture(model, ids, torch.ones_like(ids), ["blocks.1.hook_out"])["blocks.1.hook_out"][0]
    positions = store.position(0, n).long()
    assert positions[0] == 1  # BOS at position 0 is excluded, and so are the EOS separators
    assert store.tokens(0, n).tolist() == ids[0, positions].tolist()
    assert n == sum(t not in store.manifest["excluded_tokens"]["ids"] for t in context0)
    torch.testing.assert_close(store.rows("blocks.1.hook_out", 0, n), want[positions])
    ctx = store.row_context(3)
    assert ctx.marked == 3 and ctx.context_index == 0 and ctx.tokens[3] in ctx.text


def test_cli_tiny_bert_tokens_and_refusals(tmp_path, tiny_bert_dir, capsys):
    data = _jsonl(tmp_path / "d.jsonl", tiny_corpus(20))
    out = tmp_path / "store"
    args = ["cache", "--model", str(tiny_bert_dir), "--hookpoint", "blocks.1.hook_out", "--dataset", str(data),
            "--context-length", "16", "--packing", "false", "--dtype", "float16", "--out", str(out),
            "--progress", "false"]
    assert main(args) == 0
    assert "blocks.1.hook_out  D=32" in capsys.readouterr().out
    assert json.loads((out / "cache_config.json").read_text())["dtype"] == "float16"
    store = ActivationStore(out)
    assert store.manifest["dtype"] == "float16" and store.rows("blocks.1.hook_out", 0, 2).dtype == torch.float16
    special = set(store.manifest["excluded_tokens"]["ids"])
    assert not special & set(store.tokens(0, store.num_rows).tolist())  # [CLS]/[SEP]/[PAD] rows excluded
    assert store.manifest["excluded_tokens"]["rows"] == 2 * 20  # one [CLS] and one [SEP] per document
    assert store.labels("topic")[0] == "animals"  # one document per context carries its labels to every row
    assert main(args) == 0  # same config, finished: nothing to do
    assert main([*args[:-2], "--dtype", "float32", "--progress", "false"]) == 1
    err = capsys.readouterr().err
    assert "different configuration" in err and "dtype" in err and "--overwrite" in err
    assert main([*args, "--dtype", "float32", "--overwrite"]) == 0
    assert ActivationStore(out).manifest["dtype"] == "float32"
    bad = ["cache", "--model", str(tiny_bert_dir), "--hookpoint", "blocks.1.hook_outt", "--dataset", str(data),
           "--out", str(tmp_path / "x")]
    assert main(bad) == 1
    assert "closest valid names: blocks.1.hook_out" in capsys.readouterr().err
    assert main([*bad[:4], "blocks.1.hook_out", *bad[5:], "--text-column", "body"]) == 1
    assert "no column 'body'" in capsys.readouterr().err


def test_token_limit_and_sentence_store(tiny_sentence_store, tmp_path, tiny_lm_dir):
    path, _ = tiny_sentence_store
    store = ActivationStore(path)
    assert store.level == "sequence" and store.num_rows == 60
    assert store.labels("topic")[:3] == ["animals", "food", "weather"]
    ctx = store.row_context(1)
    assert ctx.marked == -1 and ctx.text == tiny_corpus(60)[1]["text"] and ctx.tokens
    cfg = CacheConfig(model=str(tiny_lm_dir), hookpoints=["blocks.0.hook_out"], dataset="", out=tmp_path / "t",
                      context_length=16, batch_size=4, tokens=100, shard_rows=30, progress=False)
    assert ActivationStore(cache_activations(cfg, records=tiny_corpus(40))).num_rows == 100


CHILD = """
import sys, logging
sys.path.insert(0, {tests!r})
from pathlib import Path
from fixtures_models import tiny_corpus
from conceptdict.activations import CacheConfig, cache_activations
from conceptdict.activations import writer

_add = writer.ShardWriter.add
def add(self, *a, **k):  # announce the first batch so the parent can time its kill
    Path({marker!r}).touch()
    return _add(self, *a, **k)
writer.ShardWriter.add = add
cfg = CacheConfig(**{cfg!r})
cache_activations(cfg, records=tiny_corpus(200))
"""


def _cfg(model_dir: Path, out: Path) -> dict:
    return dict(model=str(model_dir), hookpoints=["blocks.0.hook_out", "blocks.1.hook_out"], dataset="",
                out=str(out), context_length=24, batch_size=8, shard_rows=128, progress=False)


def test_sigkill_and_resume_is_byte_identical(tmp_path, tiny_lm_dir):
    ref = ActivationStore(cache_activations(CacheConfig(**{**_cfg(tiny_lm_dir, tmp_path / "ref"),
                                                           "out": tmp_path / "ref"}), records=tiny_corpus(200)))
    out, marker = tmp_path / "killed", tmp_path / "started"
    rng = random.Random(0)
    kills = 0
    for attempt in range(4):
        marker.unlink(missing_ok=True)
        code = CHILD.format(tests=str(TESTS), marker=str(marker), cfg=_cfg(tiny_lm_dir, out))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
        if attempt < 2:
            while not marker.exists() and proc.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, -signal.SIGKILL), err.decode()[-2000:]
        if proc.returncode == 0:
            break
    assert kills >= 1, "the run finished before any kill landed; make the child's workload longer"
    got = ActivationStore(out)
    assert [s["sha256"] for s in got.manifest["shards"]] == [s["sha256"] for s in ref.manifest["shards"]]
    assert got.num_rows == ref.num_rows
    for hp in ref.hookpoints:
        assert torch.equal(got.rows(hp, 0, got.num_rows), ref.rows(hp, 0, ref.num_rows))
    assert torch.equal(got.tokens(0, got.num_rows), ref.tokens(0, ref.num_rows))
    got.verify()


@pytest.mark.gpu
def test_cuda_cache_matches_cpu(tmp_path, tiny_lm_dir):
    base = dict(model=str(tiny_lm_dir), hookpoints=["blocks.1.hook_out"], dataset="", context_length=32,
                batch_size=8, progress=False)
    cpu = ActivationStore(cache_activations(CacheConfig(**base, out=tmp_path / "cpu"), records=tiny_corpus(30)))
    gpu = ActivationStore(cache_activations(CacheConfig(**base, out=tmp_path / "gpu", device="cuda"),
                                            records=tiny_corpus(30)))
    assert gpu.num_rows == cpu.num_rows and torch.equal(gpu.tokens(0, gpu.num_rows), cpu.tokens(0, cpu.num_rows))
    torch.testing.assert_close(gpu.rows("blocks.1.hook_out", 0, gpu.num_rows),
                               cpu.rows("blocks.1.hook_out", 0, cpu.num_rows), atol=1e-4, rtol=1e-3)


@pytest.mark.integration
def test_label_columns_of_a_packed_token_cache_are_an_error_and_unpacked_keeps_them(tmp_path, tiny_lm_dir, capsys):
    docs = tiny_corpus(12)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    packed = tmp_path / "packed"
    assert main(["cache", "--model", str(tiny_lm_dir), "--hookpoint", "blocks.0.hook_out", "--dataset", str(corpus),
                 "--label-column", "topic", "--out", str(packed)]) != 0
    err = capsys.readouterr().err.strip()
    assert "--packing false" in err and "label_columns=['topic']" in err and len(err.splitlines()) == 1
    assert not packed.exists()  # refused before anything is written
    cfg = CacheConfig(model=str(tiny_lm_dir), hookpoints=["blocks.0.hook_out"], dataset="", out=tmp_path / "unpacked",
                      context_length=32, packing=False, label_columns=["topic"], progress=False)
    store = ActivationStore(cache_activations(cfg, records=docs))
    labels = store.labels("topic")
    assert len(labels) == store.num_rows and set(labels) <= {d["topic"] for d in docs}
    assert labels[0] == docs[0]["topic"] and labels[-1] == docs[-1]["topic"]
