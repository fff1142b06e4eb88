"""Steerability of named latents (issue 15's intervention scorer): add ``alpha * d_j`` at the dictionary's
hookpoint and measure whether the model's output moves toward the latent's name.

:func:`steerability` returns, per latent, ``{metric: value}`` for the concept dictionary's ``scores`` (under
the scorer name ``"steerability"``):

- **causal LMs** (token hookpoint): over every position of the given ``texts``, the shift of
  ``log p(T) = logsumexp_{t in T} log p(t)`` for T = the latent's top promoted tokens (the ``promoted`` tokens
  of ``d_j W_U``) and for T = the first token of the name (with and without a leading space).
  ``effect_per_alpha`` is the least-squares slope through the origin of the promoted-token shift over the
  ``alphas``; ``name_effect_per_alpha`` the same for the name's tokens; ``damage`` is the mean KL(clean ||
  steered) at the largest alpha over the tokens *other than* the targets (both distributions renormalised
  over them).
- **sentence encoders**: the shift in cosine between the steered sentence embedding and the embedding of the
  name (the model's own ``sentence.mean_normalized``); ``effect_per_alpha`` is its slope over the alphas and
  ``damage`` is ``1 - cos(steered, original)`` at the largest alpha.

Both report ``random_effect_per_alpha``: the mean absolute slope of the same effect for ``n_random`` random
directions of the norm of ``d_j`` (what a direction of that length does by chance), and ``ratio`` =
``effect_per_alpha / random_effect_per_alpha``. ``alpha_max`` records the largest alpha.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from conceptdict.activations.intervene import SentenceSteerer, edited_logits, encode_prompts, steered_embeddings
from conceptdict.activations.models import SENTENCE_HOOKPOINTS
from conceptdict.naming.interventions.steer import random_direction

ALPHAS = (1.0, 2.0, 4.0)
"""Default alphas, in code units: the added vector is alpha * d_j with d_j the decoder row in raw activation
units (unit norm for a dictionary trained on raw rows, 1 / scale for one trained on scaled rows)."""


def _slope(alphas: Sequence[float], effects: Sequence[float]) -> float:
    a = torch.tensor(alphas, dtype=torch.float64)
    return float((a * torch.tensor(effects, dtype=torch.float64)).sum() / a.square().sum())


def _adder(vector: Tensor):
    return lambda x: x + vector.to(x.device, x.dtype)


def _sentence_effects(steer: SentenceSteerer, goal: Tensor, base: Tensor, direction: Tensor,
                      alphas: Sequence[float]) -> tuple[list[float], float]:
    effects, damage = [], 0.0
    for a in alphas:
        steered = steer(_adder(a * direction))
        effects.append(float((steered @ goal - base @ goal).mean()))
        damage = float(1 - torch.nn.functional.cosine_similarity(steered, base).mean())
    return effects, damage


def _target_logp(logp: Tensor, targets: list[int]) -> Tensor:
    return logp[..., targets].logsumexp(-1)


def _lm_effects(model, hookpoint: str, ids: Tensor, mask: Tensor, clean: Tensor, direction: Tensor,
                alphas: Sequence[float], sets: list[list[int]]) -> tuple[list[list[float]], float]:
    keep = mask.bool()
    per_set: list[list[float]] = [[] for _ in sets]
    damage = 0.0
    for a in alphas:
        logp = edited_logits(model, ids, mask, hookpoint, _adder(a * direction)).log_softmax(-1)
        for s, targets in enumerate(sets):
            shift = _target_logp(logp, targets) - _target_logp(clean, targets)
            per_set[s].append(float(shift[keep].mean()))
        other = torch.ones(clean.shape[-1], dtype=torch.bool)
        other[[t for ts in sets for t in ts]] = False
        p, q = clean[..., other].log_softmax(-1), logp[..., other].log_softmax(-1)
        damage = float((p.exp() * (p - q)).sum(-1)[keep].mean())
    return per_set, damage


def _name_tokens(model, name: str) -> list[int]:
    ids = set()
    for variant in (name, " " + name):
        got = model.tokenizer(variant, add_special_tokens=False)["input_ids"] if name else []
        if got:
            ids.add(int(got[0]))
    return sorted(ids)


def steerability(dictionary, model, hookpoint: str, latents: Sequence[int], names: Sequence[str],
                 texts: Sequence[str], *, alphas: Sequence[float] = ALPHAS, n_random: int = 4, promoted: int = 5,
                 seed: int = 0) -> dict[int, dict[str, float]]:
    """Per latent ``{"effect_per_alpha", "damage", "random_effect_per_alpha", "ratio", "alpha_max", ...}`` (see
    the module docstring). ``names[i]`` is the name of ``latents[i]``; ``texts`` are the inputs steered."""
    if len(names) != len(latents):
        raise ValueError(f"{len(latents)} latents but {len(names)} names; pass one name per latent")
    if not texts:
        raise ValueError("steerability needs input texts to steer")
    dirs = dictionary.decoder_directions().float().cpu()
    causal = model.is_causal and hookpoint not in SENTENCE_HOOKPOINTS
    out: dict[int, dict[str, float]] = {}
    if causal:
        W_U = model.unembed()
        if W_U is None:
            raise ValueError(f"model {model.name} has no unembedding; steerability of a causal LM needs one")
        ids, mask = encode_prompts(model, texts)
        clean = edited_logits(model, ids, mask, hookpoint, None).log_softmax(-1)
    else:
        steer = SentenceSteerer(model, texts, hookpoint)
        base = steer(None)
    for j, name in zip(latents, names):
        d = dirs[j]
        rand = [random_direction(d, seed + 7919 * r + j) for r in range(n_random)]
        if causal:
            top = (d @ W_U.to(d.dtype)).topk(promoted).indices.tolist()
            sets = [top] + ([_name_tokens(model, name)] if _name_tokens(model, name) else [])
            effects, damage = _lm_effects(model, hookpoint, ids, mask, clean, d, alphas, sets)
            rec = {"effect_per_alpha": _slope(alphas, effects[0]), "damage": damage,
                   "name_effect_per_alpha": _slope(alphas, effects[1]) if len(sets) > 1 else float("nan")}
            chance = [abs(_slope(alphas, _lm_effects(model, hookpoint, ids, mask, clean, r, alphas, sets[:1])[0][0]))
                      for r in rand]
        else:
            goal = steered_embeddings(model, [name], hookpoint, None)[0]
            effects, damage = _sentence_effects(steer, goal, base, d, alphas)
            rec = {"effect_per_alpha": _slope(alphas, effects), "damage": damage}
            chance = [abs(_slope(alphas, _sentence_effects(steer, goal, base, r, alphas)[0]))
                      for r in rand]
        control = sum(chance) / len(chance) if chance else float("nan")
        rec.update(random_effect_per_alpha=control, alpha_max=float(max(alphas)),
                   ratio=rec["effect_per_alpha"] / control if control > 0 else float("nan"))
        out[int(j)] = rec
    return out
