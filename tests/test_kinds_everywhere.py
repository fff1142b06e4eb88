"""A kind's name is written once, in its module: the SAELens mapping follows the registry (``saes.kinds.KINDS``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conceptdict import saes
from conceptdict.saes import SparseCoder, open_dictionary
from conceptdict.saes.formats import saelens
from conceptdict.saes.kinds import KINDS

pytestmark = pytest.mark.unit

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
