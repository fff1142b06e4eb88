"""Forward passes with an edit at one hookpoint: logits, generation and sentence embeddings of a steered model.

An ``edit`` maps the hookpoint's activations ``[n, D]`` float32 to edited ones of the same shape (a steering
vector, a latent clamp, an eraser); the hook reshapes ``[b, T, D]`` for it and casts back. ``edit=None`` runs the
model unchanged. Prompts are tokenised as the cache tokenises a document (the tokenizer's special tokens, a BOS
for causal LMs that have one: ``data.special_wrapping``), so steering sees the positions a store holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from conceptdict.activations.models import ModelHandle, check_hookpoints, embed_texts, mean_pool, model_label

Edit = Callable[[Tensor], Tensor]


def encode_prompts(model: ModelHandle, texts: Sequence[str], max_length: int = 128) -> tuple[Tensor, Tensor]:
    """(ids [N, T] right-padded, attention mask [N, T]) with the model's special-token wrapping
    (``model.to_tokens``)."""
    return tuple(model.to_tokens(texts, return_mask=True, max_length=max_length))


def _hook(edit: Edit):
    def hook(tensor, hook):  # [b, T, ...]: the edit sees the store's rows [b * T, D], D the trailing axes flattened
        flat = tensor.reshape(tensor.shape[0] * tensor.shape[1], -1).float()
        return edit(flat).to(tensor.dtype).reshape(tensor.shape)

    return hook


def edited_logits(model: ModelHandle, ids: Tensor, mask: Tensor, hookpoint: str, edit: Edit | None) -> Tensor:
    """[N, T, V] float32 logits of a causal LM with ``edit`` applied at ``hookpoint`` (every position)."""
    check_hookpoints(model, [hookpoint])
    if model.level(hookpoint) == "sequence" or not model.is_causal:
        raise ValueError(f"steering logits needs a causal LM and a token hookpoint; got {model.name} "
                         f"(causal={model.is_causal}) at {hookpoint!r}")
    hooks = [] if edit is None else [(hookpoint, _hook(edit))]
    with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
        return model.bridge(ids.to(model.device), attention_mask=mask.to(model.device)).float().cpu()


def generate(model: ModelHandle, prompt: str, hookpoint: str, edit: Edit | None, max_new_tokens: int = 20,
             temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Continuation token ids of ``prompt``: greedy at temperature 0, else sampled with a seeded generator (the
    same seed with and without the edit, so the two runs differ only by the edit)."""
    ids, mask = encode_prompts(model, [prompt])
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = edited_logits(model, ids, mask, hookpoint, edit)[0, -1]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
    return out


class SentenceSteerer:
    """Steered sentence embeddings of fixed ``texts``; for a sentence hookpoint the texts are embedded once and
    each edit acts on the pooled embedding, for a token hookpoint every call runs the edited forward."""

    def __init__(self, model: ModelHandle, texts: Sequence[str], hookpoint: str, batch_size: int = 64) -> None:
        check_hookpoints(model, [hookpoint])
        self.model, self.texts, self.hookpoint, self.batch_size = model, list(texts), hookpoint, batch_size
        self.raw = (embed_texts(model, self.texts, hookpoint, batch_size=batch_size)
                    if model.level(hookpoint) == "sequence" else None)

    def __call__(self, edit: Edit | None) -> Tensor:
        """[N, D] L2-normalised embeddings with ``edit`` applied (None: unchanged)."""
        if self.raw is None:
            return steered_embeddings(self.model, self.texts, self.hookpoint, edit, self.batch_size)
        x = self.raw if edit is None else edit(self.raw)
        return torch.nn.functional.normalize(x, dim=-1)


def steered_embeddings(model: ModelHandle, texts: Sequence[str], hookpoint: str, edit: Edit | None,
                       batch_size: int = 64) -> Tensor:
    """[N, D] sentence embeddings (``sentence.mean_normalized``) with ``edit`` at ``hookpoint``: for a sentence
    hookpoint the edit acts on the pooled embedding itself, for a token hookpoint inside the forward."""
    check_hookpoints(model, [hookpoint])
    if model.level(hookpoint) == "sequence":
        x = embed_texts(model, list(texts), hookpoint, batch_size=batch_size)
        x = x if edit is None else edit(x)
        return torch.nn.functional.normalize(x, dim=-1)
    out = []
    for i in range(0, len(texts), batch_size):
        ids, mask = encode_prompts(model, texts[i:i + batch_size])
        got: dict[str, Tensor] = {}

        def grab(tensor, hook):
            got["h"] = tensor.detach()

        hooks = ([] if edit is None else [(hookpoint, _hook(edit))]) + [(model.sentence_source, grab)]
        with torch.inference_mode(), model.bridge.hooks(fwd_hooks=hooks):
            model.bridge(ids.to(model.device), attention_mask=mask.to(model.device))
        pooled = mean_pool(got["h"].float(), mask.to(got["h"].device))
        out.append(torch.nn.functional.normalize(pooled, dim=-1).cpu())
    return torch.cat(out)


def dictionary_hookpoint(dictionary: Any) -> str | None:
    """The hookpoint a dictionary reads, from its config (``config["hookpoints"][0]`` or ``config["hookpoint"]``),
    or None when it records none."""
    config = getattr(dictionary, "config", None) or {}
    return (config.get("hookpoints") or [config.get("hookpoint")])[0]


def by_hookpoint(saes: Any) -> dict[str, Any]:
    """``{hookpoint: dictionary}`` of a dictionary, a list of them (each at :func:`dictionary_hookpoint`) or such a
    mapping already."""
    if isinstance(saes, Mapping):
        return dict(saes)
    out = {}
    for sae in ([saes] if hasattr(saes, "encode") else list(saes)):
        hookpoint = dictionary_hookpoint(sae)
        if hookpoint is None:
            raise ValueError(f"dictionary {type(sae).__name__} records no hookpoint in its config; pass "
                             "saes={hookpoint: dictionary}")
        if hookpoint in out:
            raise ValueError(f"two dictionaries read {hookpoint}; splice one per hookpoint")
        out[hookpoint] = sae
    return out


def dictionary_edits(dictionaries: Mapping[str, Any], edits: Mapping[str, Edit] | None = None,
                     codes: dict[str, Tensor] | None = None) -> dict[str, Edit]:
    """The edit of activations [n, D] that splices each dictionary in at its hookpoint: ``edits[hookpoint]`` where
    given (``naming.interventions.steer.dictionary_edit``: clamps, additions), else the reconstruction. With
    ``codes``, each dictionary's codes [n, L] of the activations it reads are put there, by hookpoint."""
    for hookpoint, sae in dictionaries.items():
        if getattr(sae, "n_sources", 1) != 1:
            raise ValueError(f"the dictionary at {hookpoint} is a crosscoder ({sae.n_sources} sources): it "
                             "reconstructs several models at once; splice a single-source dictionary")
    return {hp: _splice_edit(hp, sae, (edits or {}).get(hp), codes) for hp, sae in dictionaries.items()}


def _splice_edit(hookpoint: str, sae: Any, inner: Edit | None, codes: dict[str, Tensor] | None) -> Edit:
    def edit(x: Tensor) -> Tensor:
        device = sae.device
        with torch.no_grad():
            if codes is not None:
                codes[hookpoint] = sae.encode(x.to(device))
            return inner(x) if inner is not None else sae(x.to(device)).to(x.device)

    return edit


def spliced(model: ModelHandle, edits: Mapping[str, Edit]):
    """A context manager under which every forward of ``model`` (``model(...)``, ``model.run_with_cache``, the
    functions here) has ``edits[hookpoint]`` applied at each hookpoint (every position): THE splice, of
    ``cd.splice`` and ``model.run_with_saes`` alike."""
    if not hasattr(model, "bridge"):
        raise ValueError(f"{model!r}: dictionaries splice into the forward of a text model (TransformerLens bridge); "
                         "for an image model encode its activations instead: sae.encode(model.embed_images(images, "
                         "hookpoint=...)) or the activations of model.run_with_cache(images)")
    check_hookpoints(model, list(edits))
    for hookpoint in edits:
        if model.level(hookpoint) == "sequence":
            raise ValueError(f"{hookpoint!r} is a pooled embedding, not a point inside the forward of "
                             f"{model_label(model.name)}; encode the embeddings themselves: x = model.embed_texts("
                             f"texts, hookpoint={hookpoint!r}) (or cd.embed_texts(model, texts, {hookpoint!r})), then "
                             "sae(x) / sae.encode(x); or splice at a token hookpoint such as blocks.3.hook_out")
    if not edits:
        return contextlib.nullcontext()
    return model.bridge.hooks(fwd_hooks=[(hookpoint, _hook(edit)) for hookpoint, edit in edits.items()])
