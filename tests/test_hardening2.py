"""Hardening, round two (issue 39, first part): bad values refused at the door with one line naming them, and no
exit 0 on a result that is wrong or empty (each case failed, or exited 0, before)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import conceptdict as cd
from conceptdict.activations import StoreError
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("h2")
    np.save(root / "rows.npy", np.random.default_rng(0).standard_normal((2048, 8)).astype(np.float32))
    assert main(["store", "import", str(root / "rows.npy"), "--out", str(root / "store")]) == 0
    return root / "store"


def one_line(capsys) -> str:
    """The command's error: one line, no traceback (progress bars on stderr aside)."""
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if " error: " in ln]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("flag,value,says", [
    ("--lr", "inf", "lr=inf must be a finite number"),
    ("--lr", "nan", "lr=nan must be a finite number"),
    ("--aux-alpha", "inf", "aux_alpha=inf must be a finite number"),
    ("--code-l1", "nan", "code_l1=nan must be a finite number"),
])
def test_non_finite_numbers_are_refused_at_the_door(small_store, tmp_path, capsys, flag, value, says):
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", flag, value,
                 "--out", str(tmp_path / "sae")]) == 1
    assert says in one_line(capsys)
    assert not (tmp_path / "sae" / "weights.safetensors").exists()


def test_a_kind_setting_that_is_not_finite_is_refused():
    with pytest.raises(ValueError, match="l0_coeff=inf must be a finite number"):
        cd.train(store="unused", latents=16, k=2, kind="jumprelu", l0_coeff=float("inf"), out="unused")


def test_a_config_file_value_of_the_wrong_type_is_one_line(small_store, tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"k": "eight", "latents": 16}))
    assert main(["train", "--store", str(small_store), "--config", str(cfg), "--out", str(tmp_path / "sae")]) == 1
    assert "k='eight' must be an integer, not str" in one_line(capsys)
    cfg.write_text(json.dumps({"k": 2, "latents": 16, "tokens": 4096.0, "lr": 1}))  # JSON numbers that fit are fine
    assert main(["train", "--store", str(small_store), "--config", str(cfg), "--out", str(tmp_path / "ok"),
                 "--kernel-impl", "reference"]) == 0


@pytest.mark.parametrize("kind", ["crosscoder", "crosscoder-l1"])
def test_a_crosscoder_over_one_source_is_refused(small_store, tmp_path, capsys, kind):
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--kind", kind,
                 "--out", str(tmp_path / "cc")]) == 1
    assert f"kind {kind!r} is a crosscoder" in one_line(capsys)


def test_an_empty_array_is_not_a_store(tmp_path, capsys):
    np.save(tmp_path / "empty.npy", np.zeros((0, 8), dtype=np.float32))
    assert main(["store", "import", str(tmp_path / "empty.npy"), "--out", str(tmp_path / "s")]) == 1
    assert "holds 0 rows" in one_line(capsys)
    assert not (tmp_path / "s").exists()


def test_a_dataset_of_blank_lines_caches_nothing_and_says_so(tmp_path, tiny_bert_dir, capsys):
    (tmp_path / "blank.txt").write_text("\n\n   \n\n")
    assert main(["cache", "--model", str(tiny_bert_dir), "--hookpoint", "sentence.mean_normalized", "--dataset",
                 str(tmp_path / "blank.txt"), "--out", str(tmp_path / "s")]) == 1
    line = one_line(capsys)  # names the file and the column (issue 50: it named only the column)
    assert f"dataset '{tmp_path / 'blank.txt'}' holds no text: all 4 records of its column 'text' are blank" in line
    assert "--text-column" in line


def test_blank_records_are_skipped_not_cached(tmp_path, tiny_bert_dir):
    (tmp_path / "d.txt").write_text("alpha beta gamma\n\n   \ndelta epsilon\n")
    store = cd.cache(model=str(tiny_bert_dir), hookpoint="sentence.mean_normalized", dataset=str(tmp_path / "d.txt"),
                     out=tmp_path / "s")
    assert store.num_rows == 2 and store.row_context(1).text.strip() == "delta epsilon"


def test_a_label_column_the_dataset_lacks_is_refused_at_cache(tmp_path, tiny_bert_dir, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "hello world", "family": "a"}\n{"text": "more", "family": "b"}\n')
    assert main(["cache", "--model", str(tiny_bert_dir), "--hookpoint", "sentence.mean_normalized", "--dataset",
                 str(tmp_path / "d.jsonl"), "--label-column", "topic", "--out", str(tmp_path / "s")]) == 1
    err = one_line(capsys)
    assert "label column 'topic' is not in record 0" in err and "'family'" in err


def test_a_run_whose_loss_becomes_nan_stops_with_the_step(small_store, tmp_path, capsys, monkeypatch):
    from conceptdict.saes import training

    real = training.step
    calls = {"n": 0}

    def poisoned(run, x, cfg, lr, comm):
        calls["n"] += 1
        out = real(run, x, cfg, lr, comm)
        return {**out, "loss": float("nan")} if calls["n"] == 5 else out

    monkeypatch.setattr(training, "step", poisoned)
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--tokens", str(20 * 64),
                 "--batch-size", "64", "--kernel-impl", "reference", "--out", str(tmp_path / "sae")]) == 1
    err = one_line(capsys)
    assert "training diverged at step 5: the loss is nan" in err and "lower --lr" in err
    assert not (tmp_path / "sae" / "weights.safetensors").exists()  # no dictionary reported as trained


# ---------------------------------------------------------------- every setting, every bad value (table-driven)


def _settings_classes():
    from conceptdict.activations.cache import CacheConfig
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.activations.live import LiveConfig
    from conceptdict.concept_api import ExportConfig
    from conceptdict.diff_api import DiffConfig
    from conceptdict.eval_api import CompareConfig, EvalConfig
    from conceptdict.naming.bottleneck.cbm import CbmConfig
    from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
    from conceptdict.naming.interventions.erase import EraseConfig
    from conceptdict.naming.interventions.steer import SteerConfig
    from conceptdict.naming.pipeline import NameConfig
    from conceptdict.naming.scoring import ScoreConfig
    from conceptdict.train_api import TrainCommand, train_settings

    return [CacheConfig, ImportConfig, LiveConfig, TrainCommand, train_settings(), EvalConfig, CompareConfig,
            DiffConfig, NameConfig, ScoreConfig, CbmConfig, CbSaeConfig, ExportConfig, SteerConfig, EraseConfig]


def _numeric_fields():
    from typing import get_args, get_origin

    from conceptdict.settings import settings_of, unwrap_optional

    for cls in _settings_classes():
        for s in settings_of(cls):
            tp, _ = unwrap_optional(s.type)
            is_list = get_origin(tp) is list
            item = (get_args(tp) or (None,))[0] if is_list else tp
            if item in (int, float):
                yield cls, s.name, item, is_list


def _label(cls) -> str:
    return getattr(cls, "__name__", "TrainingSettings")


NUMERIC = list(_numeric_fields())


def test_the_table_covers_every_command():
    classes = {_label(cls) for cls, *_ in NUMERIC}
    assert len(NUMERIC) > 60 and len(classes) >= 13, classes


@pytest.mark.parametrize("cls,name,item,is_list", NUMERIC, ids=[f"{_label(c)}.{n}" for c, n, *_ in NUMERIC])
def test_every_numeric_setting_refuses_text_and_non_finite_values(cls, name, item, is_list):
    from conceptdict.settings import ConfigError, coerce_settings

    bad = ["eight"] + ([float("nan"), float("inf"), float("-inf")] if item is float else [2.5])
    for value in bad:
        given = [1, value] if is_list else value
        with pytest.raises(ConfigError) as e:
            coerce_settings(cls, {name: given}, "conceptdict x")
        message = str(e.value)
        assert name in message and ("must be a finite number" in message or "must be an integer" in message
                                    or "must be a number" in message), message


# ---------------------------------------------------------------- damaged inputs that used to pass silently


def _fix_hash(store, index=0):
    """Rewrite the manifest's sha256 of shard ``index`` to match its (edited) bytes, as a careless edit would."""
    from conceptdict.activations.integrity import file_sha256, forget_hashes

    manifest = json.loads((store / "manifest.json").read_text())
    entry = manifest["shards"][index]
    entry["sha256"], entry["bytes"] = file_sha256(store / entry["file"]), (store / entry["file"]).stat().st_size
    (store / "manifest.json").write_text(json.dumps(manifest))
    forget_hashes()


def test_a_manifest_listing_one_shard_twice_is_corrupt(tmp_path, capsys):
    from test_store import make_store

    store = make_store(tmp_path / "s", {"h": torch.randn(14, 4)}, shard_rows=7).path
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][1] = dict(manifest["shards"][0])
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert main(["store", "verify", str(store)]) == 1
    assert "lists shard shard-00000.safetensors twice (entries 0 and 1)" in one_line(capsys)


def test_a_nan_row_inside_a_shard_stops_verify_and_every_reader(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from test_store import make_store

    acts = torch.randn(14, 4)
    store = make_store(tmp_path / "s", {"h": acts}, shard_rows=7).path
    shard = store / "shard-00001.safetensors"
    tensors, meta = load_file(str(shard)), json.loads(shard.read_bytes()[8:8 + int.from_bytes(
        shard.read_bytes()[:8], "little")]).get("__metadata__")
    tensors["h"][2, 1] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    _fix_hash(store, 1)
    assert main(["store", "verify", str(store)]) == 1
    assert "holds NaN/Inf activations at h in 1 row(s), the first its row 2" in one_line(capsys)
    with pytest.raises(StoreError, match="NaN/Inf activations"):
        cd.open_store(store).rows("h", 0, 14)


def test_a_dictionary_holding_nan_is_refused_on_load(small_store, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    sae = tmp_path / "sae"
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--tokens", "2048",
                 "--out", str(sae)]) == 0
    weights = load_file(str(sae / "weights.safetensors"))
    name = next(n for n in weights if n.startswith("W_enc"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(sae / "weights.safetensors"))
    capsys.readouterr()
    assert main(["eval", str(sae)]) == 1
    assert f"holds 1 NaN/Inf value(s) in {name}" in one_line(capsys)


def test_export_refuses_the_cbm_of_another_concept_dictionary(tmp_path, capsys):
    from conceptdict.naming import save_concepts
    from conceptdict.naming.bottleneck.cbm import save_cbm
    from test_report import _cbm, _dictionary

    mine, other = _dictionary(evil=False), _dictionary(n=9, evil=False)
    other = other.__class__(tuple(c.__class__(**{**c.__dict__, "name": f"other {c.id}"}) for c in other.concepts),
                            other.directions, other.meta)
    save_concepts(mine, tmp_path / "mine")
    save_concepts(other, tmp_path / "other")
    save_cbm(_cbm(other), tmp_path / "cbm")
    assert main(["export", str(tmp_path / "mine"), "--format", "html", "--cbm", str(tmp_path / "cbm"),
                 "--out", str(tmp_path / "report")]) == 1
    assert "was fitted on another concept dictionary" in one_line(capsys)
    assert not (tmp_path / "report").exists()
    save_cbm(_cbm(mine), tmp_path / "cbm-mine")
    assert main(["export", str(tmp_path / "mine"), "--format", "html", "--cbm", str(tmp_path / "cbm-mine"),
                 "--out", str(tmp_path / "report")]) == 0


def test_cbm_with_a_dictionary_of_another_width_or_hookpoint_is_one_line(tmp_path):
    from conceptdict.concept_api import check_sae_fits
    from conceptdict.saes import SparseCoder
    from conceptdict.settings import ConfigError
    from test_report import _dictionary
    from test_store import make_store

    store = make_store(tmp_path / "s", {"h": torch.randn(14, 4)})
    concepts = _dictionary(evil=False)
    with pytest.raises(ConfigError, match="reads 8-wide inputs, but store .* holds h at width 4"):
        check_sae_fits(SparseCoder(8, 7, 2), {}, "x", concepts, store, "h")
    with pytest.raises(ConfigError, match="was trained on other.hook, not on h"):
        check_sae_fits(SparseCoder(4, 7, 2), {"format": "conceptdict-dictionary", "hookpoints": ["other.hook"]}, "x", concepts, store, "h")
    with pytest.raises(ConfigError, match="has 9 latents, the concept dictionary names 7"):
        check_sae_fits(SparseCoder(4, 9, 2), {"hookpoints": ["h"]}, "x", concepts, store, "h")
    check_sae_fits(SparseCoder(4, 7, 2), {"hookpoints": ["h"]}, "x", concepts, store, "h")


def test_pre_tokenised_ids_outside_the_vocabulary_are_refused():
    from conceptdict.activations.data import iter_contexts

    def contexts(ids):
        return list(iter_contexts([{"ids": ids}], None, context_length=8, packing=False, tokens_column="ids",
                                  vocab_size=100))

    assert contexts([1, 2, 99])[0].ids == [1, 2, 99]
    with pytest.raises(ValueError, match=r"record 0: column 'ids' holds token id 100, outside .* \[0, 100\)"):
        contexts([1, 100])
    with pytest.raises(ValueError, match="holds token id -3"):
        contexts([-3, 1])
    with pytest.raises(ValueError, match="must hold a list of integer token ids"):
        contexts(["a", "b"])


def test_a_missing_local_model_or_dataset_is_no_such_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset", "./missing.txt",
                 "--out", "s"]) == 1
    assert "--dataset ./missing.txt: no such file or directory (a path, so it is not looked up" in one_line(capsys)
    assert main(["cache", "--model", "./nomodel", "--hookpoint", "sentence.mean", "--dataset", "stdlib-docstrings",
                 "--out", "s2"]) == 1
    assert "--model ./nomodel: no such file or directory" in one_line(capsys)
    assert main(["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset", "notes.jsonl",
                 "--out", "s3"]) == 1
    assert "--dataset notes.jsonl: no such file" in one_line(capsys)


def test_a_finished_store_is_not_done_for_a_dataset_that_changed(tmp_path, tiny_bert_dir, capsys):
    data = tmp_path / "d.txt"
    data.write_text("one line of text\nanother line\n")
    argv = ["cache", "--model", str(tiny_bert_dir), "--hookpoint", "sentence.mean_normalized", "--dataset", str(data),
            "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    assert main(argv) == 0  # the same data: done
    data.write_text("other text entirely\n")
    capsys.readouterr()
    assert main(argv) == 1
    assert "is finished, but from the earlier version: its rows are not this dataset's" in one_line(capsys)


def test_small_values_that_used_to_pass(tmp_path, capsys):
    from conceptdict.naming.vocab import load_vocabulary

    with pytest.raises(cd.ConfigError, match="seed=-1 must be >= 0"):  # was numpy's "expected non-negative integer"
        cd.train(store="x", latents=16, k=2, seed=-1, out=tmp_path / "t")

    with pytest.raises(ValueError, match="N=0 must be at least 1"):
        load_vocabulary("wordfreq:en:0")
    with pytest.raises(cd.ConfigError, match="per_page=0 must be at least 1"):
        cd.export(tmp_path, format="html", per_page=0, out=tmp_path / "r")


def test_damaged_dictionary_and_concept_files_are_named(tmp_path, small_store, capsys):
    from conceptdict.naming import save_concepts
    from test_report import _dictionary

    sae = tmp_path / "sae"
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--tokens", "2048",
                 "--out", str(sae)]) == 0
    assert main(["export", str(sae), "--format", "saelens", "--out", str(tmp_path / "sl")]) == 0
    cfg = json.loads((tmp_path / "sl" / "cfg.json").read_text())
    del cfg["d_in"]
    (tmp_path / "sl" / "cfg.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "sl"), "--store", str(small_store)]) == 1
    assert f"{tmp_path / 'sl' / 'cfg.json'} lacks the key 'd_in'" in one_line(capsys)
    save_concepts(_dictionary(evil=False), tmp_path / "c")
    (tmp_path / "c" / "concepts.json").write_text('{"concepts": [')
    assert main(["show", str(tmp_path / "c")]) == 1
    assert f"{tmp_path / 'c' / 'concepts.json'} is not valid JSON" in one_line(capsys)


def test_npy_files_numpy_cannot_map_are_named_or_converted(tmp_path, capsys):
    a = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    np.save(tmp_path / "be.npy", a.astype(">f4"))
    assert main(["store", "import", str(tmp_path / "be.npy"), "--out", str(tmp_path / "be")]) == 0
    assert torch.equal(cd.open_store(tmp_path / "be").rows("be", 0, 16), torch.from_numpy(a))  # converted
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    assert main(["store", "import", str(tmp_path / "obj.npy"), "--out", str(tmp_path / "o1")]) == 1
    assert f"{tmp_path / 'obj.npy'}: array 'obj.npy' holds Python objects" in one_line(capsys)
    full = (tmp_path / "be.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(full[: len(full) // 2])
    assert main(["store", "import", str(tmp_path / "cut.npy"), "--out", str(tmp_path / "o2")]) == 1
    assert f"{tmp_path / 'cut.npy'} is truncated or damaged" in one_line(capsys)
    (tmp_path / "head.npy").write_bytes(full[:20])
    assert main(["store", "import", str(tmp_path / "head.npy"), "--out", str(tmp_path / "o3")]) == 1
    assert f"{tmp_path / 'head.npy'} has a damaged or truncated .npy header" in one_line(capsys)
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


def test_eval_rows_zero_is_refused_not_silently_32(small_store, tmp_path, capsys):
    sae = tmp_path / "sae"
    assert main(["train", "--store", str(small_store), "--latents", "16", "--k", "2", "--tokens", "2048",
                 "--out", str(sae)]) == 0
    capsys.readouterr()
    for rows in ("0", "-1"):
        assert main(["eval", str(sae), "--rows", rows]) == 1
        assert f"rows={rows} must be at least 1" in one_line(capsys)


def test_compare_of_one_dictionary_and_erase_ranges_are_one_line(small_store, tmp_path, capsys):
    with pytest.raises(cd.ConfigError, match="compare puts dictionaries side by side; got 1"):
        cd.compare([tmp_path / "sae"], store=small_store, out=tmp_path / "cmp")
    from conceptdict.naming.interventions.erase import EraseConfig

    for name, value, says in (("ablate_latents", 0, "at least 1"), ("max_rows", 0, "at least 1"),
                              ("contexts", -1, ">= 0"), ("ablate_l1", -0.5, ">= 0")):
        with pytest.raises(ValueError, match=f"{name}={value} must be {says}"):
            EraseConfig(concept_column="c", **{name: value})


def test_finite_rows_whose_sum_overflows_pass_the_nan_check(tmp_path):
    from conceptdict.activations.integrity import forget_hashes
    from test_store import make_store

    big = torch.full((14, 4), 3e38)  # every value finite, their float32 sum is inf: the exact check decides
    store = make_store(tmp_path / "s", {"h": big}, shard_rows=7)
    forget_hashes()
    store.verify()
    assert torch.equal(store.rows("h", 0, 14), big)
