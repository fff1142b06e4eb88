"""A kind's name is written once, in its module: ``--kind``'s help, the SAELens mapping and the guide's kind table
follow the registry (``saes.kinds.KINDS``)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conceptdict import saes
from conceptdict.saes import SparseCoder, open_dictionary
from conceptdict.saes.config import TrainConfig
from conceptdict.saes.formats import saelens
from conceptdict.saes.kinds import KINDS
from conceptdict.settings import field_help
from fixtures_docs import table_names

pytestmark = pytest.mark.unit

TRAIN_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "train.md"


def _named(text: str) -> list[str]:
    """The kinds a list in ``text`` names, variants expanded: ``crosscoder(-absolute, -l1)`` -> crosscoder,
    crosscoder-absolute, crosscoder-l1."""
    out = []
    for base, variants in re.findall(r"([a-z][a-z0-9-]*[a-z0-9])(?:\(([^)]*)\))?", text):
        out += [base] + [base + v.strip() for v in variants.split(",") if v.strip()]
    return out


def test_the_kind_help_names_every_registered_kind_once():
    (kind,) = [f for f in dataclasses.fields(TrainConfig) if f.name == "kind"]
    text = field_help(kind)
    assert "train.md): " in text and "; read only: " in text, text
    listed, read_only = text.split("train.md): ", 1)[1].split("; read only: ")
    assert _named(listed) == [name for name, spec in KINDS.items() if spec.trainable]
    assert _named(read_only) == [name for name, spec in KINDS.items() if not spec.trainable] == ["gated"]


def test_the_guide_has_a_row_for_every_kind_and_no_other():
    rows = table_names(TRAIN_GUIDE, "## Which kind should I use")
    assert len(rows) == len(set(rows)), f"a kind has two rows: {sorted({r for r in rows if rows.count(r) > 1})}"
    assert sorted(rows) == sorted(KINDS), (
        f"docs/guide/train.md's kind table and the registry differ: rows of no kind {sorted(set(rows) - set(KINDS))}, "
        f"kinds without a row {sorted(set(KINDS) - set(rows))}")


def test_the_saelens_mapping_is_the_registry():
    declared = {name: spec.saelens for name, spec in KINDS.items() if spec.saelens is not None}
    assert dict(saelens.KIND_TO_ARCH) == declared
    assert {name: saelens.exports_exactly(name) for name in KINDS} == {name: name in declared for name in KINDS}
    for arch, kind in saelens.ARCH_TO_KIND.items():  # what an architecture is read as, it is written as again
        assert KINDS[kind].saelens == arch, (arch, kind)


@pytest.fixture
def topk_copy():
    """A kind added at run time that declares a SAELens architecture: TopK under another name."""
    spec = saes.register(dataclasses.replace(saes.kind_spec("topk"), name="topk-copy", saelens="topk"))
    try:
        yield spec
    finally:
        saes.unregister(spec.name)


def test_a_registered_kind_exports_to_saelens_as_it_declares(topk_copy, tmp_path):
    assert saelens.exports_exactly("topk-copy") and saelens.KIND_TO_ARCH["topk-copy"] == "topk"
    m = SparseCoder(12, 20, 3, "topk-copy")
    m.reset_parameters(torch.Generator().manual_seed(0))
    saelens.write(m, tmp_path)
    cfg = json.loads((tmp_path / saelens.CONFIG).read_text())
    assert cfg["architecture"] == "topk" and cfg["k"] == 3 and cfg["metadata"]["conceptdict_kind"] == "topk-copy"
    back = open_dictionary(tmp_path).model  # read back as SAELens's topk: our topk, the same weights
    assert back.kind == "topk" and all(torch.equal(back.state_dict()[k], v) for k, v in m.state_dict().items())


def test_a_kind_without_a_saelens_architecture_is_refused_with_the_reason(tmp_path):
    for name, spec in KINDS.items():
        if spec.saelens is None and spec.sources == "one":
            with pytest.raises(ValueError, match=f"kind '{name}'.*has no SAELens equivalent"):
                saelens.write(SparseCoder(12, 20, 3, name), tmp_path / name)
    with pytest.raises(ValueError, match="row-relative"):
        saelens.write(SparseCoder(12, 20, 3, "matryoshka"), tmp_path / "m")
