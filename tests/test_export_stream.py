"""``export --format json|html|neuronpedia`` of a concept dictionary read a block of concepts at a time
(api/export_formats.py over naming.concepts_file.ConceptsFile): the files the whole dictionary's path writes, byte
for byte, without reading concepts.json whole; a damaged concepts.json is reported with its path and the fix."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import shutil
from functools import partial

import pytest
import torch
from conceptdict.cli.main import main
from conceptdict.concept_api import ExportConfig
from conceptdict.naming import concepts_file
from conceptdict.naming.bottleneck.cbm import CbmConfig, load_cbm, save_cbm, train_cbm
from conceptdict.naming.concepts import load_concepts, save_concepts
from conceptdict.naming.concepts_file import ConceptsFile
from conceptdict.naming.reports import neuronpedia
from conceptdict.naming.reports.neuronpedia import (
    ContextValues,
    GzipLines,
    NeuronpediaConfig,
    logit_tables,
    write_neuronpedia,
    write_neuronpedia_blocks,
)
from conceptdict.naming.reports.report import write_report

pytestmark = pytest.mark.unit

N = 40
"""Latents of the concept dictionary: read in blocks of 7, the last one of 5."""


def _files(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def named(tiny_lm_store, tmp_path_factory):
    """A concept dictionary of 40 latents named by the logit lens over the tiny LM's token store (so that Neuronpedia's
    export has logit tables and contexts of several tokens), a third of them scored by two namers, and a CBM
    fitted on it: (its folder, the CBM's folder)."""
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import SparseCoder, save_dictionary

    store_dir, model_dir = tiny_lm_store
    tmp = tmp_path_factory.mktemp("export_stream")
    torch.manual_seed(0)
    model = SparseCoder(ActivationStore(store_dir).d_in("blocks.1.hook_out"), N, 3, kind="topk")
    sae = save_dictionary(model, tmp / "sae", extra={"stores": [str(store_dir)], "hookpoints": ["blocks.1.hook_out"]})
    assert main(["name", str(sae), "--namer", "logit-lens", "--model", str(model_dir), "--top-k", "4",
                 "--out", str(tmp / "named")]) == 0  # fmt: skip
    cd = load_concepts(tmp / "named")
    scored = [dataclasses.replace(c, scores={"embedding": {"score": 0.5 + 0.01 * c.id, "negatives": "random"}},
                                  names={"logit-lens": {"name": c.name, "score": c.score},
                                         "other": {"name": f"other {c.id}", "score": 0.2}},
                                  confidence=(c.id % 10) / 10) if c.id % 3 == 0 else c for c in cd.concepts]
    meta = {**cd.meta, "scoring": {"scorers": ["embedding"], "namers": ["logit-lens", "other"],
                                   "negatives": {"kinds": "random"}}}
    save_concepts(dataclasses.replace(cd, concepts=tuple(scored), meta=meta), tmp / "concepts")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(60, N, generator=gen)
    y = torch.randint(0, 2, (60,), generator=gen)
    x[:, 3] += y
    save_cbm(train_cbm(x, ["yes" if v else "no" for v in y.tolist()], cd.names, CbmConfig(lambdas=[0.01]), raw=x),
             tmp / "cbm")
    return tmp / "concepts", tmp / "cbm"


def _sources_and_logits(meta):
    """What export_neuronpedia opens for a concept dictionary of ``meta``: its dictionary and store, and the logit
    tables of the tiny LM's unembedding."""
    from conceptdict.activations import load_model
    from conceptdict.naming.pipeline import open_sources

    lm = load_model(str(meta["model"]))
    return (open_sources(meta["sae_dir"], meta.get("store"), meta.get("hookpoint")),
            partial(logit_tables, unembed=lm.unembed(), decode=lm.decode))


def _whole(fmt, source, out, cbm):
    """The whole dictionary's path: load_concepts, then the writer of every concept at once."""
    cd = load_concepts(source)
    if fmt == "json":
        save_concepts(cd, out)
    elif fmt == "html":
        write_report(cd, out, cbm=load_cbm(cbm), per_page=6)
    else:
        write_neuronpedia(cd, out, NeuronpediaConfig(), *_sources_and_logits(cd.meta))


@pytest.fixture
def contexts_alone(monkeypatch):
    """Neuronpedia's export encodes each example's context alone (ContextValues' batches of one context): the
    values do not depend on which contexts a batch held, so an export in blocks is byte for byte the whole one's."""
    monkeypatch.setattr(neuronpedia, "BATCH_ROWS", 1)


@pytest.mark.usefixtures("contexts_alone")
@pytest.mark.parametrize("fmt", ["json", "html", "neuronpedia"])
def test_an_export_read_in_blocks_writes_the_whole_dictionarys_files(named, tmp_path, monkeypatch, fmt):
    """40 concepts read in blocks of 7 (the last of 5), concepts.json 64 characters at a time: every file is the one
    the whole dictionary's path writes (json: save_concepts; html with a CBM and the score pages, 6 cards a page:
    write_report; neuronpedia with logit tables: write_neuronpedia of the loaded dictionary)."""
    from conceptdict import export_formats

    source, cbm = named
    _whole(fmt, source, tmp_path / "whole", cbm)
    sizes = []
    read = ConceptsFile.concepts

    def counted(self, size):
        for block in read(self, size):
            sizes.append(len(block))
            yield block

    monkeypatch.setattr(ConceptsFile, "concepts", counted)
    monkeypatch.setattr(concepts_file, "CHUNK", 64)
    cfg = ExportConfig(out=tmp_path / "blocks", format=fmt, cbm=cbm if fmt == "html" else None, per_page=6)
    write = getattr(export_formats, f"write_{fmt}")
    assert export_formats.CONCEPT_FORMATS[fmt].write is write  # what `conceptdict export --format FMT` calls
    written = write(source, cfg, block=7)
    assert sizes[-6:] == [7, 7, 7, 7, 7, 5]
    got, want = _files(tmp_path / "blocks"), _files(tmp_path / "whole")
    assert sorted(got) == sorted(want) and len(want) >= 2
    assert [n for n in want if got[n] != want[n]] == []
    if fmt == "html":
        assert {"cbm.html", "scores.html", "scores-by-embedding.html", "concepts-7.html"} <= set(got)
        assert written == tmp_path / "blocks" / "index.html"
    if fmt == "neuronpedia":
        features = [json.loads(line) for line in gzip.decompress(got[next(n for n in got if "features" in n)])
                    .splitlines()]  # fmt: skip
        assert len(features) == N and all(len(f["pos_str"]) == 10 for f in features)


@pytest.mark.parametrize("fmt", ["json", "html", "neuronpedia"])
def test_the_export_command_never_reads_the_concepts_whole(named, tmp_path, monkeypatch, fmt, capsys):
    """``conceptdict export --format FMT`` with ``load_concepts`` made to fail and ``json.loads`` refusing a text as
    long as concepts.json: it exits 0 and writes the files of the whole dictionary's path."""
    from conceptdict import naming
    from conceptdict.naming import concepts

    source, cbm = named
    _whole(fmt, source, tmp_path / "whole", cbm)
    whole_size = (source / "concepts.json").stat().st_size
    loads = json.loads

    def whole_read(directory, *_, **__):
        raise AssertionError(f"{directory} was read whole")

    def small_loads(text, *args, **kwargs):
        assert len(text) < whole_size / 4, "concepts.json was parsed whole"
        return loads(text, *args, **kwargs)

    for module in (concepts, naming):
        monkeypatch.setattr(module, "load_concepts", whole_read)
    monkeypatch.setattr(json, "loads", small_loads)
    extra = ["--cbm", str(cbm), "--per-page", "6"] if fmt == "html" else []
    assert main(["export", str(source), "--format", fmt, "--out", str(tmp_path / "cli"), *extra]) == 0, \
        capsys.readouterr().err
    got, want = _files(tmp_path / "cli"), _files(tmp_path / "whole")
    assert [n for n in want if got.get(n) != want[n]] == []


def _truncated(text: str) -> str:
    return text[: len(text) // 2]


def _unnamed_record(text: str) -> str:
    doc = json.loads(text)
    del doc["concepts"][9]["name"]
    return json.dumps(doc, indent=1)


def _short(text: str) -> str:
    doc = json.loads(text)
    doc["concepts"] = doc["concepts"][:-1]
    return json.dumps(doc, indent=1)


@pytest.mark.parametrize("fmt", ["json", "html", "neuronpedia"])
@pytest.mark.parametrize("damage, says", [(_truncated, "is not valid JSON"),
                                          (_unnamed_record, "concept record 9 is damaged"),
                                          (_short, "holds 39 concepts but says n_concepts=40")])
def test_a_damaged_concepts_json_is_reported_with_its_path_and_the_fix(named, tmp_path, capsys, fmt, damage, says):
    """A concepts.json cut in half, with a record that lost its name, or one record short: the export exits 1 with
    one line naming the file, what is wrong and the fix, and leaves none of the format's files behind."""
    source, _ = named
    shutil.copytree(source, tmp_path / "damaged")
    path = tmp_path / "damaged" / "concepts.json"
    path.write_text(damage(path.read_text()))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "damaged"), "--format", fmt, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and says in err and "re-run `conceptdict name`" in err, err
    left = _files(tmp_path / "out") if (tmp_path / "out").exists() else {}
    assert [n for n in left if n.endswith((".json", ".safetensors", ".html", ".gz", ".jsonl", ".part", ".tmp"))] \
        == []


def test_gzip_lines_are_gzip_compress_of_the_whole_text(tmp_path):
    """GzipLines fed one record at a time writes the bytes gzip.compress(level 5, mtime 0) gives of every line."""
    rng = random.Random(0)
    rows = [{"i": i, "v": [rng.random() for _ in range(rng.randrange(50))], "s": "é" * rng.randrange(30)}
            for i in range(3000)]
    out = GzipLines(tmp_path / "a" / "rows.jsonl.gz")
    for row in rows:
        out.write(row)
    out.close()
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    assert (tmp_path / "a" / "rows.jsonl.gz").read_bytes() == gzip.compress(data, compresslevel=5, mtime=0)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["rows.jsonl.gz"]


def test_context_values_are_each_contexts_own_encoding(named, monkeypatch):
    """ContextValues keeps each context's codes once encoded (emptied when it holds MEMO of them): every example's
    tokens and values are those of encoding its context's rows for it alone, bit for bit, the memo full or not."""
    from conceptdict.naming.pipeline import open_sources

    source, _ = named
    cd = load_concepts(source)
    sources = open_sources(cd.meta["sae_dir"], cd.meta.get("store"), cd.meta.get("hookpoint"))
    store, sae, hp = sources.store, sources.model, sources.hookpoint
    examples = [(c.id, e.row) for c in cd.concepts for e in c.top_examples]
    assert len({r for _, r in examples}) < len(examples), "latents share rows: the memo is read"
    for memo in (neuronpedia.MEMO, 50):
        monkeypatch.setattr(neuronpedia, "MEMO", memo)
        values = ContextValues(sources)
        for latent, row in examples:
            ctx = store.row_context(row, before=8, after=4)
            lo = row - ctx.marked
            with torch.no_grad():
                want = sae.encode(store.rows(hp, lo, lo + len(ctx.tokens)).float())[:, latent].tolist()
            got = values(latent, row)
            assert got == (list(ctx.tokens), want) and [str(v) for v in got[1]] == [str(v) for v in want]
        assert values.held <= memo


def test_batched_contexts_are_each_contexts_own_encoding_in_a_few_calls(named, tmp_path, monkeypatch):
    """The export encodes the contexts of several concepts' examples in one call (ContextValues.prefetch), a batch of
    at most BATCH_ROWS store rows: every activation record has the tokens and, within float32 rounding, the values
    of the export that encodes each context alone, from far fewer encode calls (one pass over a dictionary read a
    block at a time per call), and no batch holds more rows than allowed."""
    source, _ = named
    cd = load_concepts(source)
    sources, logits = _sources_and_logits(cd.meta)
    encode, calls = sources.model.encode, []

    def counted(x):
        calls.append(len(x))
        return encode(x)

    monkeypatch.setattr(sources.model, "encode", counted)
    runs = {}
    for rows in (1, 64, neuronpedia.BATCH_ROWS):
        monkeypatch.setattr(neuronpedia, "BATCH_ROWS", rows)
        calls.clear()
        out = write_neuronpedia(cd, tmp_path / str(rows), NeuronpediaConfig(model_id="m"), sources, logits)
        records = [json.loads(line) for line in gzip.decompress((out / "activations" / "batch-0.jsonl.gz")
                                                                .read_bytes()).splitlines()]  # fmt: skip
        runs[rows] = (records, list(calls))
    alone, alone_calls = runs[1]
    contexts = len({r["dataIndex"] for r in alone})
    assert len(alone_calls) == contexts > 40 and max(alone_calls) <= 13
    for rows in (64, neuronpedia.BATCH_ROWS):
        records, batch_calls = runs[rows]
        assert len(batch_calls) < contexts / 4 and max(batch_calls) <= max(rows, 13)
        assert [(r["id"], r["tokens"], r["maxValueTokenIndex"]) for r in records] == \
            [(r["id"], r["tokens"], r["maxValueTokenIndex"]) for r in alone]
        got = torch.tensor([v for r in records for v in r["values"]])
        want = torch.tensor([v for r in alone for v in r["values"]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(runs[neuronpedia.BATCH_ROWS][1]) == 1  # 40 concepts' contexts fit one batch


@pytest.mark.usefixtures("contexts_alone")
def test_logit_tables_of_each_block_are_the_whole_dictionarys(named, tmp_path):
    """write_neuronpedia_blocks over blocks of 7 with a block's logit tables computed from its directions writes what
    write_neuronpedia of the whole dictionary writes (the tables of every direction at once)."""
    source, _ = named
    cd = load_concepts(source)
    sources, logits = _sources_and_logits(cd.meta)
    write_neuronpedia(cd, tmp_path / "whole", NeuronpediaConfig(model_id="m"), sources, logits)
    blocks = [(cd.concepts[a: a + 7], cd.directions[a: a + 7]) for a in range(0, N, 7)]
    write_neuronpedia_blocks(cd.meta, N, blocks, tmp_path / "blocks", NeuronpediaConfig(model_id="m"), sources, logits)
    assert _files(tmp_path / "blocks") == _files(tmp_path / "whole")
