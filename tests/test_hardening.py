"""Issue 13 (unit tier): damaged stores and files, bad inputs and output directories give one clear line
naming the file and the fix; nothing exits 0 with wrong data. Fault injection is in test_fault_injection.py."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conceptdict.activations import ActivationStore, StoreError, stream_batches
from conceptdict.activations import integrity
from conceptdict.activations.lock import LOCK_NAME, StoreLocked, writer_lock
from conceptdict.cli.main import main
from test_store import make_store

pytestmark = pytest.mark.unit
HP = "blocks.0.hook_out"


@pytest.fixture(autouse=True)
def _fresh_policy():
    integrity.forget_hashes()
    yield
    integrity.set_read_policy(verify_hash=True, wait_for_writer=0.0)
    integrity.forget_hashes()


def _store(tmp_path, name="s", n=60, shard_rows=20):
    torch.manual_seed(0)
    return make_store(tmp_path / name, {HP: torch.randn(n, 8)}, shard_rows=shard_rows)


def _flip(path, offset_from_end=40):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify_message(path) -> str:
    with pytest.raises(StoreError) as e:
        ActivationStore(path).verify()
    return str(e.value)


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


# ---------------------------------------------------------------- readers verify what they read


@pytest.mark.parametrize("shard", [0, 1, 2])
def test_a_flipped_byte_in_any_shard_stops_train_before_its_first_step(tmp_path, capsys, shard):
    store = _store(tmp_path)
    assert len(store.manifest["shards"]) == 3
    _flip(tmp_path / "s" / store.manifest["shards"][shard]["file"])
    want = _verify_message(tmp_path / "s")
    assert f"shard-0000{shard}" in want and "sha256" in want
    integrity.forget_hashes()
    out = tmp_path / "sae"
    code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                     "--batch-size", "8", "--eval-batches", "1", "--out", str(out))
    assert code == 1 and err == f"conceptdict train: error: {want}"
    assert not out.exists()  # nothing trained, nothing written


def test_eval_stops_on_a_damaged_shard_with_the_verify_message(tmp_path, capsys):
    _store(tmp_path, n=120, shard_rows=40)
    assert main(["train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2", "--batch-size", "8",
                 "--eval-batches", "1", "--out", str(tmp_path / "sae")]) == 0
    _flip(tmp_path / "s" / "shard-00002.safetensors")
    integrity.forget_hashes()
    want = _verify_message(tmp_path / "s")
    integrity.forget_hashes()
    capsys.readouterr()
    code, err = _run(capsys, "eval", str(tmp_path / "sae"))
    assert code == 1 and err == f"conceptdict eval: error: {want}"


def test_the_stream_refuses_a_damaged_store_before_yielding_a_batch(tmp_path):
    store = _store(tmp_path)
    _flip(tmp_path / "s" / store.manifest["shards"][2]["file"])
    stream = stream_batches(ActivationStore(tmp_path / "s"), HP, 8)
    with pytest.raises(StoreError, match="shard-00002.safetensors does not match its sha256"):
        next(stream)


def test_an_edited_header_dtype_or_a_truncated_shard_is_caught_on_open(tmp_path):
    store = _store(tmp_path)
    shard = tmp_path / "s" / store.manifest["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes().replace(b'"F32"', b'"I32"', 1))
    with pytest.raises(StoreError) as opened:
        ActivationStore(tmp_path / "s")
    assert "shard-00001.safetensors blocks.0.hook_out is I32 [21, 8], the manifest implies F32 [21, 8]" in str(
        opened.value)
    _store(tmp_path, "t")
    shard = tmp_path / "t" / "shard-00000.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(StoreError, match="shard-00000.safetensors has 100 bytes, the manifest says"):
        ActivationStore(tmp_path / "t")


def test_a_shard_that_is_not_safetensors_is_named(tmp_path):
    store = _store(tmp_path)
    entry = store.manifest["shards"][0]
    (tmp_path / "s" / entry["file"]).write_bytes(b"x" * entry["bytes"])
    with pytest.raises(StoreError, match="shard-00000.safetensors has no valid safetensors header"):
        ActivationStore(tmp_path / "s")


def test_sha256_is_checked_once_per_process_and_again_when_the_file_changes(tmp_path, monkeypatch):
    _store(tmp_path)
    calls = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p, *a: calls.append(p.name) or real(p, *a))
    for _ in range(3):  # reads in three stores opened one after the other: each shard hashed once
        s = ActivationStore(tmp_path / "s")
        s.rows(HP, 0, 60)
    assert sorted(calls) == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    shard = tmp_path / "s" / "shard-00001.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    ActivationStore(tmp_path / "s").rows(HP, 20, 40)
    assert calls[-1] == "shard-00001.safetensors" and len(calls) == 4


def test_no_verify_skips_the_hash_but_never_the_header(tmp_path, capsys):
    store = _store(tmp_path)
    _flip(tmp_path / "s" / store.manifest["shards"][0]["file"])
    integrity.set_read_policy(verify_hash=False)
    assert next(stream_batches(ActivationStore(tmp_path / "s"), HP, 8)).shape == (8, 8)
    with pytest.raises(StoreError, match="does not match its sha256"):
        ActivationStore(tmp_path / "s").verify()  # `store verify` always hashes


@pytest.mark.parametrize("key", ["shards", "hookpoints"])
def test_a_manifest_missing_a_key_is_named(tmp_path, capsys, key):
    _store(tmp_path)
    path = tmp_path / "s" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest[key]
    path.write_text(json.dumps(manifest))
    code, err = _run(capsys, "store", "info", str(tmp_path / "s"))
    assert code == 1 and err == (f"conceptdict store: error: {path} lacks the key(s) ['{key}']; the store is "
                                 "damaged, re-create it")


# ---------------------------------------------------------------- one writer per store


def test_a_second_writer_is_refused_naming_the_first_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    d = tmp_path / "store"
    with writer_lock(d) as lock:
        owner = json.loads(lock.read_text())
        assert owner["pid"] == os.getpid() and owner["host"]
        with writer_lock(d):  # re-entrant in the process that holds it
            assert (d / LOCK_NAME).exists()
        assert (d / LOCK_NAME).exists()
        second = subprocess.run([sys.executable, "-c", "import sys; from conceptdict.activations.lock import "
                                 "writer_lock\nwith writer_lock(sys.argv[1]): pass", str(d)],
                                capture_output=True, text=True)
        assert second.returncode != 0 and "StoreLocked" in second.stderr
        assert f"store {d} is being written by pid {os.getpid()} on host {owner['host']}" in second.stderr
    assert not (d / LOCK_NAME).exists() and not d.exists()  # created here, left empty: removed
    d.mkdir()
    (d / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": "elsewhere", "command": "cache"}))
    with writer_lock(d):  # nobody holds the flock: a writer that died
        pass
    assert "taking over the stale writer lock of pid 999999999 on host elsewhere" in caplog.text



def test_a_writer_asked_to_wait_takes_the_lock_once_the_first_lets_it_go_and_gives_up_after_its_wait(tmp_path):
    d = tmp_path / "store"
    code = ("import sys; from conceptdict.activations.lock import writer_lock\n"
            "with writer_lock(sys.argv[1], wait=float(sys.argv[2]), poll=0.05): print('got it')")
    with writer_lock(d):
        gives_up = subprocess.run([sys.executable, "-c", code, str(d), "0.3"], capture_output=True, text=True)
        waits = subprocess.Popen([sys.executable, "-c", code, str(d), "60"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        said = ""  # until it says it waits (a fixed sleep was too short on a loaded machine: it started after the
        while "waiting for it to finish" not in said:  # release and never waited); its own 60 s bound the loop
            line = waits.stderr.readline()
            if not line:
                break
            said += line
        assert waits.poll() is None  # still waiting, not refused
    out, err = waits.communicate(timeout=60)
    err = said + err
    assert gives_up.returncode != 0 and "StoreLocked" in gives_up.stderr and "waiting for it to finish" in \
        gives_up.stderr
    assert waits.returncode == 0 and out.strip() == "got it" and err.count("waiting for it to finish") == 1


# ---------------------------------------------------------------- input checks at the door


def test_import_refuses_nan_and_inf_with_the_count_and_first_row(tmp_path, capsys):
    a = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    a[17, 1], a[30, 0], a[30, 2] = np.nan, np.inf, -np.inf
    np.save(tmp_path / "acts.npy", a)
    code, err = _run(capsys, "store", "import", str(tmp_path / "acts.npy"), "--out", str(tmp_path / "s"),
                     "--shard-rows", "8", "--chunk-rows", "8")
    assert code == 1
    assert "holds 3 NaN/Inf value(s) (as float32), the first in array 'acts' row 17; nothing was imported" in err
    assert not (tmp_path / "s").exists()
    np.save(tmp_path / "big.npy", np.full((4, 2), 1e6))
    code, err = _run(capsys, "store", "import", str(tmp_path / "big.npy"), "--out", str(tmp_path / "h"),
                     "--dtype", "float16")
    assert code == 1 and "holds 8 NaN/Inf value(s) (as float16)" in err


def test_import_of_a_file_that_is_not_npy_never_mentions_pickles(tmp_path, capsys):
    path = tmp_path / "acts.npy"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    code, err = _run(capsys, "store", "import", str(path), "--out", str(tmp_path / "s"))
    assert code == 1 and "is not a .npy file" in err and "allow_pickle" not in err
    (tmp_path / "w.safetensors").write_bytes(b"not safetensors")
    code, err = _run(capsys, "store", "import", str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "s"))
    assert code == 1 and "w.safetensors is not a valid safetensors file" in err


@pytest.mark.parametrize("fill,reason", [(0.0, "is all zeros"), (3.0, "holds the same row 400 times")])
def test_train_refuses_all_zero_or_constant_rows(tmp_path, capsys, fill, reason):
    make_store(tmp_path / "s", {HP: torch.full((400, 8), fill)}, shard_rows=200)
    code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                     "--out", str(tmp_path / "sae"))
    assert code == 1 and f"store {tmp_path / 's'} [{HP}] {reason}" in err and "nothing to learn" in err


def test_a_tiny_store_is_explained_not_shrunk_to_nothing(tmp_path, capsys):
    make_store(tmp_path / "s", {HP: torch.randn(4, 8)})
    code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                     "--out", str(tmp_path / "sae"))
    assert code == 1 and "the store has 4 rows, too few to train on" in err and "--tokens" in err


def test_invalid_json_config_names_the_file(tmp_path, capsys):
    _store(tmp_path)
    cfg = tmp_path / "train.json"
    cfg.write_text('{"lr": 0.1,')
    code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                     "--config", str(cfg), "--out", str(tmp_path / "sae"))
    assert code == 1 and f"config file {cfg} is not valid JSON" in err


def test_a_changed_hub_revision_or_file_fingerprint_refuses_resume(tmp_path):
    from conceptdict.activations.data import check_same_dataset

    hub = {"kind": "hub", "spec": "org/data"}
    check_same_dataset({**hub, "revision": "a" * 40}, {**hub, "revision": "a" * 40}, tmp_path)
    check_same_dataset(hub, {**hub, "revision": "b" * 40}, tmp_path)  # unknown then: nothing to compare
    with pytest.raises(ValueError, match=f"revision then {'a' * 16}..., now {'b' * 16}..."):
        check_same_dataset({**hub, "revision": "a" * 40}, {**hub, "revision": "b" * 40}, tmp_path)
    with pytest.raises(ValueError, match=f"dataset f.jsonl changed since store {tmp_path} was started"):
        check_same_dataset({"spec": "f.jsonl", "sha256": "1" * 64}, {"spec": "f.jsonl", "sha256": "2" * 64}, tmp_path)


def test_unknown_wordfreq_language_is_named():
    from conceptdict.naming.vocab import load_vocabulary

    with pytest.raises(ValueError, match="wordfreq has no language 'zz'; use one of .*en"):
        load_vocabulary("wordfreq:zz:3000")


def test_a_non_utf8_vocabulary_file_is_named_with_its_line(tmp_path):
    from conceptdict.naming.vocab import load_vocabulary

    (tmp_path / "words.txt").write_bytes("cat\ndog\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"words.txt is not valid UTF-8 at line 3, column 4 \(byte 0xe9\)"):
        load_vocabulary(str(tmp_path / "words.txt"))


# ---------------------------------------------------------------- damaged training files


def test_truncated_checkpoint_and_non_safetensors_weights_are_named(tmp_path):
    from conceptdict.saes import SparseCoder, load_dictionary, save_dictionary
    from conceptdict.saes.files import CorruptFileError, read_checkpoint, write_atomic

    ck = tmp_path / "checkpoint.pt"
    write_atomic(ck, lambda fh: torch.save({"step": 3, "w": torch.randn(64, 64)}, fh))
    assert read_checkpoint(ck)["step"] == 3
    with open(ck, "r+b") as fh:
        fh.truncate(ck.stat().st_size // 2)
    with pytest.raises(CorruptFileError, match=f"checkpoint {ck} is truncated or corrupt"):
        read_checkpoint(ck)
    save_dictionary(SparseCoder(8, 16, 2, "topk"), tmp_path / "sae")
    (tmp_path / "sae" / "weights.safetensors").write_bytes(pickle.dumps({"W_enc": 1}))
    with pytest.raises(CorruptFileError, match="weights.safetensors should be safetensors but is a Python pickle"):
        load_dictionary(tmp_path / "sae")


# ---------------------------------------------------------------- the error boundary


def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from conceptdict.activations.models import check_device

    with pytest.raises(ValueError, match="--device cuda: CUDA is not available here .*use --device cpu"):
        check_device("cuda")
    _store(tmp_path)
    code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                     "--batch-size", "8", "--eval-batches", "1", "--device", "cuda", "--out", str(tmp_path / "sae"))
    assert code == 1 and err.startswith("conceptdict train: error: CUDA is not available") and "--device cpu" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(StoreError):
        main(["store", "info", str(tmp_path), "--debug"])
    assert main(["store", "info", str(tmp_path)]) == 1


def test_known_platform_failures_are_worded():
    import errno

    from conceptdict.cli.errors import describe_failure

    full = OSError(errno.ENOSPC, "No space left on device", "/data/store/shard-00003.safetensors")
    assert describe_failure(full).startswith("no space left on /data/store (writing /data/store/shard-00003.safetensors)")
    assert describe_failure(RuntimeError("the store writer failed: x").with_traceback(None)) is None
    wrapped = RuntimeError("the store writer failed")
    wrapped.__cause__ = full
    assert describe_failure(wrapped).startswith("no space left on /data/store")
    from safetensors import SafetensorError  # safetensors' own words for a full disk during `name`

    assert describe_failure(SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                            "message: \"No space left on device\" })")).startswith("no space left on")
    denied = PermissionError(errno.EACCES, "Permission denied", "/ro/out")
    assert describe_failure(denied).startswith("permission denied for /ro/out")
    assert describe_failure(KeyError("hookpoints")).startswith("a file lacks the key 'hookpoints'")
    assert describe_failure(ZeroDivisionError()) is None  # a bug keeps its traceback


# ---------------------------------------------------------------- never overwrite a user's files


def test_html_export_never_replaces_a_users_files(tmp_path, capsys):
    from conceptdict.naming import save_concepts
    from test_report import _dictionary

    save_concepts(_dictionary(evil=False), tmp_path / "dict")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("my own page")
    code, err = _run(capsys, "export", str(tmp_path / "dict"), "--format", "html", "--out", str(out))
    assert code == 1 and f"--out {out} holds files conceptdict did not create (index.html)" in err
    assert (out / "index.html").read_text() == "my own page"
    assert _run(capsys, "export", str(tmp_path / "dict"), "--format", "html", "--out", str(tmp_path / "r"))[0] == 0
    assert _run(capsys, "export", str(tmp_path / "dict"), "--format", "html", "--out", str(tmp_path / "r"))[0] == 0
    assert _run(capsys, "export", str(tmp_path / "dict"), "--format", "html", "--out", str(out),
                "--overwrite")[0] == 0
    assert "my own page" not in (out / "index.html").read_text()


def test_every_out_dir_command_refuses_a_foreign_directory(tmp_path, capsys):
    _store(tmp_path)
    np.save(tmp_path / "a.npy", np.ones((4, 2), np.float32))
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for argv in (["train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2"],
                 ["store", "import", str(tmp_path / "a.npy")],
                 ["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset", "x.txt"]):
        code, err = _run(capsys, *argv, "--out", str(out))
        assert code == 1 and "holds files conceptdict did not create (notes.txt)" in err, argv
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_directory_is_ours_only_by_the_marker_never_by_file_names(tmp_path, capsys):
    """A project's metrics.jsonl + train_config.json, a site's report/index.html + config.json and a web app's
    manifest.json + tokenizer/ are the user's: refused, and left without our marker."""
    from conceptdict import outdir

    _store(tmp_path)
    cases = {"project": ["metrics.jsonl", "train_config.json"], "site": ["report/index.html", "config.json"],
             "webapp": ["manifest.json", "tokenizer/vocab.txt"]}
    for name, files in cases.items():
        d = tmp_path / name
        for f in files:
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).write_text("the user's")
        before = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        code, err = _run(capsys, "train", "--store", str(tmp_path / "s"), "--latents", "16", "--k", "2",
                         "--out", str(d))
        assert code == 1 and "holds files conceptdict did not create" in err, name
        assert sorted(str(p.relative_to(d)) for p in d.rglob("*")) == before, name  # no marker, no lock left
        assert all((d / f).read_text() == "the user's" for f in files)
    made = outdir.claim(tmp_path / "new", "train", overwrite=False)
    assert made.created and made.marked and (tmp_path / "new" / outdir.MARKER).exists()
    outdir.release(tmp_path / "new", made, since=0.0)
    assert not (tmp_path / "new").exists()  # a failed first run leaves nothing behind
