"""LLM calls at scale: a bounded pool of concurrent requests, a response cache on disk, and a usage counter.

``LlmCalls(cfg, cache_path).run(prompts)`` answers a list of chat prompts. Each prompt's key is the sha256 of
(model, max_tokens, messages); answers already in the cache (a JSONL file, one ``{"key", "text", ...}`` per
line, appended and flushed as each answer arrives) are not requested again, so a rerun costs nothing and a
run killed halfway resumes where it stopped: at most the requests in flight at the kill are repeated, never a
prompt whose answer was stored. A request that still fails after ``chat_reply``'s retries is returned as None
and not cached (the next run retries it); the run goes on. The first request goes alone: when no server answers
at the URL at all, the run stops there with ``LlmUnreachable`` (one line) instead of failing every request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .llm import LlmConfig, LlmError, LlmUnreachable, Reply, chat_reply

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


def prompt_key(cfg: LlmConfig, messages: Messages) -> str:
    """The cache key of a prompt: sha256 of the model, max_tokens and messages."""
    doc = json.dumps({"model": cfg.model, "max_tokens": cfg.max_tokens, "messages": messages}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


@dataclass
class Usage:
    """What a run asked for and what it cost."""

    requests: int = 0
    """Requests answered by the endpoint in this run."""
    cached: int = 0
    """Prompts answered from the cache."""
    failed: int = 0
    """Prompts that failed after every retry (not cached; retried by the next run)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def cost(self, cfg: LlmConfig) -> float:
        return (self.prompt_tokens * cfg.usd_per_1k_prompt + self.completion_tokens * cfg.usd_per_1k_completion) / 1e3

    def line(self, cfg: LlmConfig) -> str:
        return (f"llm: {self.requests} requests, {self.cached} cached, {self.failed} failed; "
                f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens; "
                f"${self.cost(cfg):.4f}")  # fmt: skip


class LlmCalls:
    """Concurrent, cached chat completions (module docstring)."""

    def __init__(self, cfg: LlmConfig, cache_path: Path | None) -> None:
        self.cfg, self.cache_path = cfg, cache_path
        self.usage = Usage()
        self._lock = threading.Lock()
        self._cache: dict[str, str] = _read_cache(cache_path) if cache_path else {}

    def run(self, prompts: Sequence[Messages]) -> list[str | None]:
        """The answer to each prompt (None where the request failed), in order."""
        keys = [prompt_key(self.cfg, m) for m in prompts]
        todo = {k: m for k, m in zip(keys, prompts) if k not in self._cache}
        self.usage.cached += sum(1 for k in keys if k in self._cache)
        if todo:
            first = next(iter(todo))  # asked alone first: an unreachable server stops the run with one line
            if self._ask(todo.pop(first), unreachable_raises=True) is None:
                self.usage.failed += 1
            with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
                for key, reply in zip(todo, pool.map(self._ask, todo.values())):
                    if reply is None:
                        self.usage.failed += 1
        return [self._cache.get(k) for k in keys]

    def _ask(self, messages: Messages, unreachable_raises: bool = False) -> Reply | None:
        try:
            reply = chat_reply(self.cfg, messages)
        except LlmError as e:
            if unreachable_raises and isinstance(e, LlmUnreachable):
                raise
            log.warning("llm request failed: %s", e)
            return None
        self._store(prompt_key(self.cfg, messages), reply)
        return reply

    def _store(self, key: str, reply: Reply) -> None:
        with self._lock:
            self._cache[key] = reply.text
            self.usage.requests += 1
            self.usage.prompt_tokens += reply.prompt_tokens
            self.usage.completion_tokens += reply.completion_tokens
            if self.cache_path is None:
                return
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache_path, "a") as fh:
                fh.write(json.dumps({"key": key, "text": reply.text, "prompt_tokens": reply.prompt_tokens,
                                     "completion_tokens": reply.completion_tokens}) + "\n")  # fmt: skip
                fh.flush()
                os.fsync(fh.fileno())


def _read_cache(path: Path) -> dict[str, str]:
    """Answers stored by earlier runs; a torn last line (a kill mid-write) is skipped."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines()):
        try:
            doc = json.loads(line)
            out[doc["key"]] = doc["text"]
        except (ValueError, KeyError, TypeError):
            log.warning("%s line %d is not a complete cache entry; ignored (it will be asked again)", path, n + 1)
    return out
