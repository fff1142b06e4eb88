"""autointerp: SAEBench's detection protocol (0.6.0 ``evals/autointerp``) with the explainer and scorer the project
already drives (``naming.llm``: an OpenAI-compatible server, its answers cached on disk by ``naming.llm_calls``).

For each of ``latents`` latents drawn at random (seeded) from those firing on more than :data:`DEAD_LATENT_THRESHOLD`
of the store's first ``inputs.rows`` rows:

- **examples**: windows of ``2 * BUFFER + 1`` tokens of one context around a centre row (a sequence store: the row's
  whole text). The :data:`N_TOP` highest centres (no two windows overlapping), then :data:`N_IW` centres drawn without
  replacement with probability proportional to the squared activation among the centres below the lowest top one
  (SAEBench's stand-in for quantile sampling), then :data:`N_RANDOM` uniformly random centres. The top ones are split
  at random into :data:`N_TOP_GENERATION` for the explainer and the rest for scoring, the sampled ones likewise.
  A window is *active* when any of its tokens' activations exceeds ``ACT_THRESHOLD_FRAC`` of the top windows' largest.
- **explanation**: the explainer sees the generation windows, strongest first, each active token marked ``<<like
  this>>``, and answers one sentence (the part after "activates on" is kept).
- **scoring**: the scorer sees the explanation and the scoring windows (top, sampled and random, shuffled, unmarked)
  and answers the numbers of those where the latent fires; score = accuracy over the scoring windows (an answer that
  is not a list of numbers drops the latent, as SAEBench drops it). ``autointerp_score`` = the mean over latents,
  ``autointerp_std_dev`` their standard deviation.

The prompts are SAEBench's, word for word. Without an LLM server (``scorer="embedding"``, or ``"auto"`` when none
answers at the URL), the explanation is the ``context`` namer's (the terms over-represented in the generation windows
against the random ones) and the scorer is the sentence encoder: the windows most similar to the explanation, as many
as the scoring set's top and sampled ones, are predicted active. The summary then says ``"scorer": "embedding"``;
those scores are not SAEBench's and are not comparable with its published ones.

Settings (``inputs.options["autointerp"]``, from ``eval``'s flags): ``llm`` (a ``naming.llm.LlmConfig``), ``scorer``
(auto, llm or embedding), ``latents``, ``cache`` (the answers' JSONL file), ``embed`` (a ``TextEmbedder``; default the
packaged sentence encoder). Differences from SAEBench, said: the rows are the store's (tokens the store kept: no BOS),
not 2M freshly tokenized Pile tokens; windows never cross a context.
"""

from __future__ import annotations

import logging
import random
from typing import Any, NamedTuple

import torch

from conceptdict.naming.yardsticks import TooThin

from .autointerp_judges import judge

log = logging.getLogger(__name__)

SAEBENCH_TYPE = "autointerp"
BUFFER = 10
N_TOP_GENERATION, N_IW_GENERATION = 10, 5
N_TOP_SCORING, N_IW_SCORING, N_RANDOM = 2, 2, 10
N_TOP, N_IW = N_TOP_GENERATION + N_TOP_SCORING, N_IW_GENERATION + N_IW_SCORING
ACT_THRESHOLD_FRAC = 0.01
DEAD_LATENT_THRESHOLD = 15
"""A latent firing on this many rows or fewer is not drawn (SAEBench: over its 2M tokens)."""
LATENTS = 100
"""Latents explained and scored by default (SAEBench: 1000)."""
CHUNK = 8192


class Window(NamedTuple):
    """One example: its centre row, its tokens' activations, and whether any of them exceeds the threshold."""

    row: int
    acts: list[float]
    active: bool


class Selection(NamedTuple):
    """A latent's examples: for the explainer (strongest first) and for the scorer (shuffled)."""

    generation: list[Window]
    scoring: list[Window]
    threshold: float
    """Activations above it make a window active (and its tokens marked for the explainer)."""
    randoms: list[Window]
    """The random windows among ``scoring`` (the context namer's base rates without a server)."""


def centres(context: torch.Tensor, buffer: int) -> torch.Tensor:
    """[N] bool: rows whose ``buffer`` neighbours on each side lie in their own context (``context`` [N]: each row's
    context index, a context's rows contiguous)."""
    n = context.shape[0]
    ok = torch.zeros(n, dtype=torch.bool)
    if n > 2 * buffer:
        mid = context[buffer: n - buffer]
        ok[buffer: n - buffer] = (context[: n - 2 * buffer] == mid) & (context[2 * buffer:] == mid)
    return ok


def top_centres(acts: torch.Tensor, valid: torch.Tensor, k: int, buffer: int) -> list[int]:
    """The ``k`` valid rows of largest activation, no two within ``buffer`` rows of each other (SAEBench's
    ``get_k_largest_indices`` with ``no_overlap``); fewer when fewer fire."""
    order = torch.argsort(torch.where(valid, acts, torch.full_like(acts, -1.0)), descending=True, stable=True)
    out: list[int] = []
    for r in order.tolist():
        if not valid[r] or acts[r] <= 0:
            break
        if all(abs(r - s) > buffer for s in out):
            out.append(r)
            if len(out) == k:
                break
    return out


def select(acts: torch.Tensor, valid: torch.Tensor, gen: torch.Generator, buffer: int = BUFFER) -> Selection | None:
    """The protocol's examples of one latent (module docstring) from its activations ``acts`` [N] over the rows, the
    valid centres ``valid`` [N]; None when it has too few firing windows (SAEBench counts it dead)."""
    top = top_centres(acts, valid, N_TOP, buffer)
    if len(top) < N_TOP:
        return None
    def window(r: int) -> torch.Tensor:
        return acts[r - buffer: r + buffer + 1]

    threshold = ACT_THRESHOLD_FRAC * float(torch.stack([window(r) for r in top]).max())
    below = torch.where(valid & (acts < float(acts[top].min())), acts, torch.zeros_like(acts))
    if int((below > 1e-6).sum()) < N_IW:
        return None
    sampled = torch.multinomial(below.double().pow(2), N_IW, replacement=False, generator=gen).tolist()
    pool = torch.nonzero(valid).flatten()
    randoms = pool[torch.randint(0, pool.numel(), (N_RANDOM,), generator=gen)].tolist()
    top_split, iw_split = torch.randperm(N_TOP, generator=gen).tolist(), torch.randperm(N_IW, generator=gen).tolist()

    def make(rows: list[int]) -> list[Window]:
        return [Window(r, window(r).tolist(), bool((window(r) > threshold).any())) for r in rows]

    generation = make([top[i] for i in top_split[:N_TOP_GENERATION]] + [sampled[i] for i in iw_split[:N_IW_GENERATION]])
    generation.sort(key=lambda w: max(w.acts), reverse=True)
    scoring = make([top[i] for i in top_split[N_TOP_GENERATION:]] + [sampled[i] for i in iw_split[N_IW_GENERATION:]]
                   + randoms)
    order = torch.randperm(len(scoring), generator=gen).tolist()
    return Selection(generation, [scoring[i] for i in order], threshold, scoring[N_TOP_SCORING + N_IW_SCORING:])


def score_predictions(predictions: list[int], windows: list[Window]) -> float:
    """Accuracy of the predicted (1-based) numbers as "active" over ``windows`` (SAEBench's ``score_predictions``)."""
    return sum((i in predictions) == w.active for i, w in enumerate(windows, start=1)) / len(windows)


def _codes(sae, store, hookpoint: str, rows: int, latents: list[int] | None, device: str) -> torch.Tensor:
    """The dictionary's codes of the store's first ``rows`` rows [N, L] (only ``latents``' columns when given)."""
    out = []
    for start, x in store.iter_rows(hookpoint, CHUNK):
        x = x[: max(0, rows - start)]
        if x.shape[0] == 0:
            break
        with torch.no_grad():
            f = sae.encode(x.to(device).float()).float().cpu()
        out.append(f if latents is None else f[:, latents])
    return torch.cat(out)


def _contexts(store, n: int) -> torch.Tensor:
    """Each of the first ``n`` rows' context index [N] (a sequence store's rows are their own contexts)."""
    if store.level != "token":
        return torch.arange(n)
    if hasattr(store, "context_index"):
        return store.context_index(0, n).long()
    return torch.tensor([store.row_context(r, 0, 0).context_index for r in range(n)])


def choose_latents(fires: torch.Tensor, n: int, seed: int) -> list[int]:
    """``n`` latents drawn at random among those firing on more than :data:`DEAD_LATENT_THRESHOLD` rows (all of them
    when fewer), in drawn order (SAEBench's ``random.sample``)."""
    alive = torch.nonzero(fires > DEAD_LATENT_THRESHOLD).flatten().tolist()
    return alive if len(alive) <= n else random.Random(seed).sample(alive, n)


def compute(inputs) -> dict[str, Any]:
    """The autointerp score of ``inputs.dictionary`` on its store's first ``inputs.rows`` rows (module docstring)."""
    options = dict((getattr(inputs, "options", None) or {}).get("autointerp") or {})
    store, sae = inputs.store, inputs.dictionary
    buffer = BUFFER if store.level == "token" else 0
    fires = (_codes(sae, store, inputs.hookpoint, inputs.rows, None, inputs.device) > 0).sum(0)
    latents = choose_latents(fires, int(options.get("latents") or LATENTS), inputs.seed)
    codes = _codes(sae, store, inputs.hookpoint, inputs.rows, latents, inputs.device)
    valid = centres(_contexts(store, codes.shape[0]), buffer)
    gen = torch.Generator().manual_seed(inputs.seed)
    chosen = {j: select(codes[:, i], valid, gen, buffer) for i, j in enumerate(latents)}
    selections = {j: s for j, s in chosen.items() if s is not None}
    if not selections:
        raise TooThin(f"autointerp: none of the {len(chosen)} live latents drawn fires in {N_TOP} windows of "
                      f"{2 * buffer + 1} tokens that do not overlap (and below them in {N_IW} more) within the first "
                      f"{codes.shape[0]} rows: give it more rows (--rows) or a store of longer contexts")
    judged = judge(selections, store, inputs.hookpoint, buffer, options, inputs.seed, N_TOP_SCORING + N_IW_SCORING)
    scores = {j: score_predictions(r["predictions"], selections[j].scoring) for j, r in judged.latents.items()}
    values = torch.tensor(list(scores.values()), dtype=torch.float64)
    summary = {"autointerp_score": float(values.mean()) if len(values) else float("nan"),
               "autointerp_std_dev": float(values.std()) if len(values) > 1 else float("nan"),
               "n_latents_scored": len(scores), "n_latents_without_examples": len(chosen) - len(selections),
               "n_latents_unparsed": len(selections) - len(scores), "scorer": judged.scorer}
    details = {"latents": {str(j): {"explanation": r["explanation"], "predictions": r["predictions"],
                                    "correct seqs": [i for i, w in enumerate(selections[j].scoring, 1) if w.active],
                                    "score": scores[j]} for j, r in judged.latents.items()},
               "usage": judged.usage}
    out = {"summary": summary, "details": details}
    if judged.note:
        out["note"] = judged.note
    return out


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's AutoInterpEvalOutput layout: the score and its spread, the per-latent results unstructured."""
    s = result["summary"]
    return {"eval_type_id": SAEBENCH_TYPE, **about,
            "eval_result_metrics": {"autointerp": {"autointerp_score": s["autointerp_score"],
                                                   "autointerp_std_dev": s["autointerp_std_dev"]}},
            "eval_config": {**about.get("eval_config", {}), "autointerp_scorer": s["scorer"]},
            "eval_result_details": [], "eval_result_unstructured": result["details"]["latents"]}
