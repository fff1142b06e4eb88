"""`conceptdict score` and `conceptdict show` (ranking, filters, score lines) on the planted CLI setup of
tests/test_naming_cli.py, with a scorer registered in-process (no sentence encoder needed)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_naming_cli import WORDS, setup  # noqa: F401  (the module-scoped fixture)

from conceptdict.cli.main import main
from conceptdict.naming.scoring import SCORERS, register_scorer

pytestmark = pytest.mark.integration


@pytest.fixture
def planted_scorer():
    def planted(ctx, names):  # 1 for the planted word of latent j, 0 otherwise
        return {j: {"score": float(n == WORDS[j]), "negatives": ctx.cfg.negatives.kinds} for j, n in names.items()}

    register_scorer("planted", planted)
    yield
    del SCORERS["planted"]


def test_score_then_show_ranks_and_filters(setup, planted_scorer, tmp_path, capsys):  # noqa: F811
    tmp, sae = setup
    assert main(["name", str(sae), "--vocab", str(tmp / "words.txt"), "--model", "planted", "--cache-dir",
                 str(tmp / "cache"), "--out", str(tmp_path / "c"), "--top-k", "5"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["score", str(tmp_path / "c"), "--scorer", "planted", "--negatives.kinds", "random"]) == 0
    out = capsys.readouterr().out
    assert "scored 6 latents with planted (negatives: random" in out and "planted" in out
    doc = json.loads((tmp_path / "c" / "concepts.json").read_text())
    assert [c["scores"]["planted"]["score"] for c in doc["concepts"]] == [1.0] * 6
    assert doc["meta"]["scoring"]["negatives"]["kinds"] == "random"
    assert (tmp_path / "c" / "report" / "scores-by-planted.html").exists()

    assert main(["show", str(tmp_path / "c"), "3"]) == 0
    text = capsys.readouterr().out
    assert "score:      planted 1.000" in text and "confidence: 1.000" in text and "namer:      vocab: 'green'" in text
    assert main(["show", str(tmp_path / "c"), "--sort", "planted", "--min-score", "0.5", "--limit", "2"]) == 0
    table = capsys.readouterr().out
    assert "6 concepts match (sorted by planted)" in table and len(table.strip().splitlines()) == 4
    assert main(["show", str(tmp_path / "c"), "--max-score", "0.5"]) == 0
    assert "0 concepts match" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "c"), "--sort", "fuzzing"]) == 1
    assert "not confidence or a scorer" in capsys.readouterr().err


def test_unknown_scorer_is_a_one_line_error_and_loses_nothing(setup, tmp_path, capsys):  # noqa: F811
    tmp, sae = setup
    assert main(["name", str(sae), "--vocab", str(tmp / "words.txt"), "--model", "planted", "--cache-dir",
                 str(tmp / "cache"), "--out", str(tmp_path / "c")]) == 0  # fmt: skip
    before = (tmp_path / "c" / "concepts.json").read_text()
    capsys.readouterr()
    assert main(["score", str(tmp_path / "c"), "--scorer", "nope"]) == 1
    assert "unknown scorer 'nope'" in capsys.readouterr().err
    assert (tmp_path / "c" / "concepts.json").read_text() == before
    shutil.rmtree(tmp_path / "c")
