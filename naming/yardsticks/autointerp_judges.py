"""The explainer and the scorer of the autointerp yardstick (``autointerp.py`` selects the examples): SAEBench's
prompts through the project's cached LLM client, or, without a server, the context namer and the embedding scorer."""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, NamedTuple

import torch

from ..concepts import Example, display_tokens
from ..evidence import ContextCache
from ..llm import LlmConfig, LlmUnreachable
from ..llm_calls import LlmCalls

log = logging.getLogger(__name__)

SCORERS = ("auto", "llm", "embedding")
EXPLANATION_TOKENS = 30
"""SAEBench's ``max_tokens_in_explanation``."""
ENCODER, ENCODER_HOOKPOINT = "default", "sentence.mean_normalized"
"""The embedding scorer's sentence encoder (the packaged all-MiniLM-L6-v2, as ``score``'s default); on a store cached
with it (the demo's) the windows' vectors are their rows, not embedded again."""
SEQUENCE_TOKENS = 128
"""A sequence store's input is shown up to its ``context_length`` tokens (this many when it records none)."""

GENERATION_SYSTEM = (
    "We're studying neurons in a neural network. Each neuron activates on some particular word/words/substring/"
    "concept in a short document. The activating words in each document are indicated with << ... >>. We will give "
    "you a list of documents on which the neuron activates, in order from most strongly activating to least strongly "
    "activating. Look at the parts of the document the neuron activates for and summarize in a single sentence what "
    "the neuron is activating on. Try not to be overly specific in your explanation. Note that some neurons will "
    "activate only on specific words or substrings, but others will activate on most/all words in a sentence provided "
    "that sentence contains some particular concept. Your explanation should cover most or all activating words (for "
    "example, don't give an explanation which is specific to a single word if all words in a sentence cause the "
    "neuron to activate). Pay attention to things like the capitalization and punctuation of the activating words or "
    "concepts, if that seems relevant. Keep the explanation as short and simple as possible, limited to 20 words or "
    "less. Omit punctuation and formatting. You should avoid giving long lists of words. Some examples: \"This neuron "
    "activates on the word 'knows' in rhetorical questions\", and \"This neuron activates on verbs related to "
    "decision-making and preferences\", and \"This neuron activates on the substring 'Ent' at the start of words\", "
    "and \"This neuron activates on text about government economic policy\".")
"""SAEBench 0.6.0's explainer system prompt (``use_demos_in_explanation=True``), word for word."""


def scoring_system(n: int, example: str) -> str:
    """SAEBench 0.6.0's scorer system prompt for ``n`` examples, word for word."""
    return (f"We're studying neurons in a neural network. Each neuron activates on some particular word/words/"
            f"substring/concept in a short document. You will be given a short explanation of what this neuron "
            f"activates for, and then be shown {n} example sequences in random order. You will have to return a "
            f"comma-separated list of the examples where you think the neuron should activate at least once, on ANY "
            f"of the words or substrings in the document. For example, your response might look like \"{example}\". "
            f"Try not to be overly specific in your interpretation of the explanation. If you think there are no "
            f"examples where the neuron will activate, you should just respond with \"None\". You should include "
            f"nothing else in your response other than comma-separated numbers or the word \"None\" - this is "
            f"important.")


def generation_prompt(texts: list[str]) -> list[dict[str, str]]:
    lines = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(texts))
    return [{"role": "system", "content": GENERATION_SYSTEM},
            {"role": "user", "content": f"The activating documents are given below:\n\n{lines}"}]


def scoring_prompt(explanation: str, texts: list[str], n_correct: int, rng: random.Random) -> list[dict[str, str]]:
    example = ", ".join(str(i) for i in sorted(rng.sample(range(1, 1 + len(texts)), k=n_correct)))
    lines = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(texts))
    return [{"role": "system", "content": scoring_system(len(texts), example)},
            {"role": "user", "content": f"Here is the explanation: this neuron fires on {explanation}.\n\n"
                                        f"Here are the examples:\n\n{lines}"}]


def parse_explanation(text: str) -> str:
    """The part of an answer after its last "activates on", without the final full stop (SAEBench)."""
    return text.split("activates on")[-1].rstrip(".").strip()


def parse_predictions(text: str) -> list[int] | None:
    """The numbers of a "1, 4 and 7" / "None" answer; None when it holds anything else (SAEBench)."""
    parts = [p.strip() for p in text.strip().rstrip(".").replace("and", ",").replace("None", "").split(",")]
    parts = [p for p in parts if p]
    if not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


class Judged(NamedTuple):
    """Per judged latent {"explanation", "predictions"}; which scorer; the LLM usage; why not SAEBench's judge."""

    latents: dict[int, dict[str, Any]]
    scorer: str
    usage: dict[str, int]
    note: str | None = None


def window_text(contexts: ContextCache, window, threshold: float | None) -> tuple[str, Example]:
    """A window as the prompts show it (``threshold``: tokens above it marked ``<<tok>>``) and as an Example
    (``contexts``: the store's row contexts, ``buffer`` tokens each side)."""
    store, buffer = contexts.store, contexts.before
    ctx = contexts.context(window.row)
    if store.level != "token":  # the input's text, cut to the tokens the store's model read
        limit = int(store.manifest.get("context_length") or SEQUENCE_TOKENS)
        text = ctx.text if len(ctx.tokens) <= limit else "".join(display_tokens(ctx.tokens[:limit])).strip()
        return text.replace("\n", "↵"), Example(window.row, max(window.acts), tuple(ctx.tokens[:limit]), -1, text)
    pieces = display_tokens(ctx.tokens)
    if threshold is not None:
        pieces = [f"<<{t}>>" if a > threshold else t for t, a in zip(pieces, window.acts)]
    return "".join(pieces).replace("\n", "↵"), Example(window.row, max(window.acts), tuple(ctx.tokens), buffer,
                                                        ctx.text)


def judge(selections: dict, store, hookpoint: str, buffer: int, options: dict[str, Any], seed: int,
          n_correct: int) -> Judged:
    """Explain and score every selected latent (``autointerp.Selection``): through the LLM (``options["scorer"]`` llm
    or auto), else (embedding, or auto when no server answers) the context namer and the sentence encoder.
    ``n_correct``: the activating windows the scoring set was built with (the scorer prompt's example answer has as
    many numbers; the embedding scorer predicts as many)."""
    mode = options.get("scorer") or "auto"
    if mode not in SCORERS:
        raise ValueError(f"autointerp scorer {mode!r}: choose one of {', '.join(SCORERS)}")
    cfg = options.get("llm") or LlmConfig()
    contexts = ContextCache(store, buffer, buffer)
    note = None
    if mode != "embedding":
        try:
            return _by_llm(selections, contexts, cfg, options.get("cache"), seed, n_correct)
        except LlmUnreachable:
            if mode == "llm":
                raise
            note = (f"scorer embedding: no LLM server answers at {cfg.url} (start one, or pass --llm.url); explained "
                    f"by the context namer, scored by the sentence encoder: not comparable with SAEBench's LLM-judged "
                    f"scores")
            log.warning("autointerp: %s", note)
    return _by_embedding(selections, contexts, hookpoint, options.get("embed"), n_correct, note or
                         "scorer embedding (asked for): not comparable with SAEBench's LLM-judged scores")


def _by_llm(selections: dict, contexts: ContextCache, cfg: LlmConfig, cache, seed: int, n_correct: int) -> Judged:
    ids = list(selections)
    explain = LlmCalls(dataclasses.replace(cfg, max_tokens=EXPLANATION_TOKENS), cache)
    answers = explain.run([generation_prompt([window_text(contexts, w, selections[j].threshold)[0]
                                              for w in selections[j].generation]) for j in ids])
    explained = {j: parse_explanation(a) for j, a in zip(ids, answers) if a is not None}
    scored_ids = list(explained)
    prompts = []
    for j in scored_ids:
        texts = [window_text(contexts, w, None)[0] for w in selections[j].scoring]
        prompts.append(scoring_prompt(explained[j], texts, n_correct, random.Random(seed * 1_000_003 + j)))
    score = LlmCalls(dataclasses.replace(cfg, max_tokens=2 * max((len(selections[j].scoring) for j in ids),
                                                                  default=0) + 5), cache)
    out = {}
    for j, answer in zip(scored_ids, score.run(prompts)):
        predictions = parse_predictions(answer) if answer is not None else None
        if predictions is not None:
            out[j] = {"explanation": explained[j], "predictions": predictions}
    usage = {k: getattr(explain.usage, k) + getattr(score.usage, k) for k in ("requests", "cached", "failed")}
    return Judged(out, "llm", usage)


def _by_embedding(selections: dict, contexts: ContextCache, hookpoint: str, embed, n_correct: int,
                  note: str) -> Judged:
    from ..namers import context_names
    from ..scoring import model_embedder, store_rows_are

    store = contexts.store
    rows = embed is None and store_rows_are(store, hookpoint, ENCODER, ENCODER_HOOKPOINT)
    embed = embed or model_embedder(ENCODER, ENCODER_HOOKPOINT)
    ids = list(selections)
    base = [window_text(contexts, w, None)[1] for j in ids for w in selections[j].randoms]
    names = context_names([tuple(window_text(contexts, w, None)[1] for w in selections[j].generation)
                           for j in ids], base, n_runner_ups=0)
    texts = {j: [window_text(contexts, w, None)[0] for w in selections[j].scoring] for j in ids}
    embed([t for j, n in zip(ids, names) if n.name and not rows for t in texts[j]] + [n.name for n in names if n.name])
    out = {}
    for j, named in zip(ids, names):
        if not named.name:
            continue
        vectors = _row_vectors(store, hookpoint, [w.row for w in selections[j].scoring]) if rows else embed(texts[j])
        sims = vectors @ embed([named.name])[0]
        top = torch.argsort(sims, descending=True, stable=True)[:n_correct]
        out[j] = {"explanation": named.name, "predictions": sorted(int(i) + 1 for i in top)}
    return Judged(out, "embedding", {}, note)


def _row_vectors(store, hookpoint: str, rows: list[int]) -> torch.Tensor:
    """Unit store rows [n, D]: the encoder's embeddings of those inputs when the store was cached with it."""
    x = torch.cat([store.rows(hookpoint, r, r + 1) for r in rows]).float()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
