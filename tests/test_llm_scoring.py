"""Detection and fuzzing scorers against a local OpenAI-compatible server with scripted answers: a judge that
is right, malformed answers, 429s, 5xx, time-outs, and a scoring run killed halfway and resumed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_scoring import WORDS, bag_of_words, planted

from conceptdict.naming.llm import LlmConfig
from conceptdict.naming.llm_scorers import parse_judgement
from conceptdict.naming.negatives import NegativeConfig
from conceptdict.naming.pipeline import NameConfig, Sources, name_dictionary
from conceptdict.naming.score_run import prepare_context, score_concepts
from conceptdict.naming.scoring import ScoreConfig, TextEmbedder

pytestmark = pytest.mark.unit


def judge(user: str) -> str:
    """A perfect judge: the concept is word wNN; detection looks for it, fuzzing checks the marked token."""
    concept = re.search(r"Concept: (\S+)", user).group(1)
    lines = re.findall(r"^Example \d+: (.*)$", user, flags=re.M)
    if "marked" in user:
        return json.dumps([int(concept in "".join(re.findall(r"<<(.*?)>>", t))) for t in lines])
    return json.dumps([int(concept in t) for t in lines])


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        srv = self.server
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        key = hashlib.sha256(json.dumps(body["messages"], sort_keys=True).encode()).hexdigest()
        with srv.lock:
            action = srv.script.pop(0) if srv.script else "answer"
        if action == "hang":
            srv.release.wait(30)
            action = "503"
        if action in ("429", "503"):
            self.send_response(int(action))
            self.send_header("Retry-After", "0")
            self.end_headers()
            return
        if action == "timeout":
            time.sleep(1.0)  # longer than the client's timeout_s
        user = body["messages"][1]["content"]
        answer = {"malformed": "I think the first one, maybe.", "short": "[1]"}.get(action) or srv.answer(user)
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}],
                          "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": 7}}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (time-out)
            return
        with srv.lock:
            srv.answered.append(key)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.script, srv.answered, srv.lock, srv.release = [], [], threading.Lock(), threading.Event()
    srv.answer = judge  # what a 200 answers to the user message (other tests script their own explainer / judge)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def _setup(server, tmp_path, **llm):
    store, coder = planted(n_ctx=60)
    cd = name_dictionary(coder, store, NameConfig(namer="context", top_k=8))
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    cfg = ScoreConfig(scorers=["detection", "fuzzing"], negatives=NegativeConfig(pool_rows=1000),
                      llm=LlmConfig(url=url, n_scored=4, n_shown=4, backoff_s=0.01, **llm))  # fmt: skip
    ctx = prepare_context(cd, cfg, embed=TextEmbedder(bag_of_words), sources=Sources(coder, store, "hp", {}),
                          workdir=tmp_path)  # fmt: skip
    return cd, cfg, ctx


def test_parse_judgement_accepts_only_n_binary_values():
    assert parse_judgement("Sure: [1, 0, 1]", 3) == [1, 0, 1]
    assert parse_judgement("[true, false]", 2) == [1, 0]
    for bad in ("[1, 0]", "no list", "[1, 2, 0]", "[1, 0, x]", None):
        assert parse_judgement(bad, 3) is None


def test_right_names_score_high_wrong_names_chance_and_a_rerun_asks_nothing(server, tmp_path):
    cd, cfg, ctx = _setup(server, tmp_path)
    out = score_concepts(cd, cfg, ctx)
    det = [c.scores["detection"]["score"] for c in out.concepts if c.scores]
    fuz = [c.scores["fuzzing"]["score"] for c in out.concepts if c.scores]
    assert len(det) == len(WORDS) and min(fuz) == 1.0  # the marked token is the word itself
    assert sorted(det)[len(det) // 2] >= 0.85  # negatives may contain the word elsewhere in their window
    usage = out.meta["scoring"]["llm_usage"]
    assert usage["requests"] == len(server.answered) > 0 and usage["failed"] == 0 and usage["completion_tokens"] > 0
    n = len(server.answered)
    again = score_concepts(cd, cfg, prepare_context(cd, cfg, embed=ctx.embed, sources=ctx.sources, workdir=tmp_path))
    assert len(server.answered) == n  # everything came from the cache
    assert again.meta["scoring"]["llm_usage"]["cached"] == n
    assert [c.scores for c in again.concepts] == [c.scores for c in out.concepts]


def test_429_5xx_timeouts_and_malformed_answers_neither_crash_nor_count(server, tmp_path):
    server.script = ["429", "503", "timeout", "malformed", "short"]
    cd, cfg, ctx = _setup(server, tmp_path, timeout_s=0.3, max_retries=3, concurrency=1)
    out = score_concepts(cd, cfg, ctx)
    scored = [c.scores["detection"] for c in out.concepts if c.scores]
    assert len(scored) == len(WORDS)
    unjudged = sum(m["n_unjudged"] for m in scored)
    assert unjudged == 8  # the malformed and the wrong-length answer, 4 examples each
    for m in scored:  # a latent is unscored only when none of its examples got a usable answer
        assert (m["score"] is None) == (m["n_unjudged"] == m["n_pos"] + m["n_neg"])
    assert out.meta["scoring"]["llm_usage"]["failed"] == 0


def test_a_request_that_keeps_failing_is_not_cached_and_the_next_run_asks_it(server, tmp_path):
    server.script = ["503"]
    cd, cfg, ctx = _setup(server, tmp_path, max_retries=0, concurrency=1)
    out = score_concepts(cd, cfg, ctx)
    assert out.meta["scoring"]["llm_usage"]["failed"] == 1
    assert sum(c.scores["detection"]["n_unjudged"] for c in out.concepts if c.scores) == 4
    again = score_concepts(cd, cfg, prepare_context(cd, cfg, embed=ctx.embed, sources=ctx.sources, workdir=tmp_path))
    assert again.meta["scoring"]["llm_usage"]["requests"] == 1
    assert sum(c.scores["detection"]["n_unjudged"] for c in again.concepts if c.scores) == 0


_CHILD = """
import sys; sys.path.insert(0, {tests!r})
from test_llm_scoring import _setup
from conceptdict.naming.score_run import score_concepts
class S: server_address = ("127.0.0.1", {port})
cd, cfg, ctx = _setup(S, __import__("pathlib").Path({work!r}), concurrency=2)
score_concepts(cd, cfg, ctx)
"""


def test_a_run_killed_halfway_resumes_and_scores_nothing_twice(server, tmp_path):
    answered_first = 7
    server.script = ["answer"] * answered_first + ["hang"] * 1000
    code = textwrap.dedent(_CHILD).format(tests=str(Path(__file__).parent), port=server.server_address[1],
                                          work=str(tmp_path))  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    cache = tmp_path / "llm_cache.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (cache.exists() and len(cache.read_text().splitlines()) >= answered_first):
        assert child.poll() is None, child.stdout.read().decode()[-2000:]
        time.sleep(0.1)
    time.sleep(0.3)  # the child now waits on requests the server holds
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(cache.read_text().splitlines()) == answered_first == len(server.answered)
    with server.lock:
        server.script = []
    server.release.set()  # held requests answer 503 to a dead client
    cd, cfg, ctx = _setup(server, tmp_path)
    out = score_concepts(cd, cfg, ctx)
    assert len(server.answered) == len(set(server.answered))  # no prompt answered twice
    assert out.meta["scoring"]["llm_usage"]["cached"] == answered_first
    assert all("detection" in c.scores and "fuzzing" in c.scores for c in out.concepts if c.top_examples)
