"""`eval --metrics absorption`: SAEBench's first-letter absorption (naming/yardsticks/absorption.py) on a tiny
GPT-2 built here whose word embeddings carry their first letter, with two hand-made dictionaries: one latent per
letter (nothing absorbed) and the same with letter a's latent replaced by one latent per a-word (a absorbed: on
the words its main latents miss, a word latent carries the letter); the refusals; the arithmetic on hand-made
cases."""

from __future__ import annotations

import json
import random

import conceptdict as cd
import pytest
import torch
from conceptdict.naming.yardsticks.absorption import (
    LETTERS,
    absorption_of,
    alpha_words,
    letter_of,
    main_latents,
    prompt,
    word_activations,
)
from generators.letter_lm import HOOKPOINT, PER_LETTER

pytestmark = pytest.mark.integration

D = 64


@pytest.fixture(scope="module")
def letter_lm(tmp_path_factory):
    """(store, model dir, letter directions [26, D], {word: its embedding's own part [D]}): the 1-layer GPT-2 of
    bench/generators/letter_lm.py (word embeddings 4 x their first letter's unit direction plus 0.2 x noise) and a
    token store of it at blocks.0.hook_out."""
    from generators.letter_lm import build_letter_lm, letter_store

    root = tmp_path_factory.mktemp("letter_lm")
    lm = build_letter_lm(root / "lm", d_model=D)
    return letter_store(root / "store", lm), lm.path, lm.letters, lm.own


def write_relu(directory, enc: torch.Tensor, b_enc: torch.Tensor, dec: torch.Tensor):
    """A SAELens 'standard' (ReLU) SAE folder: codes relu(x @ enc + b_enc), decoder rows ``dec``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "cfg.json").write_text(json.dumps({"d_in": D, "d_sae": dec.shape[0], "architecture": "standard",
                                                    "apply_b_dec_to_input": False, "dtype": "float32"}))
    save_file({"W_enc": enc.contiguous(), "b_enc": b_enc, "W_dec": dec.contiguous(), "b_dec": torch.zeros(D)},
              str(directory / "sae_weights.safetensors"))
    return directory


def letter_dictionary(directory, letters: torch.Tensor, own: dict, absorb: str = ""):
    """One latent per letter (fires at 2 on its letter's words); with ``absorb``, that letter's latent is replaced
    by one latent per word of it, reading the word's own part (across the letter's direction) and firing at about 3
    on that word only, its decoder the word's embedding direction (mostly the letter)."""
    enc = [letters[i] for i in range(26) if LETTERS[i] != absorb]
    bias = [-2.0] * len(enc)
    dec = list(enc)
    for w in sorted(own):
        if absorb and w[0] == absorb:
            e = own[w] - (own[w] @ letters[LETTERS.index(absorb)]) * letters[LETTERS.index(absorb)]  # a's direction taken out: it reads the word alone
            enc.append(6 * e / e.pow(2).sum())
            bias.append(-3.0)
            dec.append(torch.nn.functional.normalize(4 * letters[letter_of(w)] + own[w], dim=0))
    return write_relu(directory, torch.stack(enc).T, torch.tensor(bias), torch.stack(dec))


def test_alpha_words_and_the_prompt_are_saebench_s(letter_lm):
    from conceptdict.activations import load_model

    _, lm_dir, _, _ = letter_lm
    lm = load_model(str(lm_dir))
    words = alpha_words(lm.tokenizer)
    assert len(words) == 26 * PER_LETTER + 4 and "<unk>" not in words and "<|endoftext|>" not in words
    text = prompt("apple", ["cat", "dog", "apple"], random.Random(0))
    lines = text.split("\n")
    assert lines[0] == "" and lines[-1] == "apple has the first letter:" and len(lines) == 4
    assert sorted(lines[1:3]) == ["cat has the first letter: C", "dog has the first letter: D"]
    # the activation read is the one at the asked word's token (the last of its prompt), not at an example's
    word = words[5]
    text = prompt(word, words, random.Random(0))
    ids = lm.to_tokens(text)[0]
    at = int(torch.nonzero(ids == lm.tokenizer.convert_tokens_to_ids(word)).flatten()[-1])
    cache = lm.run_with_cache(text, names=[HOOKPOINT]).cache[HOOKPOINT]
    assert torch.allclose(word_activations(lm, HOOKPOINT, [text])[0], cache[0, at].double())
    assert at == len(ids) - 6  # SAEBench's prompt_token_pos for its template


def test_absorbed_letter_is_found_and_the_clean_dictionary_has_none(letter_lm, tmp_path):
    store, _, letters, own = letter_lm
    results = {}
    for name, absorb in (("clean", ""), ("absorbed", "a")):
        sae = letter_dictionary(tmp_path / name, letters, own, absorb)
        got = cd.evaluate(sae, store=store, hookpoint=HOOKPOINT, contexts=0, rows_from="start", metrics="absorption",
                          format="saebench", out=tmp_path / f"{name}.json")
        results[name] = got.yardsticks.results["absorption"]
    clean, absorbed = (results[n]["details"]["letters"] for n in ("clean", "absorbed"))
    assert len(clean) >= 20  # letters whose probe has a test F1 above 0.6 and a true positive
    assert all(v["mean_absorption_fraction"] == 0 and v["num_full_absorption"] == 0 for v in clean.values())
    assert clean["b"]["main_latents"] == [1] and clean["b"]["num_split_features"] == 1  # b's own latent
    assert results["clean"]["summary"]["mean_absorption_fraction_score"] == 0
    # a: its main latents are some train words' latents; every test a-word's own latent carries the letter
    assert absorbed["a"]["mean_absorption_fraction"] > 0.9 and absorbed["a"]["full_absorption_rate"] > 0.9
    assert all(v["mean_absorption_fraction"] == 0 for k, v in absorbed.items() if k != "a")
    assert results["absorbed"]["summary"]["mean_absorption_fraction_score"] == pytest.approx(
        absorbed["a"]["mean_absorption_fraction"] / len(absorbed))
    data = json.loads((tmp_path / "saebench" / "absorption_first_letter" / "conceptdict_absorbed_eval_results.json")
                      .read_text())
    assert data["eval_result_metrics"]["mean"] == results["absorbed"]["summary"]
    assert {d["first_letter"] for d in data["eval_result_details"]} == set(absorbed)


def test_a_hookpoint_without_first_letters_is_skipped_under_all(tiny_lm_store, tmp_path):
    """The shared tiny GPT-2 is random: its hookpoint does not carry first letters, so `all` lists absorption as
    skipped with why and asking for it by name raises that."""
    store, _ = tiny_lm_store
    sae = cd.train(store=store, hookpoint="blocks.0.hook_out", latents=64, k=4, batch_size=64, eval_batches=1,
                   out=tmp_path / "sae")
    got = cd.evaluate(sae.path, contexts=0, metrics="all")
    assert got.yardsticks.skipped["absorption"].startswith("absorption: ")
    assert "first letters have a probe test F1 above 0.6" in got.yardsticks.skipped["absorption"]
    with pytest.raises(ValueError, match="this hookpoint does not carry first letters linearly"):
        cd.evaluate(sae.path, contexts=0, metrics="absorption")


def test_a_dictionary_of_sentence_embeddings_is_refused(tiny_sentence_store, tmp_path):
    store, _ = tiny_sentence_store
    sae = cd.train(store=store, latents=32, k=4, batch_size=16, eval_batches=1, out=tmp_path / "sae")
    with pytest.raises(ValueError, match=r"absorption: needs a token-level hookpoint of a causal LM .*; this "
                                         r"dictionary was trained on sentence embeddings of "):
        cd.evaluate(sae.path, metrics="absorption", out=tmp_path / "e.json")


def test_absorption_arithmetic_on_hand_made_words():
    """Three words along the probe (a . p = 4) and a decoder of three unit latents: 0 the main one, 1 along p, 2
    across it. Main fires: nothing absorbed; main silent and latent 1 carries 3 of 4: fully absorbed; main at 1
    and latent 1 at 2: fraction 2 / 3, not full; main silent and latent 1 at 1 (< 0.4 of 4): none."""
    p = torch.tensor([1.0, 0, 0])
    decoder = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0]])
    acts = torch.tensor([[4.0, 0, 0]] * 4)
    codes = torch.tensor([[4.0, 0, 1], [0, 3, 0], [1, 2, 0], [0, 1, 0]])
    fractions, full = absorption_of(acts, codes, p, [0], decoder)
    assert fractions == pytest.approx([0.0, 1.0, 2 / 3, 0.0])
    assert full == [False, True, False, False]


def test_main_latents_stop_when_the_f1_stops_jumping():
    """Latent 0 finds half the positives, latent 1 the other half, latent 2 nothing new: k = 1 then 2 raise the F1
    by more than 0.03, k = 3 does not: the main latents are 0 and 1."""
    y = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0] * 8)
    codes = torch.zeros(len(y), 3)
    codes[::8, 0] = codes[1::8, 0] = 1.0
    codes[2::8, 1] = codes[3::8, 1] = 1.0
    codes[4::8, 2] = 0.5
    chosen, f1s = main_latents(torch.tensor([0, 1, 2]), codes, y, codes, y)
    assert chosen == [0, 1] and f1s[1] == pytest.approx(1.0) and f1s[0] < f1s[1] - 0.03
