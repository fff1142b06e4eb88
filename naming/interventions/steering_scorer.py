"""The ``steering`` scorer of ``conceptdict score``: issue 15's intervention score, over
:func:`naming.steerability.steerability` (issue 17's measurement).

Per scored latent it stores steerability's metrics (``effect_per_alpha``, ``damage``,
``random_effect_per_alpha``, ``ratio``, ``alpha_max`` and, for causal LMs, ``name_effect_per_alpha``) and the
headline ``score = ratio / (1 + ratio)`` clipped to [0, 1]: 0.5 when adding the latent's decoder row moves the
output toward its name no more than a random direction of the same norm does, 0.6 at a ratio of 1.5 (CB-SAE's
default ``min_steerability``), 0.9 at a ratio of 9, 0 when it moves the output away from the name.

The inputs steered are the run's base examples (random store rows, the texts the negatives come from), at most
``texts`` of them (``ctx.options["steering_texts"]``, default 32); the model is the one the store was cached
with (``ctx.options["model"]`` overrides it). Cost: (1 + n_random) x len(alphas) forward passes over those texts
per latent, so ``--max-latents`` bounds a first look at a large dictionary.
"""

from __future__ import annotations

import math
from typing import Any

from conceptdict.naming.pipeline import model_id_of, model_loader
from conceptdict.naming.scoring import ScoringContext, register_scorer
from conceptdict.naming.interventions.steerability import ALPHAS, steerability

TEXTS = 32
"""Inputs steered per run (the demo's sentence dictionary: 32 docstrings)."""


def headline(ratio: float) -> float:
    """ratio / (1 + ratio) in [0, 1] (0 for a negative or undefined ratio)."""
    if not math.isfinite(ratio) or ratio <= 0:
        return 0.0
    return ratio / (1.0 + ratio)


def steering_scorer(ctx: ScoringContext, names: dict[int, str]) -> dict[int, dict[str, Any]]:
    src = ctx.sources
    if src is None:
        raise ValueError("the steering scorer needs the dictionary, its store and its model; pass --sae-dir DICT_DIR")
    model_name = ctx.options.get("model") or model_id_of(src.store)
    model = model_loader(model_name, ctx.cfg.device)()
    texts = [e.text for e in ctx.options.get("base_examples", ())][: int(ctx.options.get("steering_texts", TEXTS))]
    if not texts:
        raise ValueError("the steering scorer found no store rows to steer (the run drew no base examples)")
    ids = sorted(names)
    found = steerability(src.model, model, src.hookpoint, ids, [names[j] for j in ids], texts,
                         alphas=ctx.options.get("steering_alphas", ALPHAS))
    return {j: dict(m, score=headline(m["ratio"]), texts=len(texts)) for j, m in found.items()}


register_scorer("steering", steering_scorer)
