"""Name scoring (naming/scoring.py, negatives.py, agreement.py, score_run.py) on a planted token store:
latent j fires exactly on word j, and a bag-of-words text embedder stands in for the sentence encoder."""

from __future__ import annotations

import re
import statistics

import pytest
import torch
from test_naming_fakes import FakeCoder, FakeStore

from conceptdict.naming.agreement import agreement, choose, confidence
from conceptdict.naming.concepts import load_concepts, save_concepts
from conceptdict.naming.negatives import NegativeConfig
from conceptdict.naming.pipeline import NameConfig, Sources, name_dictionary
from conceptdict.naming.score_run import prepare_context, score_concepts
from conceptdict.naming.scoring import (
    SCORERS,
    ScoreConfig,
    TextEmbedder,
    auroc,
    derangement,
    quartiles,
    register_scorer,
)

pytestmark = pytest.mark.unit

WORDS = [f"w{i:02d}" for i in range(40)]


def planted(n_ctx=120, ctx_len=16, seed=0):
    """Token store over 40 words; row = one-hot of its word (+ noise); dictionary latent j = word j."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(WORDS), (n_ctx, ctx_len), generator=gen)
    contexts = [[" " + WORDS[i] for i in row] for row in ids.tolist()]
    x = torch.nn.functional.one_hot(ids.flatten(), len(WORDS)).float() + 0.01 * torch.randn(
        n_ctx * ctx_len, len(WORDS), generator=gen)  # fmt: skip
    return FakeStore(x, contexts), FakeCoder(torch.eye(len(WORDS)), k=1)


def bag_of_words(texts):
    """Counts of each planted word in each text: a deterministic stand-in for a sentence encoder."""
    out = torch.zeros(len(texts), len(WORDS) + 1)
    for i, t in enumerate(texts):
        for w in re.findall(r"w\d\d", t):
            out[i, WORDS.index(w)] += 1
        out[i, -1] = 0.1  # no zero rows
    return out


@pytest.fixture(scope="module")
def scored_setup():
    store, coder = planted()
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=10))
    cfg = ScoreConfig(negatives=NegativeConfig(pool_rows=2000))
    ctx = prepare_context(cd, cfg, embed=TextEmbedder(bag_of_words), sources=Sources(coder, store, "hp", {}))
    return cd, cfg, ctx


def test_auroc_matches_its_definition():
    assert auroc([3, 2], [1, 0]) == 1.0 and auroc([0, 1], [2, 3]) == 0.0
    assert auroc([1, 1], [1, 1]) == 0.5
    assert auroc([2, 0], [1]) == 0.5
    assert auroc([], [1]) != auroc([], [1])  # NaN


def test_derangement_moves_every_id():
    m = derangement(range(17), seed=3)
    assert sorted(m.values()) == list(range(17)) and all(m[i] != i for i in m)
    assert derangement([5], 0) == {5: 5}


def test_negatives_never_activate_and_are_tagged(scored_setup):
    cd, cfg, ctx = scored_setup
    store, coder = ctx.sources.store, ctx.sources.model
    kinds = set()
    for j, s in ctx.samples.items():
        assert s.positives and len(s.negatives) == len(s.kinds)
        x = torch.cat([store.rows("hp", e.row, e.row + 1) for e in s.negatives])
        assert (coder.encode(x)[:, j] == 0).all()
        for e, k in zip(s.negatives, s.kinds):
            kinds.add(k)
            if k == "token":  # shares the latent's top token without activating it: impossible here
                pytest.fail("latent j fires on every row of word j, so no token negative can exist")
    assert kinds == {"random", "similar"}


def test_negative_kinds_follow_the_config(scored_setup):
    cd, _, ctx = scored_setup
    for kinds, allowed in (("random", {"random"}), ("hard", {"similar", "token"})):
        cfg = ScoreConfig(negatives=NegativeConfig(kinds=kinds, pool_rows=2000))
        c2 = prepare_context(cd, cfg, embed=ctx.embed, sources=ctx.sources)
        assert {k for s in c2.samples.values() for k in s.kinds} <= allowed
    with pytest.raises(ValueError, match="random, hard or random"):
        NegativeConfig(kinds="hardest")


def test_right_names_score_high_and_the_random_name_control_is_chance(scored_setup):
    cd, cfg, ctx = scored_setup
    assert [c.name for c in cd.concepts] == [w for w in WORDS]  # the context namer finds the planted word
    out = score_concepts(cd, cfg, ctx)
    emb = [c.scores["embedding"] for c in out.concepts if c.scores]
    assert len(emb) == len(WORDS)
    assert statistics.median(m["auroc"] for m in emb) > 0.8
    assert 0.35 < statistics.median(m["control_auroc"] for m in emb) < 0.65
    assert all(m["negatives"] == "random+hard" and m["n_hard"] > 0 and m["n_random"] > 0 for m in emb)
    summary = out.meta["scoring"]["summary"]["context"]
    assert summary["embedding"]["n"] == len(WORDS) and "embedding.control" in summary


def test_a_registered_scorer_lands_in_scores_and_survives_a_round_trip(scored_setup, tmp_path):
    """The contract the steering scorer plugs into (docs/scores.md)."""
    cd, cfg, ctx = scored_setup

    def name_length(ctx, names):
        return {j: {"score": 1.0 / (1 + len(n)), "length": len(n)} for j, n in names.items()}

    register_scorer("name-length", name_length)
    try:
        cfg2 = ScoreConfig(scorers=["embedding", "name-length"], negatives=cfg.negatives)
        out = score_concepts(cd, cfg2, ctx)
    finally:
        del SCORERS["name-length"]
    save_concepts(out, tmp_path)
    back = load_concepts(tmp_path)
    c = back.concepts[3]
    assert c.scores["name-length"] == {"score": 1.0 / 4, "length": 3}
    assert c.names["context"]["scores"]["embedding"]["auroc"] == c.scores["embedding"]["auroc"]
    assert 0.0 <= c.confidence <= 1.0
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        score_concepts(cd, ScoreConfig(scorers=["nope"]), ctx)


def test_several_namers_the_best_scoring_name_is_chosen(scored_setup):
    cd, cfg, ctx = scored_setup
    import dataclasses

    # the dictionary's own names are wrong for even latents; --namer context runs the context namer again
    wrong = [dataclasses.replace(c, name=WORDS[(c.id + 1) % 40] if c.id % 2 == 0 else c.name, namer="bad")
             for c in cd.concepts]  # fmt: skip
    bad = dataclasses.replace(cd, concepts=tuple(wrong), meta={**cd.meta, "namer": "bad"})
    cfg2 = ScoreConfig(namers=["context"], negatives=cfg.negatives)
    out = score_concepts(bad, cfg2, dataclasses.replace(ctx, cd=bad, cfg=cfg2))
    assert [c.name for c in out.concepts[:6]] == WORDS[:6]  # the right name wins where the two differ...
    c0, c1 = out.concepts[0], out.concepts[1]
    assert c0.namer == "context" and c0.runner_ups == (WORDS[1],)  # ...and the loser is the runner-up
    assert set(c0.names) == {"bad", "context"} and c0.names["bad"]["name"] == WORDS[1]
    assert c1.runner_ups == () and c1.extra["name_agreement"] == pytest.approx(1.0)
    assert c1.confidence > c0.confidence  # agreeing namers are trusted more
    # scoring again keeps every namer's own names (not the chosen ones) and chooses the same
    again = score_concepts(out, cfg, dataclasses.replace(ctx, cd=out, cfg=cfg))
    assert again.concepts[0].names["bad"]["name"] == WORDS[1] and again.concepts[0].name == WORDS[0]
    assert [c.names for c in again.concepts] == [c.names for c in out.concepts]


def test_confidence_and_agreement_formulas():
    emb = TextEmbedder(bag_of_words)
    assert agreement(["w01", "W01 "], emb) == pytest.approx(1.0)
    assert agreement(["w01", "w02"], emb) < 0.1
    assert agreement(["w01", ""], emb) is None
    assert confidence(1.0, {"embedding": {"score": 0.75}}) == pytest.approx(0.75)
    assert confidence(None, {"embedding": {"score": 0.4}}) == 0.0
    assert confidence(None, {}) is None
    entries = {"a": {"name": "x", "scores": {"embedding": {"score": 0.6}}},
               "b": {"name": "y", "scores": {"embedding": {"score": 0.9}}}}  # fmt: skip
    assert choose(entries, "embedding", "a") == ("b", ["a"])


def test_quartiles():
    q = quartiles([1.0, 2.0, 3.0, None, float("nan"), 4.0, 5.0])
    assert q == {"n": 5, "q25": 2.0, "median": 3.0, "q75": 4.0}
