"""`conceptdict steer` and the steerability scorer: latent interventions that keep the error term, name
resolution errors, a tiny causal LM (continuations, token log-prob shifts) and a tiny sentence encoder (cosine to
texts against random directions of the same norm)."""

from __future__ import annotations

import json

import pytest
import torch

from conceptdict.cli.main import main
from conceptdict.naming.interventions.steer import latent_edit, resolve_latents

D = 32


def _coder(W_dec: torch.Tensor):
    from conceptdict.saes import SparseCoder

    model = SparseCoder(W_dec.shape[1], W_dec.shape[0], 2, kind="topk")
    with torch.no_grad():
        model.W_dec.copy_(W_dec)
        model.W_enc.copy_(W_dec.T)
    return model


@pytest.mark.unit
def test_interventions_change_only_the_chosen_latent():
    g = torch.Generator().manual_seed(0)
    W = torch.nn.functional.normalize(torch.randn(8, D, generator=g), dim=1)
    sae = _coder(W)
    x = torch.randn(5, D, generator=g)
    f = sae.encode(x)
    assert torch.allclose(latent_edit(sae, [3], "add", 2.0)(x), x + 2.0 * W[3])
    assert torch.allclose(latent_edit(sae, [3], "clamp", 1.5)(x), x + (1.5 - f[:, 3:4]) * W[3], atol=1e-6)
    ablated = latent_edit(sae, [3, 5], "ablate", 0.0)(x)
    assert torch.allclose(ablated, x - f[:, [3, 5]] @ W[[3, 5]], atol=1e-6)
    # x' = x_hat(f') + (x - x_hat(f)): the dictionary's error term is kept
    f_new = f.clone()
    f_new[:, [3, 5]] = 0
    assert torch.allclose(ablated, sae.decode(f_new) + (x - sae.decode(f)), atol=1e-5)


@pytest.mark.unit
def test_latent_names_resolve_or_list_the_candidates():
    names = ["river", "music", "music", "stone"]
    assert resolve_latents(["3", "river"], names, 4) == [3, 0]
    with pytest.raises(ValueError, match=r"matches 2 latents \(1, 2\)"):
        resolve_latents(["music"], names, 4)
    with pytest.raises(ValueError, match="matches no latent; closest names: river"):
        resolve_latents(["rivers"], names, 4)
    with pytest.raises(ValueError, match="out of range"):
        resolve_latents(["9"], names, 4)


def _lm_dictionary(tmp_path, tiny_lm_dir, token: str = "cat"):
    """A dictionary at blocks.1.hook_out whose latent 0 is the unembedding direction of ``token``."""
    from conceptdict.activations import load_model
    from conceptdict.saes import save_dictionary

    lm = load_model(str(tiny_lm_dir))
    tid = lm.tokenizer(token, add_special_tokens=False)["input_ids"][0]
    W = torch.nn.functional.normalize(torch.randn(6, D, generator=torch.Generator().manual_seed(1)), dim=1)
    W[0] = torch.nn.functional.normalize(lm.unembed()[:, tid], dim=0)
    sae = save_dictionary(_coder(W), tmp_path / "sae", extra={"hookpoints": ["blocks.1.hook_out"],
                                                               "model": {"source": str(tiny_lm_dir)}})
    return lm, sae


@pytest.mark.integration
def test_steer_a_causal_lm(tmp_path, tiny_lm_dir, capsys):
    _, sae = _lm_dictionary(tmp_path, tiny_lm_dir)
    common = ["steer", str(sae), "--latent", "0", "--prompt", "the dog and the", "--prompt", "rain in the",
              "--token", "cat", "--max-new-tokens", "4"]
    assert main([*common, "--alpha", "0", "--out", str(tmp_path / "zero")]) == 0
    assert main([*common, "--alpha", "30", "--out", str(tmp_path / "big")]) == 0
    printed = capsys.readouterr().out
    zero = json.loads((tmp_path / "zero" / "steer.json").read_text())
    big = json.loads((tmp_path / "big" / "steer.json").read_text())
    for p in zero["prompts"]:
        assert p["greedy_before"] == p["greedy_after"] and p["sampled_before"] == p["sampled_after"]
        assert p["tokens"]["cat"]["shift"] == pytest.approx(0, abs=1e-5)
    assert big["mean_token_shift"]["cat"] > 0.1  # random-init weights: logits are small
    assert any(p["greedy_before"] != p["greedy_after"] for p in big["prompts"])
    assert (tmp_path / "big" / "steer.html").exists() and "log-prob shift of 'cat'" in printed


@pytest.mark.integration
def test_steer_a_sentence_encoder_beats_random_directions(tmp_path, tiny_bert_dir, capsys):
    from conceptdict.activations import embed_texts, load_model
    from conceptdict.saes import save_dictionary

    model = load_model(str(tiny_bert_dir))
    hp = "sentence.mean_normalized"
    prompts = ["rain and snow today", "bread and milk"]
    goal = embed_texts(model, ["cat dog bird horse lion"], hp)[0]
    W = torch.nn.functional.normalize(torch.randn(6, D, generator=torch.Generator().manual_seed(2)), dim=1)
    W[0] = torch.nn.functional.normalize(goal - embed_texts(model, prompts, hp).mean(0), dim=0)
    sae = save_dictionary(_coder(W), tmp_path / "sae",
                          extra={"hookpoints": [hp], "model": {"source": str(tiny_bert_dir)}})
    rc = main(["steer", str(sae), "--latent", "0", "--alpha", "0.05", "--prompt", prompts[0], "--prompt", prompts[1],
               "--text", "cat dog bird horse lion", "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "out" / "steer.json").read_text())
    assert doc["mean_cos_shift"] > 0 and doc["ratio"] > 1
    assert len(doc["random_cos_shifts"]) == 8


@pytest.mark.integration
def test_steerability_scores_on_both_model_kinds(tmp_path, tiny_lm_dir, tiny_bert_dir):
    from conceptdict.activations import embed_texts, load_model
    from conceptdict.naming.interventions.steerability import steerability

    lm, sae_dir = _lm_dictionary(tmp_path, tiny_lm_dir)
    from conceptdict.saes import load_dictionary

    texts = ["the dog and the", "rain in the morning", "bread and milk for the"]
    scores = steerability(load_dictionary(sae_dir), lm, "blocks.1.hook_out", [0, 1], ["cat", "river"], texts,
                          alphas=(5.0, 10.0), n_random=3)
    cat = scores[0]
    assert set(cat) >= {"effect_per_alpha", "name_effect_per_alpha", "damage", "random_effect_per_alpha", "ratio"}
    assert cat["name_effect_per_alpha"] > 0 and cat["effect_per_alpha"] > 0 and cat["damage"] > 0
    assert cat["ratio"] > 1

    enc = load_model(str(tiny_bert_dir))
    hp = "sentence.mean_normalized"
    prompts = ["rain and snow", "bread and milk"]
    goal = embed_texts(enc, ["cat dog bird horse lion"], hp)[0]
    W = torch.nn.functional.normalize(torch.randn(4, D, generator=torch.Generator().manual_seed(3)), dim=1)
    W[0] = torch.nn.functional.normalize(goal - embed_texts(enc, prompts, hp).mean(0), dim=0)
    scores = steerability(_coder(W), enc, hp, [0], ["cat dog bird horse lion"], prompts, alphas=(0.025, 0.05),
                          n_random=4)
    assert scores[0]["effect_per_alpha"] > scores[0]["random_effect_per_alpha"] > 0
    assert 0 < scores[0]["damage"] < 1


@pytest.mark.integration
def test_the_steering_scorer_stores_steerability_with_a_headline_score(tmp_path, tiny_lm_dir):
    """`conceptdict score --scorer steering`: steerability's metrics per latent and score = ratio / (1 + ratio),
    over the run's base examples (issue 15's intervention scorer, registered by naming.score_run)."""
    import math

    from conceptdict.naming import score_run  # noqa: F401  (registers the scorers)
    from conceptdict.naming.concepts import Concept, ConceptDictionary, Example
    from conceptdict.naming.negatives import NegativeConfig
    from conceptdict.naming.pipeline import Sources
    from conceptdict.naming.scoring import ScoreConfig, ScoringContext, get_scorer
    from conceptdict.naming.interventions.steering_scorer import headline
    from conceptdict.saes import load_dictionary

    _, sae_dir = _lm_dictionary(tmp_path, tiny_lm_dir)
    sae = load_dictionary(sae_dir)
    texts = ["the dog and the", "rain in the morning", "bread and milk for the"]
    base = tuple(Example(i, 0.0, tuple(t.split()), -1, t) for i, t in enumerate(texts))
    cd = ConceptDictionary(tuple(Concept(j, n, 0.0) for j, n in enumerate(["cat", "river"])), sae.W_dec[:2].detach())
    ctx = ScoringContext(cd, {}, ScoreConfig(negatives=NegativeConfig()), embed=None,
                         sources=Sources(sae, None, "blocks.1.hook_out", {}),
                         options={"model": str(tiny_lm_dir), "base_examples": base, "steering_alphas": (5.0, 10.0)})
    got = get_scorer("steering")(ctx, {0: "cat", 1: "river"})
    cat = got[0]
    assert cat["texts"] == 3 and cat["ratio"] > 1 and cat["score"] == pytest.approx(cat["ratio"] / (1 + cat["ratio"]))
    assert cat["score"] > 0.5 and {"effect_per_alpha", "damage", "random_effect_per_alpha"} <= set(cat)
    assert headline(-2.0) == 0.0 and headline(math.nan) == 0.0 and headline(1.0) == 0.5
