"""CB-SAE (naming/bottleneck/cbsae.py, cbsae_run.py) on the planted token store of tests/test_scoring.py: the dictionary
knows words w00..w29 only; the user asks for w03 (present) and w35 (lacking)."""

from __future__ import annotations

import pytest
import torch
from test_naming_fakes import FakeCoder
from test_scoring import WORDS, bag_of_words, planted

from conceptdict.naming.bottleneck.cbsae import CbSae, CbSaeConfig, load_cbsae, prune_mask, save_cbsae, sim3
from conceptdict.naming.bottleneck.cbsae_run import build_cbsae, read_concept_list
from conceptdict.naming.negatives import NegativeConfig
from conceptdict.naming.pipeline import NameConfig, Sources, name_dictionary
from conceptdict.naming.score_run import prepare_context, score_concepts
from conceptdict.naming.scoring import ScoreConfig, TextEmbedder, auroc

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def scored():
    store, _ = planted(n_ctx=100)
    coder = FakeCoder(torch.eye(len(WORDS))[:30], k=1)
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=10))
    embed = TextEmbedder(bag_of_words)
    src = Sources(coder, store, "hp", {})
    cfg = ScoreConfig(negatives=NegativeConfig(pool_rows=2000))
    return score_concepts(cd, cfg, prepare_context(cd, cfg, embed=embed, sources=src)), src, embed


def test_sim3_is_one_for_monotone_cubes_and_bounded():
    a = torch.randn(50, 3)
    assert torch.allclose(sim3(a, 2 * a + 1), torch.ones(3), atol=1e-5)
    assert (sim3(a, torch.randn(50, 3)).abs() <= 1 + 1e-6).all()


def test_pruning_follows_the_scores_and_uses_steering_when_stored(scored):
    cd, _, _ = scored
    mask, how = prune_mask(cd, CbSaeConfig(min_interpretability=0.85))
    expect = [c.scores.get("embedding", {}).get("score", -1) >= 0.85 for c in cd.concepts]
    assert mask.tolist() == expect and 0 < sum(expect) < len(expect)
    assert "interpretability only" in how["note"]
    import dataclasses

    steered = dataclasses.replace(cd, concepts=tuple(
        dataclasses.replace(c, scores={**c.scores, "steering": {"score": 0.0 if c.id == 0 else 1.0}})
        for c in cd.concepts))  # fmt: skip
    m2, how2 = prune_mask(steered, CbSaeConfig(min_interpretability=0.0))
    assert not m2[0] and m2[1:].all() and how2["steerability"] == "steering" and how2["note"] is None


def test_lacking_concept_gets_a_bottleneck_latent_that_tracks_it(scored, tmp_path):
    cd, src, embed = scored
    cfg = CbSaeConfig(min_interpretability=0.6, steps=600, lr=5e-3, batch_size=128)
    model, new_cd, s = build_cbsae(cd, src, ["w03", "w35"], cfg, embed=embed)
    assert s["added"] == ["w35"] and s["present"] == {"w03": [3]}
    assert s["n_kept"] + s["n_pruned"] == 30 and model.n_latents == s["n_kept"] + 1
    assert s["fvu"]["after"] < s["fvu"]["pruned"]  # the bottleneck explains variance the pruned dictionary lost
    # supervision is the context window (13 tokens), the row knows only its own token: correlation is diluted,
    # but the bottleneck latent must pick out exactly the rows of word w35
    assert s["alignment_test"]["w35"]["pearson"] > 0.05
    x_all = src.store.rows("hp", 0, src.store.num_rows)
    is_w35 = x_all.argmax(1) == 35
    c = model.bottleneck(x_all)[:, 0].detach()
    assert auroc(c[is_w35], c[~is_w35]) > 0.95
    assert 0.01 < float((c > 0).float().mean()) < 0.3  # sparse: about fire_fraction of the rows
    assert new_cd.concepts[-1].name == "w35" and new_cd.concepts[-1].extra["bottleneck"]
    assert s["steerability"].startswith("not measured")  # no steering scores on the input: pruned on interpretability
    assert s["interpretability"]["after"]["n_latents"] == model.n_latents
    x = src.store.rows("hp", 0, 50)
    torch.testing.assert_close(model.encode(x)[:, : s["n_kept"]], src.model.encode(x)[:, model.keep])
    save_cbsae(model, tmp_path / "cb", tmp_path / "base-not-needed")
    assert (tmp_path / "cb" / "config.json").exists()


def test_fvu_is_measured_on_the_base_dictionarys_heldout_rows_and_no_line_says_none(scored, monkeypatch):
    from conceptdict.naming.bottleneck import cbsae_run

    cd, src, embed = scored
    n = src.store.num_rows
    held = torch.arange(0, n, 7)
    seen = {}
    real = cbsae_run.train_bottleneck

    def spy(x, *args, **kwargs):
        seen["rows"] = x.shape[0]
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cbsae_run, "train_bottleneck", spy)
    cfg = CbSaeConfig(min_interpretability=0.6, steps=50, lr=5e-3, batch_size=128)
    _, _, s = build_cbsae(cd, src, ["w35"], cfg, embed=embed, heldout=held)
    assert s["fvu"]["rows"] == f"the base dictionary's {len(held)} held-out rows"
    assert seen["rows"] == n - len(held)  # the bottleneck never trains on them
    lines = cbsae_run.summary_lines(s)
    assert not any("None" in ln for ln in lines), lines
    assert any(ln.startswith(f"FVU on the base dictionary's {len(held)} held-out rows:") for ln in lines)
    assert "CBM accuracy: not measured (pass --label-column COLUMN" in "\n".join(lines)


def test_cbsae_round_trip_through_a_saved_base(tmp_path):
    from conceptdict.saes import SparseCoder, save_dictionary

    base = SparseCoder(8, 16, 2, kind="topk")
    save_dictionary(base, tmp_path / "base")
    from conceptdict.saes import load_dictionary

    base = load_dictionary(tmp_path / "base")
    model = CbSae(base, torch.tensor([1, 4, 5]), torch.randn(8, 2), torch.zeros(2), torch.randn(2, 8), ["a", "b"],
                  torch.tensor([0.1, 0.5]))
    save_cbsae(model, tmp_path / "cb", tmp_path / "base")
    back = load_cbsae(tmp_path / "cb")
    x = torch.randn(5, 8)
    torch.testing.assert_close(back(x), model(x))
    assert back.concepts == ["a", "b"] and back.decoder_directions().shape == (5, 8)


def test_concept_list_file(tmp_path):
    (tmp_path / "c.txt").write_text("socket\n# comment\n\nfile system  # inline\nsocket\n")
    assert read_concept_list(tmp_path / "c.txt") == ["socket", "file system"]
    with pytest.raises(FileNotFoundError, match="one concept per line"):
        read_concept_list(tmp_path / "missing.txt")
