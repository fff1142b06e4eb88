"""Optional LLM namer for any OpenAI-compatible chat endpoint, using only the standard library (urllib).

For each latent that fires, the explainer sees its top contexts (activating token marked ``<<like this>>``)
and answers with a short name. The name is then scored by **detection** (delphi-style): a judge sees the name
and a shuffled mix of held-out activating contexts (the latent's quantile examples) and contexts where the
latent is 0, and marks each 1/0; the score is the balanced accuracy ``(TPR + TNR) / 2`` (0.5 = chance).

The endpoint is ``POST {url}/chat/completions`` with ``{"model", "messages", "temperature", "max_tokens"}``;
an API key, when the endpoint needs one, is read from the environment variable named by ``api_key_env``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from .concepts import Example
from .namers import NameResult, NamingInputs

log = logging.getLogger(__name__)


@dataclass
class LlmConfig:
    """Settings of the llm namer (``--llm.url`` ...)."""

    url: str = field(default="http://127.0.0.1:8000/v1", metadata={
        "help": "Base URL of an OpenAI-compatible API (the part before /chat/completions)."})
    model: str = field(default="default", metadata={"help": "Model name sent to the endpoint."})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "Environment variable holding the API key (sent as a Bearer token when set)."})
    timeout_s: float = field(default=60.0, metadata={"help": "Seconds to wait for one response."})
    max_retries: int = field(default=2, metadata={
        "help": "Retries of a failed request (connection errors, HTTP 429 and 5xx)."})
    n_explain: int = field(default=12, metadata={"help": "Top contexts shown to the explainer."})
    n_heldout: int = field(default=5, metadata={
        "help": "Activating and non-activating contexts each, shown to the judge for the detection score."})
    max_latents: int = field(default=0, metadata={
        "help": "Name at most this many firing latents (0: all); the rest stay unnamed."})
    max_tokens: int = field(default=64, metadata={"help": "Longest answer requested."})
    backoff_s: float = field(default=0.5, metadata={
        "help": "First wait before a retry (doubled each retry, at most 30 s; a 429's Retry-After wins)."})
    concurrency: int = field(default=4, metadata={"help": "Requests in flight at once (the scorers' bounded pool)."})
    n_shown: int = field(default=5, metadata={
        "help": "Examples per judge prompt of the detection and fuzzing scorers (delphi's n_examples_shown)."})
    n_scored: int = field(default=10, metadata={
        "help": ("Activating and non-activating examples each that the detection and fuzzing scorers judge per "
                 "latent.")})
    usd_per_1k_prompt: float = field(default=0.0, metadata={
        "help": "Price of 1000 prompt tokens, for the cost line of the summary (0: not counted)."})
    usd_per_1k_completion: float = field(default=0.0, metadata={"help": "Price of 1000 completion tokens."})

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"llm url {self.url!r} must start with http:// or https://")
        if self.max_retries < 0 or self.n_explain < 1 or self.n_heldout < 0:
            raise ValueError("llm max_retries >= 0, n_explain >= 1 and n_heldout >= 0 are required")
        if self.concurrency < 1 or self.n_shown < 1 or self.n_scored < 1:
            raise ValueError("llm concurrency, n_shown and n_scored must be >= 1")


class LlmError(ValueError):
    """The endpoint could not be reached or answered something unusable (one line, naming the URL and the fix)."""


class LlmUnreachable(LlmError):
    """No server answers at the URL (connection refused, unknown host, time-outs): every further request would fail
    the same way."""


class Reply(NamedTuple):
    """One chat completion: the assistant's text and the token counts the endpoint reported (0 if none)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


def chat(cfg: LlmConfig, messages: list[dict[str, str]]) -> str:
    """One chat completion; returns the assistant's text. Retries transient failures ``cfg.max_retries`` times."""
    return chat_reply(cfg, messages).text


def chat_reply(cfg: LlmConfig, messages: list[dict[str, str]]) -> Reply:
    """One chat completion with its token usage. Connection errors, time-outs, HTTP 429 and 5xx are retried
    ``cfg.max_retries`` times with exponential back-off (``cfg.backoff_s`` doubled each time, at most 30 s, or
    the server's ``Retry-After`` when it sends one); other HTTP errors and unusable bodies raise at once."""
    body = json.dumps(
        {"model": cfg.model, "messages": messages, "temperature": 0, "max_tokens": cfg.max_tokens}
    ).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(cfg.api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = cfg.url.rstrip("/") + "/chat/completions"
    last: Exception | None = None
    for attempt in range(cfg.max_retries + 1):
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        wait = min(cfg.backoff_s * 2**attempt, 30.0)
        try:
            with urllib.request.urlopen(req, timeout=cfg.timeout_s) as resp:
                doc = json.loads(resp.read().decode("utf-8"))
            usage = doc.get("usage") or {}
            return Reply(str(doc["choices"][0]["message"]["content"]), int(usage.get("prompt_tokens", 0)),
                         int(usage.get("completion_tokens", 0)))  # fmt: skip
        except urllib.error.HTTPError as e:
            last = e
            if e.code != 429 and e.code < 500:
                raise LlmError(f"{url} answered HTTP {e.code}: {e.read()[:200]!r}") from None
            wait = _retry_after(e, wait)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            last = e
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LlmError(f"{url} returned no choices[0].message.content: {e!r}") from None
        if attempt < cfg.max_retries:
            time.sleep(wait)
    tries = f"{cfg.max_retries + 1} attempt{'s' if cfg.max_retries else ''}"
    if isinstance(last, urllib.error.HTTPError):
        raise LlmError(f"{url} answered HTTP {last.code} after {tries}: the server is overloaded or "
                       "failing; wait and re-run, raise --llm.max-retries, or lower --llm.concurrency")
    reason = getattr(last, "reason", None) or last
    raise LlmUnreachable(f"cannot reach the LLM server at {url} ({reason}) after {tries}: start an OpenAI-compatible "
                   "server there (is the server running?), pass --llm.url of one, or name without an LLM "
                   "(--namer vocab, context or logit-lens)")


def _retry_after(e: urllib.error.HTTPError, default: float) -> float:
    try:
        return min(float(e.headers.get("Retry-After", default)), 30.0)
    except (TypeError, ValueError):
        return default


def explain_prompt(examples: Sequence[Example]) -> list[dict[str, str]]:
    lines = [f"{i + 1}. {e.marked_text()}" for i, e in enumerate(examples)]
    return [
        {
            "role": "system",
            "content": "You name features of a neural network. Answer with a short name (1-4 words) only.",
        },
        {
            "role": "user",
            "content": "These texts make the feature fire (strongest token marked <<like this>>):\n"
            + "\n".join(lines)
            + "\nName the concept they share.",
        },
    ]


def judge_prompt(name: str, texts: Sequence[str]) -> list[dict[str, str]]:
    lines = [f"{i + 1}. {t}" for i, t in enumerate(texts)]
    return [
        {"role": "system", "content": "You check whether texts contain a concept. Answer with a JSON list only."},
        {
            "role": "user",
            "content": f"Concept: {name}\nFor each numbered text answer 1 if it contains the concept, else 0.\n"
            + "\n".join(lines)
            + f"\nReply with a JSON list of {len(texts)} numbers, e.g. [1, 0, ...].",
        },
    ]


def clean_name(text: str) -> str:
    """First line of an answer, without quotes, labels or trailing punctuation, at most 60 characters."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"^(name|concept)\s*:\s*", "", line, flags=re.I).strip(" \"'`*.")
    return line[:60]


def parse_votes(text: str, n: int) -> list[int]:
    """The first ``n`` 0/1 votes in an answer; raises LlmError when fewer are present."""
    votes = [int(v) for v in re.findall(r"\b[01]\b", text)][:n]
    if len(votes) < n:
        raise LlmError(f"judge answered {text[:120]!r}: expected {n} votes of 0/1")
    return votes


def balanced_accuracy(votes: Sequence[int], truth: Sequence[int]) -> float:
    """(TPR + TNR) / 2 of 0/1 ``votes`` against 0/1 ``truth``; a class that is absent counts as 0.5."""
    pos = [v for v, t in zip(votes, truth) if t == 1]
    neg = [v for v, t in zip(votes, truth) if t == 0]
    tpr = sum(pos) / len(pos) if pos else 0.5
    tnr = (len(neg) - sum(neg)) / len(neg) if neg else 0.5
    return 0.5 * (tpr + tnr)


def detection_score(cfg: LlmConfig, name: str, pos: Sequence[Example], neg: Sequence[Example], seed: int) -> float:
    """Balanced accuracy of the judge telling ``pos`` from ``neg`` contexts given ``name``."""
    items = [(e.text, 1) for e in pos] + [(e.text, 0) for e in neg]
    if not items:
        return float("nan")
    random.Random(seed).shuffle(items)
    votes = parse_votes(chat(cfg, judge_prompt(name, [t for t, _ in items])), len(items))
    return balanced_accuracy(votes, [y for _, y in items])


@dataclass(frozen=True)
class LlmNamer:
    cfg: LlmConfig
    kind: str = "llm"

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        out: list[NameResult] = []
        done = 0
        for j, top in enumerate(inputs.top_examples):
            if not top or (self.cfg.max_latents and done >= self.cfg.max_latents):
                out.append(NameResult("", 0.0))
                continue
            name = clean_name(chat(self.cfg, explain_prompt(top[: self.cfg.n_explain])))
            held = _heldout(inputs, j, top, self.cfg)
            neg = tuple(inputs.negative_examples[j])[: self.cfg.n_heldout] if inputs.negative_examples else ()
            score = detection_score(self.cfg, name, held, neg, seed=inputs.first + j)
            out.append(NameResult(name, score, extra={"detection_n_pos": len(held), "detection_n_neg": len(neg)}))
            done += 1
        log.info("llm named %d latents", done)
        return out


def _heldout(inputs: NamingInputs, j: int, top: Sequence[Example], cfg: LlmConfig) -> tuple[Example, ...]:
    """Activating contexts the explainer did not see: the quantile examples, then unseen top examples."""
    shown = {e.row for e in top[: cfg.n_explain]}
    pool = list(inputs.heldout_examples[j]) if inputs.heldout_examples else []
    pool += list(top[cfg.n_explain :])
    return tuple(e for e in pool if e.row not in shown)[: cfg.n_heldout]
