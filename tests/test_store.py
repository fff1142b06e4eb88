"""The activation store format, its reader, verification, the import command and the training stream."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conceptdict.activations import ActivationStore, ImportConfig, StoreError, import_array, stream_batches
from conceptdict.activations import store as st
from conceptdict.activations.writer import ShardWriter
from conceptdict.cli.main import main

pytestmark = pytest.mark.unit


def make_store(path, acts: dict[str, torch.Tensor], dtype="float32", shard_rows=7, tokens=None, level="token"):
    """A store whose rows are ``acts`` (same N for every hookpoint), written in adds of 3 rows."""
    n = next(iter(acts.values())).shape[0]
    tokens = torch.arange(n, dtype=torch.int32) % 50 if tokens is None else tokens
    manifest = st.new_manifest(level=level, hookpoints={k: v.shape[1] for k, v in acts.items()}, dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(path, manifest, shard_rows)
    for a in range(0, n, 3):
        b = min(n, a + 3)
        rows = {k: v[a:b] for k, v in acts.items()}
        rows.update(tokens=tokens[a:b], context_index=torch.arange(a, b) // 5,
                    position=torch.arange(a, b, dtype=torch.int32) % 5)
        writer.add(rows, labels={"parity": [i % 2 for i in range(a, b)]}, extra={"next_batch": b})
    writer.close()
    return ActivationStore(path)


def row_ids(n, d=4):
    """Rows whose every entry is the row index: batches reveal which rows they hold."""
    return torch.arange(n, dtype=torch.float32)[:, None].repeat(1, d)


def test_golden_schema(tmp_path):
    store = make_store(tmp_path / "s", {"blocks.0.hook_out": torch.randn(20, 6)})
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert set(m) == {"format", "format_version", "level", "hookpoints", "dtype", "model", "dataset", "tokenizer",
                      "context_length", "excluded_tokens", "config", "config_hash", "label_keys", "num_rows",
                      "shards", "complete"}
    assert m["format"] == "conceptdict.activations" and m["format_version"] == st.FORMAT_VERSION == 1
    assert m["hookpoints"] == {"blocks.0.hook_out": {"d": 6}} and m["num_rows"] == 20 and m["complete"] is True
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                 "shard-00002.safetensors"]
    assert [s["rows"] for s in m["shards"]] == [9, 9, 2]  # cut at add boundaries once >= 7 rows
    assert set(m["shards"][0]) == {"file", "rows", "bytes", "sha256", "next_batch"}
    with safe_open(str(tmp_path / "s" / "shard-00000.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "conceptdict.activations"
        assert f.metadata()["format_version"] == "1"
        assert json.loads(f.metadata()["labels"]) == {"parity": [i % 2 for i in range(9)]}
        assert set(f.keys()) == {"blocks.0.hook_out", "tokens", "context_index", "position"}
        assert f.get_tensor("tokens").dtype == torch.int32
        assert f.get_tensor("context_index").dtype == torch.int64
        assert f.get_tensor("position").dtype == torch.int32
    assert store.labels("parity") == [i % 2 for i in range(20)] and store.labels("nope") is None
    store.verify()
    assert not list((tmp_path / "s").glob(".*tmp*"))
    again = make_store(tmp_path / "again", {"blocks.0.hook_out": store.rows("blocks.0.hook_out", 0, 20)})
    assert [s["sha256"] for s in again.manifest["shards"]] == [s["sha256"] for s in m["shards"]]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_round_trip(tmp_path, dtype):
    torch_dtype = st.DTYPES[dtype]
    x = torch.randn(23, 5).to(torch_dtype)  # values exactly representable in the stored dtype
    store = make_store(tmp_path / dtype, {"h": x}, dtype=dtype)
    got = store.rows("h", 0, 23)
    assert got.dtype == torch_dtype and torch.equal(got, x)
    assert torch.equal(torch.cat([c for _, c in store.iter_rows("h", chunk=4)]), x)
    assert torch.equal(store.rows("h", 5, 17), x[5:17])  # a span across shards
    assert store.tokens(0, 23).tolist() == list(range(23))
    batch = next(stream_batches(store, "h", 8))
    assert batch.dtype == torch.float32


def test_reader_refuses_unfinished_and_foreign_dirs(tmp_path):
    with pytest.raises(StoreError, match="no manifest.json"):
        ActivationStore(tmp_path)
    manifest = st.new_manifest(level="token", hookpoints={"h": 2}, dtype="float32")
    st.write_manifest(tmp_path, manifest)
    with pytest.raises(StoreError, match="unfinished"):
        ActivationStore(tmp_path)
    with pytest.raises(StoreError, match="reserved"):
        st.new_manifest(level="token", hookpoints={"tokens": 2}, dtype="float32")


def test_corrupt_shard_is_named(tmp_path):
    store = make_store(tmp_path / "s", {"h": torch.randn(20, 6)})
    path = tmp_path / "s" / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="shard-00001.safetensors"):
        ActivationStore(tmp_path / "s").verify()
    path.unlink()
    with pytest.raises(StoreError, match="shard-00001.safetensors is missing"):
        store.verify()
    assert main(["store", "verify", str(tmp_path / "s")]) == 1


def test_row_context_token_level(tmp_path):
    store = make_store(tmp_path / "s", {"h": torch.randn(20, 2)})
    ctx = store.row_context(7, before=8, after=4)  # context 1 holds rows 5..9
    assert ctx.context_index == 1 and ctx.position == 2
    assert ctx.tokens == ["<5>", "<6>", "<7>", "<8>", "<9>"] and ctx.marked == 2


def test_stream_deterministic_and_covers_every_row_once(tmp_path):
    store = make_store(tmp_path / "s", {"h": row_ids(101)}, shard_rows=10)
    a = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 10, seed=3, buffer_rows=40)]
    b = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 10, seed=3, buffer_rows=40)]
    c = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 10, seed=4, buffer_rows=40)]
    assert a == b and a != c
    flat = [r for batch in a for r in batch]
    assert len(flat) == 100 and len(set(flat)) == 100  # one epoch, last partial batch dropped
    two = list(stream_batches(store, "h", 10, seed=3, epochs=2, buffer_rows=40))
    assert len(two) == 20  # 202 rows -> the remainder carries across the epoch boundary


def test_stream_holdout_rows_never_come_again(tmp_path):
    """Training evaluates on its first eval_batches batches: with holdout_batches their rows are left out
    of every later epoch (resumable and rank-split like any stream), and the first epoch is unchanged."""
    store = make_store(tmp_path / "s", {"h": row_ids(203)}, shard_rows=20)
    kw = dict(seed=2, buffer_rows=48)
    plain = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 8, epochs=1, **kw)]
    full = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 8, epochs=4, holdout_batches=3, **kw)]
    assert full[: len(plain)] == plain  # epoch 0 as without holdout
    held = {r for batch in full[:3] for r in batch}
    assert len(held) == 24 and not held & {r for batch in full[3:] for r in batch}
    later = [r for batch in full[len(plain):] for r in batch]
    assert len(set(later) | held) == 203 and len(later) > 2 * (203 - 24)  # every other row keeps coming
    resumed = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 8, epochs=4, holdout_batches=3,
                                                                start_batch=40, **kw)]
    assert resumed == full[40:]
    halves = [[b[:, 0].long().tolist() for b in stream_batches(store, "h", 8, epochs=4, holdout_batches=3,
                                                                 part=(r, 2), **kw)] for r in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == full
    with pytest.raises(ValueError, match="leaves none"):
        next(stream_batches(store, "h", 8, epochs=None, holdout_batches=26, **kw))


def test_heldout_row_ids_are_the_rows_heldout_batches_read(tmp_path):
    from conceptdict.activations import heldout_batches, heldout_recipe, heldout_row_ids

    store = make_store(tmp_path / "s", {"h": row_ids(203)}, shard_rows=20)
    recipe = heldout_recipe([store], ["h"], batch_size=8, seed=3, batches=5, buffer_rows=48)
    read = sorted(r for b in heldout_batches(recipe, store, ["h"], 10**6) for r in b[:, 0].long().tolist())
    assert heldout_row_ids(recipe, store).tolist() == read and len(read) == 40
    assert heldout_row_ids({**recipe, "batches": 0}, store) is None
    assert heldout_row_ids({**recipe, "stores": ["/elsewhere"]}, store) is None


def test_stream_shuffles_across_shards(tmp_path):
    store = make_store(tmp_path / "s", {"h": row_ids(400)}, shard_rows=50)
    assert len(store.manifest["shards"]) >= 7
    starts = [0]
    for s in store.manifest["shards"]:
        starts.append(starts[-1] + s["rows"])
    first = next(stream_batches(store, "h", 32, seed=0, buffer_rows=256))[:, 0].long()
    shards = {int(np.searchsorted(starts, r, side="right")) - 1 for r in first.tolist()}
    assert len(shards) >= 3
    assert first.tolist() != sorted(first.tolist())


def test_stream_start_batch_and_ranks(tmp_path):
    store = make_store(tmp_path / "s", {"h": row_ids(300)}, shard_rows=64)
    full = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 16, seed=1, epochs=2, buffer_rows=64)]
    resumed = [b[:, 0].long().tolist()
               for b in stream_batches(store, "h", 16, seed=1, epochs=2, buffer_rows=64, start_batch=13)]
    assert resumed == full[13:]
    r0 = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 16, seed=1, epochs=2, buffer_rows=64,
                                                           start_batch=13, part=(0, 2))]
    r1 = [b[:, 0].long().tolist() for b in stream_batches(store, "h", 16, seed=1, epochs=2, buffer_rows=64,
                                                           start_batch=13, part=(1, 2))]
    assert [a + b for a, b in zip(r0, r1)] == full[13:]  # each rank: its half of every batch
    assert all(len(a) == 8 for a in r0 + r1)


def test_stream_multi_hookpoint_aligned(tmp_path):
    ids = row_ids(60, d=3)
    store = make_store(tmp_path / "s", {"a": ids, "b": -ids}, shard_rows=16)
    for batch in stream_batches(store, ["a", "b"], 8, seed=0, buffer_rows=32):
        assert batch.shape == (8, 2, 3)
        assert torch.equal(batch[:, 1], -batch[:, 0])


def test_stream_multi_store_aligned_and_refused(tmp_path):
    ids = row_ids(60, d=3)
    a = make_store(tmp_path / "a", {"h": ids}, shard_rows=16)
    b = make_store(tmp_path / "b", {"h": 2 * ids}, shard_rows=25)  # different shard layout, same tokens
    for batch in stream_batches([a, b], "h", 8, seed=0):
        assert batch.shape == (8, 2, 3) and torch.equal(batch[:, 1], 2 * batch[:, 0])
    other = torch.arange(60, dtype=torch.int32)
    other[17] = 999
    c = make_store(tmp_path / "c", {"h": ids}, tokens=other)
    with pytest.raises(StoreError, match="tokens differ at row 17"):
        next(stream_batches([a, c], "h", 8))
    d = make_store(tmp_path / "d", {"h": ids[:59]})
    with pytest.raises(StoreError, match="59"):
        next(stream_batches([a, d], "h", 8))


def test_stream_errors(tmp_path):
    store = make_store(tmp_path / "s", {"h": row_ids(10)})
    with pytest.raises(ValueError, match="fewer than one batch"):
        next(stream_batches(store, "h", 64))
    with pytest.raises(StoreError, match="no hookpoint 'x'"):
        next(stream_batches(store, "x", 4))


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors"])
def test_import_formats(tmp_path, suffix):
    x = np.random.default_rng(0).standard_normal((37, 6)).astype(np.float16)
    labels = np.arange(37, dtype=np.int64) % 3
    path = tmp_path / f"acts{suffix}"
    if suffix == ".npy":
        np.save(path, x)
    elif suffix == ".npz":
        np.savez(path, emb=x, label=labels)
    else:
        save_file({"emb": torch.from_numpy(x), "label": torch.from_numpy(labels)}, str(path))
    out = import_array(ImportConfig(array=path, out=tmp_path / "store", shard_rows=10, chunk_rows=7))
    store = ActivationStore(out)
    hp = "acts" if suffix == ".npy" else "emb"
    assert store.hookpoints == [hp] and store.manifest["dtype"] == "float16"
    assert torch.equal(store.rows(hp, 0, 37), torch.from_numpy(x))
    if suffix != ".npy":
        assert store.labels("label") == labels.tolist()
    store.verify()
    with pytest.raises(FileExistsError, match="--overwrite"):
        import_array(ImportConfig(array=path, out=out))


def test_import_refuses_pickles_and_bad_keys(tmp_path):
    obj = np.empty(3, dtype=object)
    np.save(tmp_path / "obj.npy", obj, allow_pickle=True)
    with pytest.raises(ValueError):
        import_array(ImportConfig(array=tmp_path / "obj.npy", out=tmp_path / "o1"))
    np.savez(tmp_path / "o.npz", x=obj)
    with pytest.raises(ValueError, match="Python objects"):
        import_array(ImportConfig(array=tmp_path / "o.npz", out=tmp_path / "o2"))
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="no array 'y'"):
        import_array(ImportConfig(array=tmp_path / "a.npz", out=tmp_path / "o3", keys=["y"]))


def test_store_cli_import_info_verify(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32))
    out = tmp_path / "store"
    assert main(["store", "import", str(tmp_path / "x.npy"), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert (out / "import_config.json").exists()
    assert ActivationStore(out).manifest["dtype"] == "bfloat16"
    assert main(["store", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hookpoint   x  D=8" in text and "50 rows" in text
    assert main(["store", "verify", str(out)]) == 0
    assert "ok:" in capsys.readouterr().out
