"""The LLM namer against a small OpenAI-compatible server started on 127.0.0.1 by the test.

The server answers a bounded number of requests and stops by itself (after MAX_REQUESTS or IDLE_S idle)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from conceptdict.naming.concepts import Example
from conceptdict.naming.llm import (
    LlmConfig,
    LlmError,
    LlmNamer,
    balanced_accuracy,
    chat,
    clean_name,
    parse_votes,
)
from conceptdict.naming.namers import NamingInputs

pytestmark = pytest.mark.unit

MAX_REQUESTS = 50
IDLE_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        srv = self.server
        srv.log.append((self.path, self.headers.get("Authorization")))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if srv.fail_first > 0:
            srv.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        if "name features" in system:
            # the explainer: name the word that is marked most often
            marked = re.findall(r"<<\s*([^>]+?)\s*>>", user)
            answer = f'Name: "{max(set(marked), key=marked.count)} word".' if marked else "nothing"
        else:
            m = re.search(r"Concept: (\S+)", user)
            concept = m.group(1) if m else "\0"
            texts = re.findall(r"^\d+\. (.*)$", user, flags=re.M)
            answer = json.dumps([int(concept in t) for t in texts])
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def server():
    srv = HTTPServer(("127.0.0.1", 0), _Handler)
    srv.timeout = IDLE_S
    srv.log, srv.fail_first = [], 0
    stop = threading.Event()

    def serve():
        for _ in range(MAX_REQUESTS):
            if stop.is_set():
                break
            srv.handle_request()  # returns after one request or IDLE_S without one

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv
    stop.set()
    srv.server_close()


def _cfg(srv, **kw):
    return LlmConfig(url=f"http://127.0.0.1:{srv.server_address[1]}/v1", timeout_s=5, **kw)


def _ex(row, words, marked):
    toks = tuple(f" {w}" for w in words)
    return Example(row=row, activation=1.0, tokens=toks, marked=marked, text="".join(toks))


def test_llm_namer_names_and_scores_by_detection(server, monkeypatch):
    monkeypatch.setenv("TEST_LLM_KEY", "secret-token")
    top = [tuple(_ex(i, ["a", "python", "script"], 1) for i in range(6)), ()]
    held = [tuple(_ex(10 + i, ["python", "rocks"], 0) for i in range(3)), ()]
    neg = [tuple(_ex(20 + i, ["ocean", "waves"], 0) for i in range(3)), ()]
    namer = LlmNamer(_cfg(server, api_key_env="TEST_LLM_KEY", n_explain=4, n_heldout=3))
    res = namer(NamingInputs(torch.zeros(2, 4), top, held, neg))
    assert res[0].name == "python word"
    assert res[0].score == pytest.approx(1.0)  # the judge separates python texts from ocean texts
    assert res[0].extra == {"detection_n_pos": 3, "detection_n_neg": 3}
    assert res[1].name == "" and res[1].score == 0.0  # a latent that never fires is not sent
    assert len(server.log) == 2 and all(p == "/v1/chat/completions" for p, _ in server.log)
    assert server.log[0][1] == "Bearer secret-token"


def test_chat_retries_transient_errors(server):
    server.fail_first = 1
    assert chat(_cfg(server, max_retries=1), [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert len(server.log) == 2


def test_unreachable_endpoint_raises_a_clear_error():
    with pytest.raises(LlmError, match="server running"):
        chat(LlmConfig(url="http://127.0.0.1:9/v1", max_retries=0, timeout_s=1), [{"role": "user", "content": "x"}])


def test_parsing_helpers():
    assert clean_name('Name: "Python keywords".\nbecause...') == "Python keywords"
    assert parse_votes("[1, 0, 1]", 3) == [1, 0, 1]
    with pytest.raises(LlmError, match="expected 3"):
        parse_votes("[1, 0]", 3)
    assert balanced_accuracy([1, 1, 0, 1], [1, 1, 0, 0]) == pytest.approx(0.75)
    assert balanced_accuracy([1, 1], [1, 1]) == pytest.approx(0.75)  # absent class counts as chance


def test_scorer_calls_stop_at_the_first_request_when_no_server_answers(tmp_path):
    import socket

    from conceptdict.naming.llm_calls import LlmCalls

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = LlmCalls(LlmConfig(url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout_s=1),
                     tmp_path / "cache.jsonl")
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(6)]
    with pytest.raises(LlmError, match=f"cannot reach the LLM server at http://127.0.0.1:{port}/v1/chat/completions"):
        calls.run(prompts)
    assert calls.usage.requests == 0 and calls.usage.failed == 0 and not (tmp_path / "cache.jsonl").exists()
