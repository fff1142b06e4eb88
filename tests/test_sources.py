"""What a dictionary reads is resolved in one place (``naming.sources.open_run``) for every command after training:
the copies that ``eval`` and ``name`` each had drifted (a relative store path was found by one, not the other), and
objects the API returns are taken wherever their folder is (issue 51)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import conceptdict as cd

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dictionary and its store side by side in one folder, the store recorded by a path relative to the
    dictionary (as a user who moves both together, or writes config.json by hand, has it)."""
    root = tmp_path_factory.mktemp("moved") / "project"
    gen = torch.Generator().manual_seed(0)
    atoms = torch.randn(12, 8, generator=gen)
    x = (torch.rand(1024, 12, generator=gen) * (torch.rand(1024, 12, generator=gen) < 0.2)) @ atoms
    save_file({"hp": x.contiguous()}, str(root.parent / "rows.safetensors"))
    store = cd.import_array(root.parent / "rows.safetensors", out=root / "store", level="sequence")
    sae = cd.train(store, latents=16, k=3, batch_size=64, out=root / "sae", device="cpu")
    config = json.loads((root / "sae" / "config.json").read_text())
    config["stores"] = ["../store"]
    (root / "sae" / "config.json").write_text(json.dumps(config))
    return root, sae, store


def test_eval_and_name_find_a_store_recorded_relative_to_the_dictionary(trained, tmp_path, monkeypatch):
    root, _, _ = trained
    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved)
    monkeypatch.chdir(tmp_path)  # "../store" from here is not the store: only the dictionary's folder finds it
    ev = cd.evaluate(moved / "sae", contexts=0, out=tmp_path / "eval.json")
    assert ev.store.resolve() == (moved / "store").resolve() and ev.metrics.n_tokens > 0
    concepts = cd.name(moved / "sae", namer="context", device="cpu")
    assert len(concepts) == 16 and concepts.meta["store"].endswith("store")


def test_objects_are_taken_where_their_folders_are(trained, tmp_path):
    """A dictionary, store and concept dictionary the API returned go back in as they are; each remembers its
    folder (``.path``)."""
    root, sae, store = trained
    assert sae.path == root / "sae" and store.path == root / "store"
    ev = cd.evaluate(sae, store=store, contexts=0, out=tmp_path / "eval.json")
    assert ev.metrics.n_tokens > 0
    concepts = cd.name(sae, store=store, namer="context", out=tmp_path / "concepts")
    assert concepts.path == tmp_path / "concepts"
    written = cd.export(concepts, format="json", out=tmp_path / "json")  # a ConceptDictionary where its folder goes
    assert json.loads((written / "concepts.json").read_text())["concepts"][0]["name"] == concepts.names[0]


def test_a_dictionary_made_in_memory_works_where_no_file_is_read_and_says_so_where_one_is(trained, tmp_path):
    _, sae, store = trained
    fresh = cd.SparseCoder(sae.d_in, 16, 3)
    fresh.load_state_dict(sae.state_dict())
    ev = cd.evaluate(fresh, store=store, hookpoint="hp", rows_from="start", contexts=0, out=tmp_path / "e.json")
    assert ev.metrics.fvu == pytest.approx(cd.evaluate(sae, store=store, rows_from="start", contexts=0,
                                                       out=tmp_path / "f.json").metrics.fvu)
    with pytest.raises(cd.ConfigError, match="made in memory"):
        cd.export(fresh, format="saelens", out=tmp_path / "x")
