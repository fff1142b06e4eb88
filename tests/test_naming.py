"""Naming: vocabulary namer (Discover-then-Name), evidence streaming, context / logit-lens namers, the
concept dictionary format and name_dictionary end to end on in-memory stand-ins."""

from __future__ import annotations

import json

import pytest
import torch
from test_naming_fakes import FakeCoder, FakeStore, random_token_store

from conceptdict.naming.concepts import Concept, ConceptDictionary, Example, load_concepts, save_concepts
from conceptdict.naming.evidence import collect_evidence, logit_lens
from conceptdict.naming.namers import NamingInputs, context_names, logit_lens_names, vocab_names
from conceptdict.naming.pipeline import NameConfig, name_dictionary
from conceptdict.naming.vocab import embed_vocabulary, load_vocabulary, vocab_key

pytestmark = pytest.mark.unit

WORDS = ["apple", "river", "music", "stone", "green", "quick", "ocean", "paper"]


def _emb(V=len(WORDS), D=12, seed=0):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ vocabulary namer


def test_vocab_name_of_a_word_embedding_is_that_word_with_score_one():
    E = _emb()
    res = vocab_names(E[[3, 5]] * 7.5, E, WORDS)
    assert [r.name for r in res] == ["stone", "quick"]
    assert [r.score for r in res] == pytest.approx([1.0, 1.0], abs=1e-5)


def test_vocab_naming_is_invariant_to_positive_scaling():
    E, dirs = _emb(), torch.randn(5, 12)
    scales = torch.tensor([0.01, 1.0, 3.0, 100.0, 0.5])[:, None]
    a, b = vocab_names(dirs, E, WORDS), vocab_names(dirs * scales, E * 4.0, WORDS)
    assert [r.name for r in a] == [r.name for r in b]
    assert [r.score for r in a] == pytest.approx([r.score for r in b], abs=1e-5)
    assert [r.runner_ups for r in a] == [r.runner_ups for r in b]


def test_vocab_argmax_runs_over_the_vocabulary_per_latent():
    E, dirs = _emb(), torch.randn(20, 12)
    cos = torch.nn.functional.normalize(dirs, dim=1) @ torch.nn.functional.normalize(E, dim=1).T
    res = vocab_names(dirs, E, WORDS, n_runner_ups=2, chunk=7)  # chunk not dividing L
    for j, r in enumerate(res):
        order = cos[j].argsort(descending=True).tolist()
        assert r.name == WORDS[order[0]]
        assert r.runner_ups == (WORDS[order[1]], WORDS[order[2]])
        assert r.score == pytest.approx(float(cos[j].max()), abs=1e-5)
    assert len({r.name for r in res}) < len(res)  # duplicates allowed: 20 latents, 8 words


def test_vocab_names_reject_mismatched_width():
    with pytest.raises(ValueError, match="D=5"):
        vocab_names(torch.randn(2, 5), _emb(), WORDS)


def test_planted_latents_are_named_with_their_words():
    """Latents built from known word embeddings (plus noise) are named with those words."""
    E = _emb(D=64, seed=1)
    planted = [6, 0, 2, 7, 4]
    dirs = E[planted] + 0.3 * torch.randn(len(planted), 64, generator=torch.Generator().manual_seed(2))
    res = vocab_names(dirs, E, WORDS)
    assert [r.name for r in res] == [WORDS[i] for i in planted]


def test_vocabulary_specs(tmp_path):
    f = tmp_path / "words.txt"
    f.write_text("# comment\nalpha\n\nbeta\nalpha\n gamma \n")
    assert load_vocabulary(str(f)) == ["alpha", "beta", "gamma"]
    wf = load_vocabulary("wordfreq:en:50")
    assert len(wf) == 50 and "the" in wf
    with pytest.raises(FileNotFoundError, match="wordfreq"):
        load_vocabulary(str(tmp_path / "missing.txt"))


def test_vocabulary_embeddings_are_cached(tmp_path):
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return torch.ones(len(texts), 3)

    a = embed_vocabulary(WORDS, "m", "hp", embed, tmp_path)
    b = embed_vocabulary(WORDS, "m", "hp", embed, tmp_path)
    assert calls == [len(WORDS)] and a.path == b.path and torch.equal(a.embeddings, b.embeddings)
    embed_vocabulary(WORDS, "m", "other-hookpoint", embed, tmp_path)
    assert calls == [len(WORDS)] * 2
    assert vocab_key("m", "hp", WORDS) != vocab_key("m", "hp", WORDS[:-1])


# ------------------------------------------------------------------ evidence


def test_top_k_examples_match_a_brute_force_scan():
    store = random_token_store(n_ctx=40, ctx_len=10, d=16)
    coder = FakeCoder(torch.randn(24, 16, generator=torch.Generator().manual_seed(3)), k=3)
    ev = collect_evidence(coder, store, "hp", top_k=5, chunk=37, n_bins=8)
    with torch.no_grad():
        codes = coder.encode(store._x)
    for j in range(24):
        col = codes[:, j]
        n_active = int((col > 0).sum())
        assert int(ev.count[j]) == n_active
        assert float(ev.frequency[j]) == pytest.approx(n_active / store.num_rows)
        brute = col.topk(5)
        m = min(5, n_active)
        assert torch.allclose(ev.top_values[j, :m], brute.values[:m])
        assert set(ev.top_rows[j, :m].tolist()) == set(brute.indices[:m].tolist())
        assert (ev.top_rows[j, m:] == -1).all()
        assert int(ev.hist_counts[j].sum()) == n_active
        if n_active:
            assert float(ev.max[j]) == pytest.approx(float(col.max()))
            assert float(ev.mean_active[j]) == pytest.approx(float(col[col > 0].mean()), rel=1e-4)
        for r, v in zip(ev.quantile_rows[j].tolist(), ev.quantile_row_values[j].tolist()):
            if r >= 0:
                assert float(col[r]) == pytest.approx(v)


def test_quantile_examples_come_from_their_quantile_bins():
    x = torch.linspace(0.01, 1, 1000)[:, None] * torch.tensor([[1.0, 0.0]])
    store = FakeStore(x, [["t"]] * 1000)
    coder = FakeCoder(torch.tensor([[1.0, 0.0]]), k=1)
    ev = collect_evidence(coder, store, "hp", quantile_levels=(0.1, 0.5, 0.9), n_bins=20, chunk=128)
    assert ev.quantile_values[0].tolist() == pytest.approx([0.1, 0.5, 0.9], abs=0.02)
    assert ev.quantile_row_values[0].tolist() == pytest.approx([0.1, 0.5, 0.9], abs=0.06)


def test_negative_rows_are_rows_where_the_latent_is_silent():
    store = random_token_store()
    coder = FakeCoder(torch.randn(6, 16, generator=torch.Generator().manual_seed(4)), k=1)
    ev = collect_evidence(coder, store, "hp", n_negatives=4)
    codes = coder.encode(store._x)
    for j in range(6):
        rows = [r for r in ev.negative_rows[j].tolist() if r >= 0]
        assert rows and all(float(codes[r, j]) == 0 for r in rows)


def test_logit_lens_top_and_bottom_tokens():
    W_U = torch.eye(4)  # D = V = 4
    lens = logit_lens(torch.tensor([[0.0, 2.0, -3.0, 1.0]]), W_U, k=2, chunk=1)
    assert lens.top_ids[0].tolist() == [1, 3] and lens.bottom_ids[0].tolist() == [2, 0]
    res = logit_lens_names(torch.tensor([[0.0, 2.0, 0.0, 0.0]]), W_U, lambda ids: [f" tok{i}" for i in ids])
    assert res[0].name == "tok1" and res[0].score == pytest.approx(1.0)


# ------------------------------------------------------------------ context namer


def _ex(tokens, marked=-1):
    return Example(row=0, activation=1.0, tokens=tuple(tokens), marked=marked, text="".join(tokens))


def test_context_namer_finds_the_over_represented_term():
    base = [_ex(["the", " cat", " sat", " on", " the", " mat"]), _ex(["the", " dog", " ran"])] * 5
    top = [_ex(["the", " python", " code"], 1), _ex([" a", " python", " snake"], 1), _ex([" python"], 0)]
    (res,) = context_names([tuple(top)], base)
    assert res.name == "python" and res.score == pytest.approx(1.0)
    assert "the" not in res.runner_ups[:1]


# ------------------------------------------------------------------ format and pipeline


def test_concept_dictionary_round_trip(tmp_path):
    ex = Example(row=3, activation=1.5, tokens=("a", "<script>", "b"), marked=1, text="a<script>b")
    c = Concept(id=0, name="x", score=0.5, runner_ups=("y",), runner_up_scores=(0.4,), namer="vocab",
                frequency=0.1, stats={"max": 2.0}, histogram={"edges": [0, 1], "counts": [3]},
                top_examples=(ex,), logit_top=("t",), extra={"dead": False})  # fmt: skip
    cd = ConceptDictionary((c,), torch.randn(1, 4), {"model": "m"})
    save_concepts(cd, tmp_path)
    doc = json.loads((tmp_path / "concepts.json").read_text())
    assert doc["format_version"] == 1 and doc["concepts"][0]["top_examples"][0]["marked_text"] == "a <<<script>>> b"
    back = load_concepts(tmp_path)
    assert back.concepts == cd.concepts and torch.equal(back.directions, cd.directions) and back.meta == cd.meta
    with pytest.raises(ValueError, match="ordered by id"):
        ConceptDictionary((c, c), torch.randn(2, 4))


def test_name_dictionary_with_cached_vocabulary(tmp_path):
    """End to end on a fake store: planted word directions get their words; the cache stands in for the model."""
    E = _emb(D=16, seed=5)
    embed_vocabulary(WORDS, "fake-model", "hp", lambda t: E, tmp_path / "cache")
    planted = [1, 4, 6]
    store = random_token_store(d=16)
    coder = FakeCoder(E[planted], k=1)
    cfg = NameConfig(cache_dir=tmp_path / "cache", vocab=str(_write(tmp_path / "w.txt", WORDS)), top_k=4)
    cd = name_dictionary(coder, store, cfg)
    assert cd.names == [WORDS[i] for i in planted]
    assert all(c.score == pytest.approx(1.0, abs=1e-5) and c.namer == "vocab" for c in cd.concepts)
    firing = [c for c in cd.concepts if c.frequency > 0]
    assert firing and all(c.top_examples[0].tokens[c.top_examples[0].marked] for c in firing)
    assert cd.meta["hookpoint"] == "hp" and cd.meta["model"] == "fake-model"


def test_name_dictionary_context_namer_on_sequence_store():
    texts = [f"doc {i} about {'python code' if i % 2 else 'ocean waves'}" for i in range(40)]
    x = torch.stack([torch.tensor([1.0, 0.0]) if i % 2 else torch.tensor([0.0, 1.0]) for i in range(40)])
    store = FakeStore(x + 0.01, texts, level="sequence")
    coder = FakeCoder(torch.eye(2), k=1)
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=10, base_rows=40))
    assert cd.concepts[0].name in {"python", "code", "python code"}
    assert cd.concepts[1].name in {"ocean", "waves", "ocean waves"}
    assert cd.concepts[0].top_examples[0].marked == -1 and cd.meta["level"] == "sequence"


def _write(path, words):
    path.write_text("\n".join(words) + "\n")
    return path


def test_namer_inputs_defaults():
    inp = NamingInputs(torch.zeros(1, 2))
    assert inp.top_examples == () and inp.base_examples == ()


def test_wordpiece_tokens_read_as_text_and_merge_for_the_context_namer():
    from conceptdict.naming.namers import context_terms

    e = Example(row=0, activation=1.0, tokens=("open", "the", "py", "##file", "(", "x", ")", "."), marked=2, text="")
    assert e.marked_text() == "open the <<py>>file (x)."
    gpt = Example(row=0, activation=1.0, tokens=("a", " b", " c"), marked=1, text="a b c")
    assert gpt.marked_text("[", "]") == "a [b] c"
    assert "pyfile" in context_terms(e) and "py" not in context_terms(e)


def test_spaceless_tokens_get_spaces_for_display():
    e = Example(row=0, activation=1.0, tokens=("if", "the", "last", "object", "is", "not"), marked=5, text="")
    assert e.marked_text() == "if the last object is <<not>>"
