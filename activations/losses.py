"""Next-token losses of a causal LM with a component spliced in: CE and KL against the clean model (``eval``'s
CE loss recovered and KL score), on the positions that predict a real token."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .models import SENTENCE_HOOKPOINTS, ModelHandle, check_hookpoints


class SpliceLosses(NamedTuple):
    """Mean next-token CE with the hookpoint left alone / zeroed / replaced, and KL to the clean logits."""

    ce_clean: float
    ce_zero: float
    ce_replaced: float
    kl_zero: float
    kl_replaced: float


def spliced_losses(model: ModelHandle, hookpoint: str, tokens: torch.Tensor,
                   replace: Callable[[torch.Tensor], torch.Tensor],
                   attention_mask: torch.Tensor | None = None, source: str | None = None) -> SpliceLosses:
    """CE/KL of a causal LM when ``hookpoint`` [.., D] is kept, zero-ablated or mapped through ``replace``
    (which receives and returns [n, D] float32). tokens [N, T] int64. Positions whose input or target is
    BOS/pad/special are excluded. ``source``: the (earlier) hookpoint whose activation in the same forward
    ``replace`` receives instead of ``hookpoint``'s own (a transcoder reads a component's input and replaces
    its output)."""
    check_hookpoints(model, [hookpoint] + ([source] if source else []))
    if hookpoint in SENTENCE_HOOKPOINTS or not model.is_causal:
        raise ValueError(f"spliced_losses needs a causal LM and a token hookpoint; got {model.name} "
                         f"(causal={model.is_causal}) at {hookpoint!r}")
    tokens = tokens.to(model.device)
    mask = attention_mask.to(model.device) if attention_mask is not None else torch.ones_like(tokens)
    keep = loss_mask(model, tokens, mask)
    if not bool(keep.any()):
        raise ValueError("no scoreable positions: every next-token target is BOS/pad/special")

    seen: dict[str, torch.Tensor] = {}

    def run(edit, read_source=False):
        hooks = [] if edit is None else [(hookpoint, lambda t, hook: edit(t))]
        if read_source:
            hooks.insert(0, (source, lambda t, hook: seen.__setitem__("x", t)))
        with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
            return model.bridge(tokens, attention_mask=mask).float()[:, :-1]

    def zero(t):
        return torch.zeros_like(t)

    def swap(t):
        x = seen.pop("x") if source else t
        if x.shape[:-1] != t.shape[:-1]:
            raise ValueError(f"{source} has shape {list(x.shape)}, {hookpoint} {list(t.shape)}: a transcoder's two "
                             "hookpoints must cover the same tokens")
        flat = x.reshape(-1, x.shape[-1]).float()
        return replace(flat).to(t.dtype).reshape(t.shape)

    clean = run(None)
    targets = tokens[:, 1:]
    logp_clean = clean.log_softmax(-1)
    results = [next_token_ce(logp_clean, targets, keep)]
    kls = []
    for edit in (zero, swap):
        logits = run(edit, read_source=edit is swap and source is not None)
        results.append(next_token_ce(logits.log_softmax(-1), targets, keep))
        kls.append(next_token_kl(clean, logits, keep))
    return SpliceLosses(results[0], results[1], results[2], kls[0], kls[1])


def loss_mask(model: ModelHandle, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T-1] bool: predictions from a real input token to a real, non-special target token."""
    special = set(model.special_ids()) | set(getattr(model.tokenizer, "all_special_ids", None) or [])
    is_special = torch.zeros_like(tokens, dtype=torch.bool)
    for sid in special:
        is_special |= tokens == sid
    real = mask.bool()
    return real[:, :-1] & real[:, 1:] & ~is_special[:, 1:]


def next_token_ce(logp: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor) -> float:
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return nll[keep].mean().item()


def next_token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, keep: torch.Tensor, rows: int = 8) -> float:
    """Mean KL(softmax(logits_p) || softmax(logits_q)) [N, T, V] over the positions ``keep`` [N, T], in float64
    ``rows`` contexts at a time. In float32 the log-softmaxes' rounding (~eps32 x |log p|) dwarfs the KL of two
    nearly equal logit sets; in float64 the result is the KL of the given logits, which Hoeffding's lemma bounds by
    (max_i d_i - min_i d_i)^2 / 8 <= max|d|^2 / 2 for d = logits_q - logits_p at each position."""
    total = 0.0
    for s in range(0, logits_p.shape[0], rows):
        lp = logits_p[s : s + rows].double().log_softmax(-1)
        lq = logits_q[s : s + rows].double().log_softmax(-1)
        total += float((lp.exp() * (lp - lq)).sum(-1)[keep[s : s + rows]].sum())
    return total / max(int(keep.sum()), 1)
