"""``conceptdict score`` a block of concepts at a time (naming.score_run.score_in_place, naming.concepts_file): the
same concepts.json, concepts.safetensors and report as scoring the whole concept dictionary in memory, without
reading concepts.json whole."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conceptdict.cli.main import main
from conceptdict.naming import concepts_file
from conceptdict.naming.concepts import load_concepts, save_concepts
from conceptdict.naming.concepts_file import ConceptsFile
from conceptdict.naming.negatives import NegativeConfig
from conceptdict.naming.pipeline import NameConfig, Sources, name_dictionary
from conceptdict.naming.reports.report import write_report
from conceptdict.naming.score_run import prepare_context, score_concepts, score_in_place
from conceptdict.naming.scoring import ScoreConfig, TextEmbedder
from test_naming_cli import setup  # noqa: F401  (the module-scoped fixture)
from test_score_cli import planted_scorer  # noqa: F401  (the fixture)
from test_scoring import bag_of_words, planted

pytestmark = pytest.mark.unit


def _files(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kinds", ["random+hard", "hard"])
def test_scoring_a_block_at_a_time_writes_the_whole_scorings_files(tmp_path, monkeypatch, kinds):
    """40 latents scored in blocks of 7 (the last one shorter), concepts.json read 64 characters at a time, with
    similar-direction, shared-token and random negatives and the random-name control: every file is the one
    scoring the whole dictionary in memory writes (the negatives' draws, the controls drawn over every latent, the
    summary over every block, the score pages)."""
    store, coder = planted()
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=10))
    save_concepts(cd, tmp_path / "blocks")
    cfg = ScoreConfig(negatives=NegativeConfig(kinds=kinds, pool_rows=2000))
    sources = Sources(coder, store, "hp", {})
    whole = score_concepts(cd, cfg, prepare_context(cd, cfg, embed=TextEmbedder(bag_of_words), sources=sources))
    save_concepts(whole, tmp_path / "whole")
    write_report(whole, tmp_path / "whole" / "report")
    monkeypatch.setattr(concepts_file, "CHUNK", 64)
    summary = score_in_place(tmp_path / "blocks", cfg, embed=TextEmbedder(bag_of_words), sources=sources, block=7)
    assert summary.n_concepts == 40 and summary.meta["scoring"] == whole.meta["scoring"]
    got, want = _files(tmp_path / "blocks"), _files(tmp_path / "whole")
    assert sorted(got) == sorted(want) and "report/scores.html" in got
    assert [n for n in want if got[n] != want[n]] == []
    controls = [c.scores["embedding"].get("control_name") for c in whole.concepts if c.scores]
    assert len(set(controls)) > 7, "controls drawn over every latent, not within a block"


def test_each_namer_is_built_once_for_every_block(tmp_path, monkeypatch):
    """``--namer context`` over 40 latents in blocks of 7: the namer is built once (building one may load a model or
    embed a vocabulary), not once a block, and the files are the whole dictionary's scored in memory."""
    from conceptdict.naming import agreement

    store, coder = planted()
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=10))
    cd = dataclasses.replace(cd, meta={**cd.meta, "namer": "given"})  # so that --namer context names anew
    save_concepts(cd, tmp_path / "blocks")
    cfg = ScoreConfig(namers=("context",), negatives=NegativeConfig(kinds="random", pool_rows=2000))
    sources = Sources(coder, store, "hp", {})
    whole = score_concepts(cd, cfg, prepare_context(cd, cfg, embed=TextEmbedder(bag_of_words), sources=sources))
    save_concepts(whole, tmp_path / "whole")
    write_report(whole, tmp_path / "whole" / "report")
    builds = []
    real = agreement.build_namer
    monkeypatch.setattr(agreement, "build_namer", lambda *a, **k: builds.append(a[0].namer) or real(*a, **k))
    score_in_place(tmp_path / "blocks", cfg, embed=TextEmbedder(bag_of_words), sources=sources, block=7)
    assert builds == ["context"]
    got, want = _files(tmp_path / "blocks"), _files(tmp_path / "whole")
    assert [n for n in want if got.get(n) != want[n]] == []


def test_the_concepts_file_reads_any_layout_a_record_at_a_time(tmp_path, monkeypatch):
    """ConceptsFile's blocks are load_concepts' concepts and directions, from concepts.json as ``name`` writes it
    and from the same document with its meta after the concepts and no indentation."""
    store, coder = planted()
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=3))
    save_concepts(cd, tmp_path)
    monkeypatch.setattr(concepts_file, "CHUNK", 50)
    for layout in ("as written", "meta last"):
        if layout == "meta last":
            doc = json.loads((tmp_path / "concepts.json").read_text())
            doc = {"concepts": doc.pop("concepts"), **doc}
            (tmp_path / "concepts.json").write_text(json.dumps(doc))
        whole, file = load_concepts(tmp_path), ConceptsFile(tmp_path)
        assert file.meta == whole.meta and file.n_concepts == 40 and file.directions_shape == (40, 40)
        blocks = list(file.blocks(16))
        assert [len(c) for c, _ in blocks] == [16, 16, 8]
        assert [c for b, _ in blocks for c in b] == list(whole.concepts)
        assert torch.equal(torch.cat([d for _, d in blocks]), whole.directions)


def test_a_damaged_concepts_file_says_so(tmp_path):
    store, coder = planted()
    save_concepts(name_dictionary(coder, store, NameConfig(namer="context", top_k=3)), tmp_path)
    text = (tmp_path / "concepts.json").read_text()
    (tmp_path / "concepts.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not valid JSON.*re-run `conceptdict name`"):
        list(ConceptsFile(tmp_path).blocks(8))


def test_the_score_command_never_reads_the_concepts_whole(setup, planted_scorer, tmp_path, monkeypatch,  # noqa: F811
                                                          capsys):
    """``conceptdict score`` goes a block at a time: with ``load_concepts`` (the whole read) made to fail, it scores
    and writes the same concepts.json as ``cd.score`` (which reads the result back whole)."""
    import conceptdict as cd
    import conceptdict.concept_api as api

    tmp, sae = setup
    assert main(["name", str(sae), "--vocab", str(tmp / "words.txt"), "--model", "planted", "--cache-dir",
                 str(tmp / "cache"), "--out", str(tmp_path / "c"), "--top-k", "5"]) == 0  # fmt: skip
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    scored = cd.score(tmp_path / "d", scorer="planted", negatives={"kinds": "random"})

    def whole_read(directory):
        raise AssertionError(f"{directory} was read whole")

    monkeypatch.setattr(api, "load_concepts", whole_read)
    capsys.readouterr()
    assert main(["score", str(tmp_path / "c"), "--scorer", "planted", "--negatives.kinds", "random"]) == 0
    assert "scored 6 latents with planted" in capsys.readouterr().out
    assert (tmp_path / "c" / "concepts.json").read_text() == (tmp_path / "d" / "concepts.json").read_text()
    assert [c.scores["planted"]["score"] for c in scored.concepts[:6]] == [1.0] * 6
