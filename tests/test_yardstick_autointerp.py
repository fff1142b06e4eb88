"""The autointerp yardstick (naming/yardsticks/autointerp.py): SAEBench's detection protocol on a planted token store
(latent j fires exactly on word j) with the fake OpenAI-compatible server of test_llm_scoring.py as explainer and
scorer: the example selection, the score arithmetic, the cache (a second run asks nothing), the embedding scorer
without a server (said so), and ``eval --metrics autointerp`` with its SAEBench file."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_llm_scoring import server  # noqa: F401  # the fake server fixture
from test_scoring import WORDS, bag_of_words, planted
from test_yardstick_reference import FIXTURES, SIDE_PYTHON

from conceptdict.naming.llm import LlmConfig
from conceptdict.naming.scoring import TextEmbedder
from conceptdict.naming.yardsticks import Inputs, TooThin, autointerp
from conceptdict.naming.yardsticks.autointerp import (N_IW, N_RANDOM, N_TOP, Window, centres, score_predictions,
                                                      select, top_centres)
from conceptdict.naming.yardsticks.autointerp_judges import parse_explanation, parse_predictions

pytestmark = pytest.mark.unit


def answer(user: str) -> str:
    """A perfect explainer and scorer for the planted store: the explanation names the marked word; the scorer
    answers the examples holding it."""
    if "The activating documents" in user:
        word = Counter(w.strip() for w in re.findall(r"<<(.*?)>>", user)).most_common(1)[0][0]
        return f"This neuron activates on the word {word}."
    word = re.search(r"fires on the word (w\d\d)", user).group(1)
    lines = re.findall(r"^(\d+)\. (.*)$", user.split("Here are the examples:")[1], flags=re.MULTILINE)
    return ", ".join(n for n, text in lines if word in text) or "None"


def planted_inputs(options: dict) -> Inputs:
    store, coder = planted(n_ctx=120, ctx_len=32)
    return Inputs(coder, None, store, "hp", rows=store.num_rows, seed=0,  # type: ignore[arg-type]  # fakes
                  options={"autointerp": options})


def test_selection_follows_the_protocol():
    g = torch.Generator().manual_seed(1)
    context = torch.arange(40).repeat_interleave(32)  # 40 contexts of 32 rows
    acts = torch.rand(1280, generator=g) * (torch.rand(1280, generator=g) < 0.3)
    valid = centres(context, 10)
    assert valid.sum() == 40 * 12 and not valid[:10].any() and valid[10] and not valid[22]
    top = top_centres(acts, valid, N_TOP, 10)
    assert len(top) == N_TOP and all(abs(a - b) > 10 for a in top for b in top if a != b)
    assert all(valid[r] for r in top) and acts[top[0]] == acts[valid].max()
    s = select(acts, valid, torch.Generator().manual_seed(0), 10)
    assert len(s.generation) == 10 + 5 and len(s.scoring) == 2 + 2 + N_RANDOM == 14 and len(s.randoms) == N_RANDOM
    assert [max(w.acts) for w in s.generation] == sorted((max(w.acts) for w in s.generation), reverse=True)
    assert s.threshold == pytest.approx(0.01 * float(torch.stack([acts[r - 10: r + 11] for r in top]).max()))
    tops = set(top)
    sampled = [w.row for w in s.generation + s.scoring if w.row not in tops and w not in s.randoms]
    assert len(sampled) == N_IW and all(acts[r] < acts[top].min() and acts[r] > 0 and valid[r] for r in sampled)
    assert {w.row for w in s.generation + s.scoring if w.row in tops} == tops  # every top window used once
    for w in s.scoring:
        assert len(w.acts) == 21 and w.active == any(a > s.threshold for a in w.acts) and valid[w.row]
    again = select(acts, valid, torch.Generator().manual_seed(0), 10)
    assert again == s  # seeded: the same prompts, so the cache answers a rerun
    assert select(acts * (acts > 0.99), valid, torch.Generator().manual_seed(0), 10) is None  # too few windows


def test_score_and_answer_parsing_are_saebenchs():
    windows = [Window(i, [0.0], a) for i, a in enumerate([True, False, True, False])]
    assert score_predictions([1, 3], windows) == 1.0
    assert score_predictions([1], windows) == 0.75 and score_predictions([], windows) == 0.5
    assert score_predictions([2, 4], windows) == 0.0
    assert parse_predictions("1, 3 and 5.") == [1, 3, 5] and parse_predictions("None") == []
    assert parse_predictions("the first one") is None
    assert parse_explanation("This neuron activates on the word 'knows'.") == "the word 'knows'"


def test_a_perfect_judge_scores_one_and_a_rerun_asks_nothing(server, tmp_path):  # noqa: F811
    server.answer = answer
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    options = {"llm": LlmConfig(url=url, backoff_s=0.01), "latents": 6, "cache": tmp_path / "cache.jsonl"}
    first = autointerp.compute(planted_inputs(options))
    s = first["summary"]
    assert s["scorer"] == "llm" and s["n_latents_scored"] == 6 and "note" not in first
    assert s["autointerp_score"] == 1.0 and s["autointerp_std_dev"] == 0.0
    assert first["details"]["usage"] == {"requests": 12, "cached": 0, "failed": 0}  # one explanation, one scoring
    for j, r in first["details"]["latents"].items():
        assert r["explanation"] == f"the word {WORDS[int(j)]}" and r["predictions"] == r["correct seqs"]
    asked = len(server.answered)
    second = autointerp.compute(planted_inputs(options))
    assert len(server.answered) == asked and second["details"]["usage"] == {"requests": 0, "cached": 12, "failed": 0}
    assert second["summary"] == s and second["details"]["latents"] == first["details"]["latents"]


def test_without_a_server_the_embedding_scorer_runs_and_says_so(tmp_path):
    closed = LlmConfig(url="http://127.0.0.1:9/v1", max_retries=0, timeout_s=2)  # nothing listens on port 9
    options = {"llm": closed, "latents": 6, "embed": TextEmbedder(bag_of_words)}
    got = autointerp.compute(planted_inputs(options))
    assert got["summary"]["scorer"] == "embedding" and "no LLM server answers at http://127.0.0.1:9/v1" in got["note"]
    assert got["summary"]["n_latents_scored"] == 6 and got["details"]["usage"] == {}
    for j, r in got["details"]["latents"].items():
        assert r["explanation"] == WORDS[int(j)] and len(r["predictions"]) == 4
    assert 0.6 < got["summary"]["autointerp_score"] <= 1.0  # 4 predicted; the random windows hold the word at times
    with pytest.raises(Exception, match="cannot reach the LLM server"):
        autointerp.compute(planted_inputs({**options, "scorer": "llm"}))
    asked = autointerp.compute(planted_inputs({**options, "scorer": "embedding"}))
    assert asked["summary"] == got["summary"] and "asked for" in asked["note"]


def test_too_few_rows_for_any_latents_windows_is_too_thin_not_nan():
    """Rows too few for any drawn latent to fire in N_TOP separate windows: a TooThin refusal (``--metrics all``
    lists it as skipped), not a NaN score over 0 latents."""
    store, coder = planted(n_ctx=120, ctx_len=32)
    inputs = Inputs(coder, None, store, "hp", rows=64, seed=0,  # type: ignore[arg-type]  # fakes
                    options={"autointerp": {"scorer": "embedding", "latents": 6, "embed": TextEmbedder(bag_of_words)}})
    with pytest.raises(TooThin, match=r"autointerp: none of the \d+ live latents drawn fires in 12 windows of 21 "
                                      r"tokens .* within the first 64 rows: give it more rows \(--rows\)"):
        autointerp.compute(inputs)


def test_a_sequence_store_shows_whole_inputs(tmp_path):
    """Rows that are whole inputs (a sentence store): each example is one row's text, no window around it."""
    from test_naming_fakes import FakeCoder, FakeStore

    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, len(WORDS), (2000, 2), generator=g)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    texts = [f"{WORDS[a]} {WORDS[b]}" for a, b in pairs.tolist()]
    x = torch.nn.functional.one_hot(pairs, len(WORDS)).sum(1).float() + 0.01 * torch.rand(len(texts), len(WORDS),
                                                                                          generator=g)
    store, coder = FakeStore(x, texts, level="sequence"), FakeCoder(torch.eye(len(WORDS)), k=2)
    inputs = Inputs(coder, None, store, "hp", rows=store.num_rows, seed=0,  # type: ignore[arg-type]  # fakes
                    options={"autointerp": {"scorer": "embedding", "latents": 5, "embed": TextEmbedder(bag_of_words)}})
    got = autointerp.compute(inputs)
    assert got["summary"]["n_latents_scored"] == 5 and got["summary"]["autointerp_score"] > 0.8
    for j, r in got["details"]["latents"].items():
        assert r["explanation"] == WORDS[int(j)]


@pytest.mark.integration
def test_eval_metrics_autointerp_writes_saebenchs_layout(tiny_lm_store, planted_store, tmp_path, capsys):
    from conceptdict.cli.main import main

    sae = tmp_path / "sae"
    assert main(["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "16",
                 "--k", "4", "--batch-size", "32", "--tokens", "640", "--device", "cpu", "--out", str(sae)]) == 0
    capsys.readouterr()
    assert main(["eval", str(sae), "--metrics", "autointerp", "--autointerp-scorer", "embedding",
                 "--autointerp-latents", "3", "--rows-from", "start", "--contexts", "0", "--format", "saebench"]) == 0
    out = capsys.readouterr().out
    assert "[autointerp] (scorer embedding (asked for): not comparable with SAEBench's LLM-judged scores)" in out
    record = json.loads((sae / "eval.json").read_text())
    summary = record["yardsticks"]["results"]["autointerp"]["summary"]
    assert summary["scorer"] == "embedding" and summary["n_latents_scored"] >= 1
    (path,) = [p for p in record["saebench"] if "/autointerp/" in p]
    doc = json.loads(Path(path).read_text())
    assert doc["eval_type_id"] == "autointerp" and doc["eval_config"]["autointerp_scorer"] == "embedding"
    assert doc["eval_result_metrics"]["autointerp"]["autointerp_score"] == summary["autointerp_score"]
    if SIDE_PYTHON.exists():  # SAEBench's own graphing_utils.get_eval_results reads it (the side environment)
        proc = subprocess.run([str(SIDE_PYTHON), str(FIXTURES / "make_fixtures.py"), "--check-saebench", path],
                              capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"}, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (entry,) = json.loads(proc.stdout.strip().splitlines()[-1])[path].values()
        assert entry["autointerp_score"] == pytest.approx(summary["autointerp_score"])
    planted_sae = tmp_path / "planted"
    assert main(["train", "--store", str(planted_store), "--latents", "16", "--k", "2", "--tokens", "1024", "--device",
                 "cpu", "--out", str(planted_sae)]) == 0
    capsys.readouterr()
    assert main(["eval", str(planted_sae), "--metrics", "autointerp"]) != 0
    assert "autointerp: needs example texts (a store cached from a text model" in capsys.readouterr().err


SIDE_SCRIPT = """
import json, sys
import torch
from sae_bench.evals.autointerp.main import AutoInterp
from sae_bench.sae_bench_utils.indexing_utils import get_k_largest_indices

spec = json.loads(open(sys.argv[1]).read())
top = get_k_largest_indices(torch.tensor(spec["acts"]), k=spec["k"], buffer=spec["buffer"], no_overlap=True)


class Example:  # what score_predictions reads of an example
    def __init__(self, active):
        self.is_active = active


print(json.dumps({
    "top": top.tolist(),
    "parsed": [AutoInterp.parse_predictions(None, a) for a in spec["answers"]],
    "explanations": [AutoInterp.parse_explanation(None, a) for a in spec["explanations"]],
    "scores": [AutoInterp.score_predictions(None, p, [Example(a) for a in spec["active"]])
               for p in spec["predictions"]]}))
"""


@pytest.mark.integration
@pytest.mark.slow
def test_selection_parsing_and_score_equal_saebenchs_code(tmp_path):
    """SAEBench's own get_k_largest_indices, parse_predictions, parse_explanation and score_predictions (in the side
    environment; its runner itself needs OpenAI's API) on the same activations and answers."""
    if not SIDE_PYTHON.exists():
        pytest.skip("no .venv-saebench (see tests/fixtures/saebench/make_fixtures.py for how to make it)")
    g = torch.Generator().manual_seed(3)
    acts = torch.rand(8, 40, generator=g) * (torch.rand(8, 40, generator=g) < 0.5)  # 8 contexts of 40 tokens
    answers = ["1, 3 and 5.", "None", "2,4", "the first one", " 7 ", "1, 2, x"]
    explanations = ["This neuron activates on the word 'knows'.", "activates on verbs. activates on nouns", "dates"]
    active = [True, False, True, False, True, False, False]
    predictions = [[1, 3, 5], [], [2, 4, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9]]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"acts": acts.tolist(), "k": N_TOP, "buffer": 10, "answers": answers,
                                "explanations": explanations, "active": active, "predictions": predictions}))
    proc = subprocess.run([str(SIDE_PYTHON), "-c", SIDE_SCRIPT, str(spec)], capture_output=True, text=True,
                          timeout=600, env={"PATH": "/usr/bin:/bin", "JAXTYPING_DISABLE": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    flat = acts.flatten()
    ours = top_centres(flat, centres(torch.arange(8).repeat_interleave(40), 10), N_TOP, 10)
    assert ours == [row * 40 + col for row, col in ref["top"]]
    assert [parse_predictions(a) for a in answers] == ref["parsed"]
    assert [parse_explanation(a) for a in explanations] == ref["explanations"]
    windows = [Window(i, [0.0], a) for i, a in enumerate(active)]
    assert [score_predictions(p, windows) for p in predictions] == ref["scores"]
