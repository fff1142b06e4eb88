"""The export formats come from their tables (``saes.formats.export.WRITERS`` for a dictionary's layouts,
``conceptdict.export_formats.CONCEPT_FORMATS`` for a concept dictionary's): a format added there, and nowhere
else, is written by ``cd.export`` and ``conceptdict export``, listed in its help, and an unknown one is refused."""

from __future__ import annotations

from pathlib import Path

import conceptdict as cd
import pytest
import torch
from conceptdict.cli.main import main
from conceptdict.export_formats import CONCEPT_FORMATS, export_formats
from conceptdict.naming import Concept, ConceptDictionary, save_concepts
from conceptdict.saes import SparseCoder, save_dictionary
from conceptdict.saes.formats.export import WRITERS
from conceptdict.settings import ConfigError
from fixtures_docs import table_names
from fixtures_export import NAMES_FILE, NAMES_FORMAT, STATE_FILE, STATE_LAYOUT

pytestmark = pytest.mark.unit

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "foreign-dictionaries.md"


@pytest.fixture
def example_formats(monkeypatch):
    """The example layout and concept format of tests/fixtures_export.py, each one line of its table."""
    monkeypatch.setitem(WRITERS, "torch-state", STATE_LAYOUT)
    monkeypatch.setitem(CONCEPT_FORMATS, "names-txt", NAMES_FORMAT)


@pytest.fixture
def sae(tmp_path) -> Path:
    m = SparseCoder(12, 20, 3, "topk")
    m.reset_parameters(torch.Generator().manual_seed(0))
    return save_dictionary(m, tmp_path / "sae", extra={"hookpoints": ["blocks.0.hook_out"],
                                                       "model": {"id": "tiny-gpt2"}})


@pytest.fixture
def concepts(tmp_path, sae) -> Path:
    names = ["cat", "river", "", "tax"] + [f"c{i}" for i in range(16)]
    cdict = ConceptDictionary(tuple(Concept(i, n, 0.5) for i, n in enumerate(names)), torch.randn(20, 12),
                              {"sae_dir": str(sae), "hookpoint": "blocks.0.hook_out"})
    return save_concepts(cdict, tmp_path / "concepts")


def test_an_added_layout_is_written_by_the_api_and_the_command_line(example_formats, sae, tmp_path, capsys):
    written = cd.export(sae, format="torch-state", out=tmp_path / "api")
    saved = torch.load(written / STATE_FILE, weights_only=True)
    mine = cd.load(sae).state_dict()
    assert saved["kind"] == "topk" and saved["hookpoint"] == "blocks.0.hook_out"
    assert set(saved["state"]) == set(mine) and all(torch.equal(saved["state"][k], mine[k]) for k in mine)
    card = (tmp_path / "api" / "README.md").read_text()  # the model card every layout gets
    assert "library_name: torch" in card and "`conceptdict export --format torch-state`" in card
    assert "k = 3 per row" in card
    assert main(["export", str(sae), "--format", "torch-state", "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert f"torch-state dictionary: {tmp_path / 'cli'}" in out and "model card:" in out
    assert (tmp_path / "cli" / STATE_FILE).exists()


def test_an_added_concept_format_is_written_by_the_api_and_the_command_line(example_formats, concepts, sae,
                                                                            tmp_path, capsys):
    written = cd.export(concepts, format="names-txt", out=tmp_path / "api")
    assert written.read_text().splitlines()[:4] == ["cat", "river", "", "tax"]
    assert main(["export", str(concepts), "--format", "names-txt", "--out", str(tmp_path / "cli")]) == 0
    assert f"names: {tmp_path / 'cli' / NAMES_FILE}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="not a concept dictionary.*--format names-txt writes.*torch-state"):
        cd.export(sae, format="names-txt", out=tmp_path / "bad")


def test_the_help_lists_every_format_with_its_description(example_formats, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, fmt in export_formats().items():
        assert f"{name} ({' '.join(fmt.description.split())})" in text, name
    assert "one concept name per line (a test format)" in text and "a torch.save of the state dict" in text


def test_an_unknown_format_is_refused_with_the_choices(concepts, tmp_path, capsys):
    # before the table, any other name wrote the HTML report
    with pytest.raises(ConfigError, match="unknown export format 'htm'; choose one of json, html, neuronpedia, "
                                          "saelens"):
        cd.export(concepts, format="htm", out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["export", str(concepts), "--format", "htm", "--out", str(tmp_path / "y")])
    assert "invalid choice: 'htm'" in capsys.readouterr().err


def test_the_guide_has_a_row_for_every_format():
    rows = table_names(GUIDE, "## Export to another library")
    formats = list(export_formats())
    assert sorted(rows) == sorted(formats), (
        f"docs/guide/foreign-dictionaries.md's --format table and the export formats differ: rows without a format "
        f"{sorted(set(rows) - set(formats))}, formats without a row {sorted(set(formats) - set(rows))}")
