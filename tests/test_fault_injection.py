"""Issue 13 (integration tier): concurrent writers, a writer killed while holding the store, a full disk
(a simulated ENOSPC: the tests cannot mount a small filesystem), a dataset edited between a killed run and
its resume, and the tokenizer-less causal LM from cache to `eval --model`."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, integrity
from conceptdict.activations.lock import LOCK_NAME, StoreLocked
from conceptdict.cli.main import main
from fixtures_models import tiny_corpus

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parent
HP = "blocks.0.hook_out"


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cache_argv(model_dir, data, out, *extra) -> list[str]:
    return ["cache", "--model", str(model_dir), "--hookpoint", HP, "--dataset", str(data), "--out", str(out),
            "--context-length", "24", "--batch-size", "4", "--shard-rows", "64", "--progress", "false", *extra]


def _shards(out: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if ".tmp" in p.name)


HOLDER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from conceptdict.cli.main import main
from conceptdict.activations import models

_capture = models.capture
def capture(*a, **k):  # hold the store (and its lock) until the parent says go
    Path({started!r}).touch()
    while not Path({go!r}).exists():
        import time; time.sleep(0.05)
    return _capture(*a, **k)
models.capture = capture
sys.exit(main({argv!r}))
"""


def _holder(tmp_path, argv) -> tuple[subprocess.Popen, Path, Path]:
    started, go = tmp_path / "started", tmp_path / "go"
    code = HOLDER.format(tests=str(TESTS), started=str(started), go=str(go), argv=argv)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    while not started.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    return proc, started, go


def test_two_cache_runs_on_one_out_exactly_one_writes(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    from conceptdict.activations import families

    data = _jsonl(tmp_path / "docs.jsonl", tiny_corpus(40))
    out = tmp_path / "store"
    proc, _, go = _holder(tmp_path, _cache_argv(tiny_lm_dir, data, out))
    loads = []
    monkeypatch.setattr(families, "load_model", lambda *a, **k: loads.append(a))
    code = main(_cache_argv(tiny_lm_dir, data, out, "--dtype", "float16"))
    err = capsys.readouterr().err
    assert code == 1 and loads == []  # at once: before even loading the model
    assert f"store {out} is being written by pid {proc.pid} on host" in err and "cache" in err
    with pytest.raises(StoreLocked, match=f"pid {proc.pid}"):  # readers refuse it too
        ActivationStore(out)
    threading.Timer(0.5, go.touch).start()
    integrity.set_read_policy(wait_for_writer=300)  # --wait: the reader waits for the writer to finish
    try:
        store = ActivationStore(out)
    finally:
        integrity.set_read_policy(wait_for_writer=0)
    _, child_err = proc.communicate(timeout=300)
    assert proc.returncode == 0, child_err.decode()[-2000:]
    assert store.num_rows > 0
    store.verify()
    assert store.manifest["dtype"] == "float32" and not (out / LOCK_NAME).exists()
    assert {str(store.rows(HP, 0, 4).dtype)} == {"torch.float32"}


def test_a_writer_killed_holding_the_lock_leaves_a_stale_lock_the_next_run_takes_over(tmp_path, tiny_lm_dir,
                                                                                      caplog):
    data = _jsonl(tmp_path / "docs.jsonl", tiny_corpus(40))
    ref = tmp_path / "ref"
    assert main(_cache_argv(tiny_lm_dir, data, ref)) == 0
    out = tmp_path / "store"
    proc, _, _ = _holder(tmp_path, _cache_argv(tiny_lm_dir, data, out))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == proc.pid  # left behind by the kill
    assert main(_cache_argv(tiny_lm_dir, data, out)) == 0
    assert f"taking over the stale writer lock of pid {proc.pid}" in caplog.text
    assert _shards(out) == _shards(ref) and not (out / LOCK_NAME).exists()


def _enospc_on(name: str, monkeypatch):
    """os.fsync fails with ENOSPC for the temporary of ``name`` (a full disk at that write)."""
    real = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if name in target and ".tmp" in target:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc to map fds to paths")
def test_disk_full_in_cache_is_one_line_leaves_no_temporary_and_resumes(tmp_path, tiny_lm_dir, capsys,
                                                                         monkeypatch):
    data = _jsonl(tmp_path / "docs.jsonl", tiny_corpus(40))
    ref = tmp_path / "ref"
    assert main(_cache_argv(tiny_lm_dir, data, ref)) == 0
    assert len(_shards(ref)) >= 3
    out = tmp_path / "store"
    with monkeypatch.context() as m:
        _enospc_on("shard-00001", m)
        code = main(_cache_argv(tiny_lm_dir, data, out))
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars of the model loader
    assert code == 1 and err == (f"conceptdict cache: error: no space left on {out} (writing "
                                 f"{out / 'shard-00001.safetensors'}): free some space or write to another --out "
                                 "(nothing partial was kept)")
    assert _leftovers(out) == [] and len(_shards(out)) == 1
    assert main(_cache_argv(tiny_lm_dir, data, out)) == 0  # space freed: the same command resumes
    assert _shards(out) == _shards(ref)


def test_disk_full_in_train_is_one_line_and_leaves_no_temporary(tmp_path, tiny_lm_store, capsys, monkeypatch):
    store, _ = tiny_lm_store
    out = tmp_path / "sae"
    real = torch.save

    def save(obj, f, *a, **k):  # what torch reports when the disk fills mid-checkpoint
        if str(getattr(f, "name", f)).endswith("checkpoint.pt.tmp"):
            f.write(b"PK\x03\x04partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1408")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    code = main(["train", "--store", str(store), "--hookpoint", HP, "--latents", "32", "--k", "4",
                 "--batch-size", "32", "--eval-batches", "1", "--checkpoint-every", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("conceptdict train: error: writing failed, most likely a full disk")
    assert str(out / "checkpoint.pt") in err and len(err.splitlines()) == 1
    assert _leftovers(out) == [] and not (out / "checkpoint.pt").exists()


def test_resume_against_a_changed_dataset_is_refused_with_both_fingerprints(tmp_path, tiny_lm_dir, capsys):
    docs = tiny_corpus(40)
    data = _jsonl(tmp_path / "docs.jsonl", docs)
    ref = tmp_path / "ref"
    assert main(_cache_argv(tiny_lm_dir, data, ref)) == 0
    out = tmp_path / "store"
    shutil.copytree(ref, out)
    manifest = json.loads((out / "manifest.json").read_text())  # as a run killed after its second shard
    for entry in manifest["shards"][2:]:
        (out / entry["file"]).unlink()
    manifest["shards"], manifest["complete"] = manifest["shards"][:2], False
    manifest["num_rows"] = sum(s["rows"] for s in manifest["shards"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    old = manifest["dataset"]["sha256"]
    _jsonl(data, docs[:20] + [{"text": "an edited line", "topic": "food"}] + docs[21:])
    code = main(_cache_argv(tiny_lm_dir, data, out))
    err = capsys.readouterr().err
    new = integrity.file_sha256(data)
    assert code == 1 and f"dataset {data.resolve()} changed since store {out} was started" in err
    assert f"sha256 then {old[:16]}..., now {new[:16]}..." in err
    assert len(_shards(out)) == 2  # untouched
    _jsonl(data, docs)
    assert main(_cache_argv(tiny_lm_dir, data, out)) == 0
    assert _shards(out) == _shards(ref)


def test_empty_and_non_utf8_datasets_are_explained(tmp_path, tiny_lm_dir, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    code = main(_cache_argv(tiny_lm_dir, tmp_path / "empty.jsonl", tmp_path / "e"))
    assert code == 1 and "dataset" in (err := capsys.readouterr().err) and "is empty (0 bytes)" in err
    (tmp_path / "latin.txt").write_bytes("the cat\nthe caf\xe9 and the dog\n".encode("latin-1"))
    code = main(_cache_argv(tiny_lm_dir, tmp_path / "latin.txt", tmp_path / "l"))
    err = capsys.readouterr().err
    assert code == 1 and "latin.txt is not valid utf-8 at line 2, column 8 (byte 0xe9)" in err and "--encoding" in err
    assert main(_cache_argv(tiny_lm_dir, tmp_path / "latin.txt", tmp_path / "l", "--encoding", "latin-1")) == 0


def test_a_causal_lm_without_tokenizer_files_caches_pretokenised_ids_trains_and_evals(tmp_path, tiny_lm_dir,
                                                                                      capsys):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare_lm"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_lm_dir / name, bare / name)
    tok = AutoTokenizer.from_pretrained(str(tiny_lm_dir))
    ids = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": tok(d["text"])["input_ids"]} for d in tiny_corpus(60)])
    store, sae = tmp_path / "store", tmp_path / "sae"
    assert main(["cache", "--model", str(bare), "--hookpoint", HP, "--dataset", str(ids), "--tokens-column",
                 "input_ids", "--context-length", "32", "--out", str(store), "--progress", "false"]) == 0
    s = ActivationStore(store)
    assert s.tokenizer is None and s.row_context(5).tokens[0].startswith("<")  # rows show token ids
    assert main(["train", "--store", str(store), "--latents", "64", "--k", "4", "--batch-size", "32",
                 "--out", str(sae)]) == 0
    assert main(["eval", str(sae), "--model", str(bare)]) == 0
    metrics = json.loads((sae / "eval.json").read_text())["metrics"]
    assert "CE loss recovered" in capsys.readouterr().out
    assert all(key in json.dumps(metrics) for key in ("ce_loss_recovered", "kl_score"))
    named = tmp_path / "store_named"  # a tokenizer given separately is saved with the store
    assert main(["cache", "--model", str(bare), "--tokenizer", str(tiny_lm_dir), "--hookpoint", HP, "--dataset",
                 str(ids), "--tokens-column", "input_ids", "--context-length", "32", "--out", str(named),
                 "--progress", "false"]) == 0
    assert ActivationStore(named).tokenizer is not None
    assert torch.equal(ActivationStore(named).rows(HP, 0, s.num_rows), s.rows(HP, 0, s.num_rows))
