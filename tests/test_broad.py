"""The broad dictionary (api/broad_api.py, activations/broad.py): the broad text, and one call that caches, trains
and names a dictionary once per (model, hookpoint, recipe, text), whose concepts fit a CBM on another store."""

from __future__ import annotations

import json

import pytest

import conceptdict as cd
from conceptdict.activations.broad import broad_texts
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

DOC = '"""{}"""\n'


def _package(root, name, docs):
    pkg = root / name
    pkg.mkdir(parents=True)
    body = "".join(f"def f{i}():\n    {DOC.format(d)}\n" for i, d in enumerate(docs))
    (pkg / "__init__.py").write_text(DOC.format(f"The {name} package reads and writes many kinds of files.") + body)
    return pkg


def test_broad_texts_take_summary_paragraphs_skip_tests_and_short_ones_and_cap_each_package(tmp_path):
    long = [f"Return the {w} of the given value as a new object here." for w in ("sum", "mean", "max", "min")]
    first = "The first paragraph says what this function does."
    _package(tmp_path, "alpha", [*long, "Too short.", long[0], first + "\n\nSecond one."])
    tests = _package(tmp_path / "alpha", "tests", ["A test docstring that must be skipped by the scan."])
    assert tests.is_dir()
    _package(tmp_path, "beta", ["Open a socket and send the request to the server."])
    recs = broad_texts(roots=[("packages", tmp_path)])
    texts = [r["text"] for r in recs]
    assert first in texts and "Second one." not in " ".join(texts)
    assert not any("skipped" in t or t == "Too short." for t in texts) and len(texts) == len(set(texts))
    assert {r["package"] for r in recs} == {"alpha", "beta"} and all(r["source"] == "packages" for r in recs)
    capped = broad_texts(per_package=3, roots=[("packages", tmp_path)])
    assert sum(r["package"] == "alpha" for r in capped) == 3 and sum(r["package"] == "beta" for r in capped) == 2
    assert len(broad_texts(max_texts=4, roots=[("packages", tmp_path)])) == 4
    assert broad_texts(roots=[("packages", tmp_path)]) == recs  # deterministic


@pytest.fixture()
def broad_settings(tmp_path, tiny_bert_dir):
    from fixtures_models import tiny_corpus

    data = tmp_path / "broad.jsonl"
    data.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in tiny_corpus(240, seed=5)))
    words = tmp_path / "words.txt"
    words.write_text("cat\ndog\nrain\nsnow\nbread\ncheese\nthe\nof\n")
    return dict(model=str(tiny_bert_dir), dataset=str(data), latents=16, k=4, vocab=str(words), context_length=48,
                cache_dir=tmp_path / "cache")


def test_broad_dictionary_is_built_once_cached_by_its_recipe_and_fits_a_cbm_on_another_store(
        broad_settings, tiny_sentence_store, tmp_path):
    first = cd.broad_dictionary(**broad_settings)
    assert first.built and first.root.parent == tmp_path / "cache" and first.root.name.startswith("broad-")
    assert first.texts == 240 and (first.concepts / "concepts.json").exists() and (first.sae / "config.json").exists()
    assert first.info["steps"] <= first.info["upper_bound"] and first.info["hookpoint"] == "sentence.mean_normalized"
    weights = (first.sae / "weights.safetensors").stat().st_mtime_ns
    again = cd.broad_dictionary(**broad_settings)
    assert not again.built and again.root == first.root and again.info == first.info
    assert (first.sae / "weights.safetensors").stat().st_mtime_ns == weights  # not trained again
    other = cd.broad_dictionary(**{**broad_settings, "latents": 24})
    assert other.built and other.root != first.root  # the settings are part of the key
    store_dir, _ = tiny_sentence_store  # a task's labelled store at the same hookpoint, never trained on
    res = cd.cbm(first.concepts, dataset=str(store_dir), label_column="topic", lam=[0.01], min_class_size=3,
                 out=tmp_path / "cbm")
    assert set(res.classes) == {"animals", "food", "weather"} and 0 <= res.metrics["accuracy"] <= 1
    assert res.metrics["dictionary"]["rows_from"] == "not trained on"
    assert cd.broad_dictionary(**broad_settings, fresh=True).built


def test_broad_command_prints_where_it_is_and_how_to_use_it(broad_settings, capsys):
    flags = [x for k, v in broad_settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["broad", *flags]) == 0
    out = capsys.readouterr().out
    built = cd.broad_dictionary(**broad_settings)
    assert "broad dictionary (built)" in out and f"concepts:   {built.concepts}" in out
    assert f"conceptdict cbm {built.concepts} --dataset STORE" in out
    assert main(["broad", *flags]) == 0 and "broad dictionary (cached)" in capsys.readouterr().out


def test_the_demos_broad_step_waits_for_a_build_fits_the_task_cbm_on_the_broad_concepts_and_is_skipped_when_fast(
        broad_settings, tiny_sentence_store, tmp_path):
    from conceptdict import demo_api as demo

    store, _ = tiny_sentence_store
    art = {"store": str(store), "hookpoint": "sentence.mean_normalized", "label_key": "topic"}
    fast = demo.broad_step(demo.DemoContext(tmp_path / "fast", fast=True, artifacts=art, broad=broad_settings))
    assert fast.artifacts == {} and "skipped" in fast.summary[0]
    # not cached and not asked to build: nothing is built, the step is not done (the next demo tries again)
    waits = demo.broad_step(demo.DemoContext(tmp_path / "demo", artifacts=art, broad=broad_settings))
    assert not waits.done and waits.artifacts == {} and "`conceptdict broad`" in waits.summary[0]
    assert not (tmp_path / "cache").exists() and cd.cached_broad_dictionary(**broad_settings) is None
    built = demo.broad_step(demo.DemoContext(tmp_path / "demo", artifacts=art, broad=broad_settings, build_broad=True))
    assert built.done and cd.cached_broad_dictionary(**broad_settings) is not None
    # a later demo without --broad uses the cached one
    done = demo.broad_step(demo.DemoContext(tmp_path / "demo2", artifacts=art, broad=broad_settings))
    cbm = json.loads((tmp_path / "demo2" / "cbm_broad" / "cbm.json").read_text())
    assert done.done and done.artifacts["cbm_broad"] == str(tmp_path / "demo2" / "cbm_broad")
    assert cbm["meta"]["dict_dir"] == str(cd.broad_dictionary(**broad_settings).concepts)
    assert set(cbm["classes"]) == {"animals", "food", "weather"} and "240 docstrings" in done.summary[0]


def test_broad_docstrings_is_a_dataset_cache_reads_keyed_by_the_installed_packages(monkeypatch):
    from conceptdict.activations import broad
    from conceptdict.activations.data import describe_dataset, iter_records

    monkeypatch.setattr(broad, "broad_texts", lambda: [{"text": "one text", "source": "stdlib", "package": "os"}])
    assert list(iter_records("broad-docstrings")) == [{"text": "one text", "source": "stdlib", "package": "os"}]
    desc = describe_dataset("broad-docstrings")
    assert desc["kind"] == "builtin" and desc["environment"] == broad.environment_key()
    monkeypatch.setattr(broad.importlib.metadata, "distributions", lambda: [])  # another set of packages
    assert broad.environment_key() != desc["environment"]
