"""Forward passes with an edit at one hookpoint: logits, generation and sentence embeddings of a steered model.

An ``edit`` maps the hookpoint's activations ``[n, D]`` float32 to edited ones of the same shape (a steering
vector, a latent clamp, an eraser); the hook reshapes ``[b, T, D]`` for it and casts back. ``edit=None`` runs the
model unchanged. Prompts are tokenised as the cache tokenises a document (the tokenizer's special tokens, a BOS
for causal LMs that have one: ``data.special_wrapping``), so steering sees the positions a store holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from conceptdict.activations.data import special_wrapping
from conceptdict.activations.models import SENTENCE_HOOKPOINTS, ModelHandle, check_hookpoints, embed_texts, mean_pool
from conceptdict.activations.tokens import pad_sequences

Edit = Callable[[Tensor], Tensor]


def encode_prompts(model: ModelHandle, texts: Sequence[str], max_length: int = 128) -> tuple[Tensor, Tensor]:
    """(ids [N, T] right-padded, attention mask [N, T]) with the model's special-token wrapping."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.name} has no tokenizer, so prompts cannot be tokenised; pass --tokenizer")
    prefix, suffix, _ = special_wrapping(model.tokenizer, prepend_bos=model.is_causal)
    seqs = [prefix + model.tokenizer(t, add_special_tokens=False)["input_ids"][: max_length] + suffix for t in texts]
    if any(len(s) == 0 for s in seqs):
        raise ValueError("an empty prompt gives no tokens; pass non-empty --prompt texts")
    return pad_sequences(seqs, model.bos_pad_ids()[1])


def _hook(edit: Edit):
    def hook(tensor, hook):
        flat = tensor.reshape(-1, tensor.shape[-1]).float()
        return edit(flat).to(tensor.dtype).reshape(tensor.shape)

    return hook


def edited_logits(model: ModelHandle, ids: Tensor, mask: Tensor, hookpoint: str, edit: Edit | None) -> Tensor:
    """[N, T, V] float32 logits of a causal LM with ``edit`` applied at ``hookpoint`` (every position)."""
    check_hookpoints(model, [hookpoint])
    if hookpoint in SENTENCE_HOOKPOINTS or not model.is_causal:
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
                    if hookpoint in SENTENCE_HOOKPOINTS else None)

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
    if hookpoint in SENTENCE_HOOKPOINTS:
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


def spliced(model: ModelHandle, hookpoint: str, edit: Edit):
    """A context manager under which every forward of ``model`` (``model.bridge(...)`` and the functions here) has
    ``edit`` applied at ``hookpoint`` (every position)."""
    check_hookpoints(model, [hookpoint])
    if hookpoint in SENTENCE_HOOKPOINTS:
        raise ValueError(f"{hookpoint!r} is a pooled embedding, not a point inside the forward; edit the embeddings "
                         "themselves (cd.load_model(...) then embed_texts, then the dictionary) or splice at a token "
                         "hookpoint such as blocks.3.hook_out")
    return model.bridge.hooks(fwd_hooks=[(hookpoint, _hook(edit))])
