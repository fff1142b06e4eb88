"""The broad dictionary (api/broad_api.py, activations/broad.py): the broad text, and one call that caches, trains
and names a dictionary once per (model, hookpoint, recipe, text), whose concepts fit a CBM on another store."""

from __future__ import annotations

import gzip
import json

import pytest

import conceptdict as cd
from conceptdict.activations.broad import (apt_records, docstring_records, held_out, man_pages, man_records,
                                           parse_dumpavail)
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

DOC = '"""{}"""\n'


def _package(root, name, docs):
    pkg = root / name
    pkg.mkdir(parents=True)
    body = "".join(f"def f{i}():\n    {DOC.format(d)}\n" for i, d in enumerate(docs))
    (pkg / "__init__.py").write_text(DOC.format(f"The {name} package reads and writes many kinds of files.") + body)
    return pkg


def test_docstring_records_take_summary_paragraphs_skip_tests_and_short_ones_and_cap_each_package(tmp_path):
    long = [f"Return the {w} of the given value as a new object here." for w in ("sum", "mean", "max", "min")]
    first = "The first paragraph says what this function does."
    _package(tmp_path, "alpha", [*long, "Too short.", long[0], first + "\n\nSecond one."])
    tests = _package(tmp_path / "alpha", "tests", ["A test docstring that must be skipped by the scan."])
    assert tests.is_dir()
    _package(tmp_path, "beta", ["Open a socket and send the request to the server.", long[1]])
    every = dict(roots=[("packages", tmp_path)], keep=lambda path: True)
    recs = docstring_records(**every)
    texts = [r["text"] for r in recs]
    assert first in texts and "Second one." not in " ".join(texts)
    assert not any("skipped" in t or t == "Too short." for t in texts) and len(texts) == len(set(texts))
    assert {r["package"] for r in recs} == {"alpha", "beta"} and all(r["source"] == "packages" for r in recs)
    capped = docstring_records(per_package=3, **every)
    assert sum(r["package"] == "alpha" for r in capped) == 3 and sum(r["package"] == "beta" for r in capped) == 2
    assert len(docstring_records(max_texts=4, **every)) == 4
    assert docstring_records(**every) == recs  # deterministic
    no_beta = docstring_records(roots=[("packages", tmp_path)], keep=lambda path: not path.startswith("beta/"))
    assert {r["package"] for r in no_beta} == {"alpha"}
    assert long[1] in texts and long[1] not in [r["text"] for r in no_beta]  # also in a refused file: left out


def test_half_of_the_sources_is_held_out_of_the_broad_text_by_name():
    names = [f"package-{i}" for i in range(4000)]
    share = sum(map(held_out, names)) / len(names)
    assert 0.47 < share < 0.53 and held_out("ls.1.gz") == held_out("ls.1.gz")  # fixed by the name, not by chance
    assert [held_out(n) for n in names[:50]] == [held_out(n) for n in names[:50]]


def _man_page(folder, name, text, section="1"):
    folder.mkdir(parents=True, exist_ok=True)
    page = (f'.TH {name.upper()} {section}\n.SH NAME\n{name} \\- {text}\n.SH DESCRIPTION\n.B {name}\n'
            f'reads the files it is given and writes what they say.\n.PP\nA second paragraph left out.\n')
    (folder / f"{name}.{section}.gz").write_bytes(gzip.compress(page.encode()))


def test_man_records_read_the_name_and_first_description_paragraph_of_pages_not_held_out(tmp_path):
    pages = [f"tool{i}" for i in range(40)]
    for name in pages:
        _man_page(tmp_path / "man1", name, f"print the {name} report of a directory")
    _man_page(tmp_path / "man5", "conf", "format of the settings file", "5")
    (tmp_path / "man1" / "link.1.gz").symlink_to(tmp_path / "man1" / "tool0.1.gz")
    (tmp_path / "man1" / "redirect.1.gz").write_bytes(gzip.compress(b".so man1/tool0.1\n"))
    every = list(man_pages(tmp_path))
    assert [(p, s) for p, s, _ in every] == sorted([(f"{n}.1.gz", "1") for n in pages]) + [("conf.5.gz", "5")]
    text = dict((p, t) for p, _, t in every)["tool3.1.gz"]
    assert text == "tool3 print the tool3 report of a directory. tool3 reads the files it is given and writes what " \
                   "they say."
    recs = man_records(root=tmp_path)
    kept = {r["page"] for r in recs}
    assert kept == {p for p, _, _ in every if not held_out(p)} and len(kept) < len(every)
    assert all(r["source"] == "man" and r["section"] in {"1", "5"} for r in recs)
    capped = man_records(max_texts=4, root=tmp_path)
    assert len(capped) == 4 and {r["section"] for r in capped} == {"1", "5"}  # spread over the sections
    assert man_records(root=tmp_path / "none") == []  # a machine without man pages


DUMP = """Package: {name}
Section: {section}
Description: {short}
 A long description
 in two lines.
 .
 A second paragraph.

"""


def test_apt_records_take_the_synopses_of_packages_not_held_out_spread_over_the_sections():
    dump = "".join(DUMP.format(name=f"pkg{i}", section="universe/games" if i % 3 else "sound",
                               short=f"game number {i} for everyone") for i in range(60))
    parsed = list(parse_dumpavail(dump))
    assert parsed[1] == ("pkg1", "games", "game number 1 for everyone", "A long description\nin two lines.")
    recs = apt_records(packages=parsed)
    assert {r["package"] for r in recs} == {p for p, *_ in parsed if not held_out(p)}
    assert recs[0]["text"].endswith(". A long description in two lines.") and recs[0]["source"] == "apt"
    capped = apt_records(max_texts=6, packages=parsed)
    assert len(capped) == 6 and {r["section"] for r in capped} == {"games", "sound"}


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
    assert set(cbm["classes"]) == {"animals", "food", "weather"} and "240 texts" in done.summary[0]


def test_the_broad_texts_are_datasets_cache_reads_keyed_by_the_installed_packages(monkeypatch):
    from conceptdict.activations import broad
    from conceptdict.activations.data import describe_dataset, iter_records

    one = [{"text": "one text", "source": "stdlib", "package": "os"}]
    two = [*one, {"text": "a man page", "source": "man", "section": "1", "page": "ls.1.gz"}]
    monkeypatch.setattr(broad, "docstring_records", lambda: one)
    monkeypatch.setattr(broad, "broad_texts", lambda: two)
    assert list(iter_records("broad-docstrings")) == one and list(iter_records("broad-text")) == two
    assert describe_dataset("broad-text")["environment"] == describe_dataset("broad-docstrings")["environment"]
    desc = describe_dataset("broad-text")
    assert desc["kind"] == "builtin" and desc["environment"] == broad.environment_key()
    monkeypatch.setattr(broad.importlib.metadata, "distributions", lambda: [])  # another set of packages
    assert broad.environment_key() != desc["environment"]


def test_an_interrupted_build_goes_on_from_its_store_and_checkpoint_and_a_second_builder_waits(
        broad_settings, monkeypatch, caplog):
    from conceptdict.activations import lock

    first = cd.broad_dictionary(**broad_settings)
    shards = {p: p.stat().st_mtime_ns for p in first.store.glob("*.safetensors")}
    (first.root / "broad.json").unlink()  # killed after training, before the end of the build
    real, calls = lock._acquire, []

    def held_once(path, what):  # another process holds the build's lock at the first try
        calls.append(what)
        if len(calls) == 1:
            raise lock.StoreLocked(f"{path.parent} is being written by pid 1")
        return real(path, what)

    monkeypatch.setattr(lock, "_acquire", held_once)
    monkeypatch.setattr(lock.time, "sleep", lambda s: None)
    with caplog.at_level("WARNING"):
        again = cd.broad_dictionary(**broad_settings)
    assert calls[:2] == ["broad dictionary", "broad dictionary"] and "waiting for it to finish" in caplog.text
    assert again.built and again.info["steps"] == first.info["steps"] and shards  # the store was not cached again
    assert {p: p.stat().st_mtime_ns for p in first.store.glob("*.safetensors")} == shards
    assert again.info["heldout_fvu"] == pytest.approx(first.info["heldout_fvu"], abs=1e-6)
