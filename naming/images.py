"""Naming on image stores: Discover-then-Name in the joint image-text space, and the image evidence a report
shows (thumbnails, and for patch-level dictionaries a heat map of the latent over each top image's patches).

- Vocabulary namer (:func:`image_vocab_namer`): with a CLIP-like model (a text tower) the vocabulary is
  embedded by the model's own ``get_text_features`` and compared by cosine with the decoder directions of
  ``image.embed`` (exactly DN-CBM) or with block directions read out through the final norm and the visual
  projection (``activations.vision.directions_to_text_space``, approximate). An image encoder without a text
  tower (ViT, DINOv2) falls back to the packaged text encoder with a warning that the two spaces differ.
- Evidence (:func:`add_image_evidence`): each example of an image store gets ``image = {"context": image
  index, "grid": [rows, cols], "heat": [P ints 0..255] or None, "heat_max": float}``; the heat map is the
  latent's activation (the dictionary's code) on every patch of that image, scaled to its maximum. The
  thumbnails of every image shown are returned for the concept dictionary's ``meta["thumbnails"]``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .concepts import Example
from .namers import NameResult, NamingInputs, VocabNamer
from .vocab import embed_vocabulary, load_vocabulary

log = logging.getLogger(__name__)

TEXT_ENCODER_HOOKPOINT = "sentence.mean_normalized"  # of the packaged MiniLM, the fallback text encoder


def is_image_store(store) -> bool:
    return bool(getattr(store, "is_image_store", False))


@dataclass(frozen=True)
class ProjectedVocabNamer:
    """The vocabulary namer applied to directions first mapped into the text embedding space."""

    inner: VocabNamer
    project: Callable[[Tensor], Tensor]
    kind: str = "vocab"

    def __call__(self, inputs: NamingInputs) -> list[NameResult]:
        return self.inner(dataclasses.replace(inputs, directions=self.project(inputs.directions)))


def image_vocab_namer(vocab: str, model_name: str, hookpoint: str, get_model, runner_ups: int,
                      cache_dir: Path, batch: int = 1024) -> ProjectedVocabNamer:
    """Discover-then-Name for an image dictionary (see the module docstring)."""
    from conceptdict.activations import embed_texts, load_model
    from conceptdict.activations.vision import directions_to_text_space

    handle = get_model()
    words = load_vocabulary(vocab)
    if handle.has_text:
        def embed(texts: list[str]) -> Tensor:
            return embed_texts(handle, texts, "text.embed", batch_size=batch)

        ve = embed_vocabulary(words, model_name, "text.embed", embed, cache_dir)
        return ProjectedVocabNamer(VocabNamer(tuple(ve.words), ve.embeddings, runner_ups),
                                   lambda d: directions_to_text_space(handle, hookpoint, d))
    log.warning("%s has no text tower: the vocabulary is embedded with the packaged text encoder (all-MiniLM-L6-v2), "
                "whose space is not the image model's; names compare directions across two unrelated spaces",
                model_name)
    text_model = load_model("default")
    d_text, d_image = text_model.d_model(TEXT_ENCODER_HOOKPOINT), handle.d_model(hookpoint)
    if d_text != d_image:
        raise ValueError(f"{model_name} has no text tower and its {hookpoint} width {d_image} differs from the "
                         f"packaged text encoder's {d_text}, so no vocabulary embedding can be compared with its "
                         "directions; use a CLIP-like model (CLIP, SigLIP) or --namer llm")

    def embed_default(texts: list[str]) -> Tensor:
        return embed_texts(text_model, texts, TEXT_ENCODER_HOOKPOINT, batch_size=batch)

    ve = embed_vocabulary(words, "default", TEXT_ENCODER_HOOKPOINT, embed_default, cache_dir)
    return ProjectedVocabNamer(VocabNamer(tuple(ve.words), ve.embeddings, runner_ups), lambda d: d)


def _context_rows(store) -> tuple[Tensor, Tensor]:
    """(context index [N], position [N]) of every row."""
    return store.context_index(0, store.num_rows).to(torch.int64), store.position(0, store.num_rows)


def _heat(codes: Tensor, positions: Tensor) -> tuple[list[int], float]:
    patch = codes[positions >= 0]
    top = float(patch.max()) if patch.numel() else 0.0
    scaled = (patch.clamp_min(0) / top * 255).round().to(torch.int64) if top > 0 else torch.zeros_like(patch)
    return [int(v) for v in scaled.tolist()], top


def add_image_evidence(model, store, hookpoint: str, examples: Sequence[Sequence[tuple[Example, ...]]],
                       device: str = "cpu") -> tuple[list[list[tuple[Example, ...]]], dict[str, Any]]:
    """Examples of every latent (each a list of example groups: top, quantile ...) with their ``image``
    entries, and ``{"thumbnails": {context: data URI}, "patch_grid": [rows, cols] or None}``."""
    patches = store.level == "token"
    grid = store.manifest["images"].get("patch_grid") if patches else None
    ctx_of_row, pos_of_row = _context_rows(store)
    wanted: dict[int, list[tuple[int, int, int]]] = {}  # context -> (latent, group, example)
    for j, groups in enumerate(examples):
        for g, group in enumerate(groups):
            for e, ex in enumerate(group):
                wanted.setdefault(int(ctx_of_row[ex.row]), []).append((j, g, e))
    heats: dict[tuple[int, int, int], tuple[list[int], float]] = {}
    if patches:
        for ctx, uses in wanted.items():
            rows = torch.nonzero(ctx_of_row == ctx).flatten()
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            x = (store.rows(hookpoint, lo, hi) if hi - lo == len(rows) else
                 torch.cat([store.rows(hookpoint, int(r), int(r) + 1) for r in rows])).float().to(device)
            with torch.no_grad():
                codes = model.encode(x).float().cpu()
            for j, g, e in uses:
                heats[(j, g, e)] = _heat(codes[:, j], pos_of_row[rows])
    out = []
    for j, groups in enumerate(examples):
        new_groups = []
        for g, group in enumerate(groups):
            new = []
            for e, ex in enumerate(group):
                heat, top = heats.get((j, g, e), (None, 0.0))
                info = {"context": int(ctx_of_row[ex.row]), "grid": grid, "heat": heat, "heat_max": top}
                new.append(dataclasses.replace(ex, image=info))
            new_groups.append(tuple(new))
        out.append(new_groups)
    records = store.image_records
    thumbs = {str(c): records[c]["thumbnail"] for c in sorted(wanted) if c in records}
    return out, {"thumbnails": thumbs, "patch_grid": grid}
