"""The ``detection`` and ``fuzzing`` scorers (delphi's definitions) through the OpenAI-compatible client.

- **detection**: a judge sees the name and examples, some where the latent fires and some where it does not
  (the run's random and hard negatives), ``n_shown`` per prompt, and answers 1/0 per example: does the
  concept appear? Score = balanced accuracy ``(TPR + TNR) / 2``.
- **fuzzing**: every example has one token marked ``<<like this>>``: in activating examples the token the
  latent fires on, in non-activating ones the row's own token, where the latent was checked to be 0. The
  judge answers 1/0 per example: is the marked token an instance of the concept? Score = balanced accuracy.
  Departure from delphi, which marks a non-activating context at the positions of a random activating
  example: its negatives are whole contexts with no activation, ours are single rows verified to be 0 at
  exactly the marked token, so marking that token is the wrong marking by construction (a borrowed position
  can land on a token where the latent would fire). Sequence-level rows have no activating token; fuzzing
  skips them.

Answers that are not a JSON list of ``n`` 0/1 values (delphi: the first ``[...]`` in the answer) leave that
prompt's examples unjudged (``n_unjudged``); a latent with no judged example gets ``score: null``. Calls go
through :class:`~conceptdict.naming.llm_calls.LlmCalls` (bounded pool, retries, cache in
``<concept dir>/llm_cache.jsonl``), all latents' prompts at once.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Sequence

from .concepts import Example
from .llm import balanced_accuracy
from .llm_calls import LlmCalls
from .negatives import Sample
from .scoring import ScoringContext, register_scorer

_SYSTEM = "You check examples against a concept. Answer with a JSON list only."
_ASK = {
    "detection": "For each example answer 1 if it contains the concept, else 0.",
    "fuzzing": "In each example one token is marked <<like this>>. Answer 1 if the marked token is an instance "
    "of the concept, else 0.",
}


def llm_calls(ctx: ScoringContext) -> LlmCalls:
    """The run's one LlmCalls (shared by detection and fuzzing, so one usage counter and one cache)."""
    if "llm_calls" not in ctx.options:
        cache = ctx.workdir / "llm_cache.jsonl" if ctx.workdir is not None else None
        ctx.options["llm_calls"] = LlmCalls(ctx.cfg.llm, cache)
    return ctx.options["llm_calls"]


def judge_prompt(kind: str, name: str, texts: Sequence[str]) -> list[dict[str, str]]:
    lines = "\n".join(f"Example {i + 1}: {t}" for i, t in enumerate(texts))
    user = f"Concept: {name}\n{_ASK[kind]}\n{lines}\nReply with a JSON list of {len(texts)} numbers, e.g. [1, 0, ...]."
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def parse_judgement(text: str | None, n: int) -> list[int] | None:
    """The first ``[...]`` of an answer as ``n`` 0/1 values, or None when it is anything else."""
    m = re.search(r"\[.*?\]", text or "", flags=re.S)
    if m is None:
        return None
    try:
        values = json.loads(m.group(0))
    except ValueError:
        return None
    if not isinstance(values, list) or len(values) != n or any(v not in (0, 1) for v in values):
        return None
    return [int(v) for v in values]


def _mixed(negatives: Sequence[Example], kinds: Sequence[str], n: int) -> list[Example]:
    """Up to ``n`` negatives taken round-robin over their kinds, so every kind is represented."""
    by_kind: dict[str, list[Example]] = {}
    for e, k in zip(negatives, kinds):
        by_kind.setdefault(k, []).append(e)
    out: list[Example] = []
    while len(out) < n and any(by_kind.values()):
        for k in list(by_kind):
            if by_kind[k] and len(out) < n:
                out.append(by_kind[k].pop(0))
    return out


def judged_items(kind: str, sample: Sample, n: int, seed: int) -> list[tuple[str, int]] | None:
    """(text shown, 1 if the latent fires) per example, shuffled; None when ``kind`` cannot judge the sample."""
    rng = random.Random(seed)
    pos = list(sample.positives[::-1])[:n]  # quantile examples first: the whole activation range, not only the top
    neg = _mixed(sample.negatives, sample.kinds, n)
    if kind == "detection":
        items = [(e.text, 1) for e in pos] + [(e.text, 0) for e in neg]
    else:
        if not pos or any(e.marked < 0 for e in pos):
            return None
        items = [(e.marked_text(), 1) for e in pos] + [(e.marked_text(), 0) for e in neg if e.marked >= 0]
    rng.shuffle(items)
    return items


def _judge(kind: str, ctx: ScoringContext, names: dict[int, str]) -> dict[int, dict[str, Any]]:
    cfg = ctx.cfg.llm
    plans, prompts = {}, []
    ids = [j for j in names if names[j] and j in ctx.samples]
    for j in ids[: cfg.max_latents or None]:
        items = judged_items(kind, ctx.samples[j], cfg.n_scored, seed=j)
        if items is None:
            continue
        batches = [items[i : i + cfg.n_shown] for i in range(0, len(items), cfg.n_shown)]
        plans[j] = (len(prompts), batches)
        prompts += [judge_prompt(kind, names[j], [t for t, _ in b]) for b in batches]
    answers = llm_calls(ctx).run(prompts)
    out = {}
    for j, (first, batches) in plans.items():
        votes, truth, unjudged = [], [], 0
        for b, answer in zip(batches, answers[first : first + len(batches)]):
            parsed = parse_judgement(answer, len(b))
            if parsed is None:
                unjudged += len(b)
                continue
            votes += parsed
            truth += [y for _, y in b]
        score = balanced_accuracy(votes, truth) if votes else None
        out[j] = {"score": score, "balanced_accuracy": score, "n_pos": sum(y for b in batches for _, y in b),
                  "n_neg": sum(1 - y for b in batches for _, y in b), "n_unjudged": unjudged,
                  "negatives": ctx.cfg.negatives.kinds, "judge": cfg.model}  # fmt: skip
    return out


def detection_scorer(ctx: ScoringContext, names: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Balanced accuracy of an LLM judge telling activating from non-activating contexts given the name."""
    return _judge("detection", ctx, names)


def fuzzing_scorer(ctx: ScoringContext, names: dict[int, str]) -> dict[int, dict[str, Any]]:
    """Balanced accuracy of an LLM judge telling correctly from wrongly marked tokens given the name."""
    return _judge("fuzzing", ctx, names)


register_scorer("detection", detection_scorer)
register_scorer("fuzzing", fuzzing_scorer)
