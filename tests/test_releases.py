"""Release names (`gpt2-small-res-jb/blocks.8.hook_resid_pre`): the pure mapping to hf:REPO/PATH over our own
short list and over sae-lens's directory when it is importable (a stand-in module here), and the whole path offline
through a fake Hugging Face cache (no network)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from test_foreign_formats import FIXTURES, _fake_hub_cache

from conceptdict.cli.main import main
from conceptdict.saes import FormatError, load_dictionary
from conceptdict.saes.formats import releases
from conceptdict.saes.formats.releases import RELEASES, Release, resolve


def _without_sae_lens(monkeypatch):
    for name in ("sae_lens", "sae_lens.loading", "sae_lens.loading.pretrained_saes_directory", "sae_lens.toolkit",
                 "sae_lens.toolkit.pretrained_saes_directory"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


@pytest.mark.unit
def test_release_names_map_to_hub_paths():
    assert resolve("gpt2-small-res-jb/blocks.8.hook_resid_pre", RELEASES) == \
        "hf:jbloom/GPT2-Small-SAEs-Reformatted/blocks.8.hook_resid_pre"
    assert resolve("gemma-2b-res-jb/blocks.6.hook_resid_post", RELEASES) == \
        "hf:jbloom/Gemma-2b-Residual-Stream-SAEs/gemma_2b_blocks.6.hook_resid_post_16384_anthropic_fast_lr"
    assert resolve("gemma-scope-2b-pt-res/layer_12/width_16k/average_l0_82", RELEASES) == \
        "hf:google/gemma-scope-2b-pt-res/layer_12/width_16k/average_l0_82"  # Gemma Scope: the id is the path
    assert resolve("r/whole", {"r": Release("o/repo", {"whole": "."})}) == "hf:o/repo"


@pytest.mark.unit
@pytest.mark.parametrize("name, message", [
    ("gpt2-small-res-jbb/blocks.8.hook_resid_pre", "closest releases: gpt2-small-res-jb"),
    ("gpt2-small-res-jb/blocks.8.hook_resid_pr",
     "has no SAE 'blocks.8.hook_resid_pr'; closest: blocks.8.hook_resid_pre"),
    ("gpt2-small-res-jb", "no SAE; write gpt2-small-res-jb/SAE_ID"),
    ("gemma-scope-2b-pt-res/layer_3", "ids of the form"),
])
def test_unknown_names_list_the_close_ones(name, message):
    with pytest.raises(FormatError, match=message) as info:
        resolve(name, RELEASES)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.unit
def test_sae_lens_directory_is_used_when_importable(monkeypatch):
    entry = types.SimpleNamespace(repo_id="someone/saes", saes_map={"blocks.2.hook_z": "layer2"}, model="m")
    fake = types.ModuleType("sae_lens.loading.pretrained_saes_directory")
    fake.get_pretrained_saes_directory = lambda: {"their-release": entry}
    monkeypatch.setitem(sys.modules, "sae_lens", types.ModuleType("sae_lens"))
    monkeypatch.setitem(sys.modules, "sae_lens.loading", types.ModuleType("sae_lens.loading"))
    monkeypatch.setitem(sys.modules, "sae_lens.loading.pretrained_saes_directory", fake)
    registry, where = releases.directory()
    assert where == "sae-lens's pretrained_saes.yaml" and list(registry) == ["their-release"]
    assert resolve("their-release/blocks.2.hook_z", registry) == "hf:someone/saes/layer2"
    _without_sae_lens(monkeypatch)  # not installed: our own list
    assert releases.directory()[0] is RELEASES


@pytest.mark.integration
def test_eval_a_release_name_from_the_hub_cache(tiny_lm_store, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    _without_sae_lens(monkeypatch)
    store, _ = tiny_lm_store
    cache = tmp_path / "hub"
    src = FIXTURES / "saelens-gated"
    _fake_hub_cache(cache, "jbloom/GPT2-Small-SAEs-Reformatted", "c" * 40,
                    {f"blocks.0.hook_resid_pre/{f.name}": f for f in src.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = load_dictionary("gpt2-small-res-jb/blocks.0.hook_resid_pre")
    assert torch.equal(model.W_dec, load_dictionary(src).W_dec)
    rc = main(["eval", "gpt2-small-res-jb/blocks.0.hook_resid_pre", "--store", str(store), "--contexts", "0",
               "--out", str(tmp_path / "eval.json")])
    assert rc == 0, capsys.readouterr()
    assert json.loads((tmp_path / "eval.json").read_text())["hookpoint"] == "blocks.0.hook_out"
    assert main(["eval", "gpt2-small-res-jb/blocks.1.hook_resid_pre", "--store", str(store), "--out",
                 str(tmp_path / "e.json")]) == 1
    assert "needs the network" in capsys.readouterr().err
    assert main(["eval", "gtp2-small-res-jb/blocks.0.hook_resid_pre", "--store", str(store), "--out",
                 str(tmp_path / "e.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "closest releases: gpt2-small-res-jb" in err[0], err
