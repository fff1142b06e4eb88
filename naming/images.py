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


def cbm_rows(store):
    """The rows a concept bottleneck pools per input: for a patch-level image store its patch tokens only
    (the CLS rows left out, ``activations.views.PatchRows``); any other store as it is."""
    if is_image_store(store) and store.level == "token":
        from conceptdict.activations.views import PatchRows

        return PatchRows(store)
    return store


SHOWN_TOP = 5  # distinct top images a report card shows


def shown_examples(top: Sequence[Example], quantile: Sequence[Example]) -> tuple[list[Example], list[Example]]:
    """The examples a report card shows: the first :data:`SHOWN_TOP` top examples from different images
    (patch rows of one image would repeat it), and every other quantile example."""
    seen, first = set(), []
    for e in top:
        ctx = (e.image or {}).get("context", e.row)
        if ctx not in seen and len(first) < SHOWN_TOP:
            seen.add(ctx)
            first.append(e)
    return first, list(quantile[::2])


def _heat(codes: Tensor, positions: Tensor) -> tuple[list[int], float]:
    patch = codes[positions >= 0]
    top = float(patch.max()) if patch.numel() else 0.0
    scaled = (patch.clamp_min(0) / top * 255).round().to(torch.int64) if top > 0 else torch.zeros_like(patch)
    return [int(v) for v in scaled.tolist()], top


class _ImageRows:
    """Rows of each image of a store: one stable sort of the context index, then a binary search per image."""

    def __init__(self, store) -> None:
        self.ctx = store.context_index(0, store.num_rows).to(torch.int64)
        self.pos = store.position(0, store.num_rows)
        self.order = torch.argsort(self.ctx, stable=True)
        self.sorted = self.ctx[self.order]

    def rows(self, ctx: int) -> Tensor:
        key = torch.tensor([ctx])
        lo, hi = int(torch.searchsorted(self.sorted, key)), int(torch.searchsorted(self.sorted, key, right=True))
        return self.order[lo:hi]


def _image_codes(model, store, hookpoint: str, rows: Tensor, device: str) -> Tensor:
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    x = (store.rows(hookpoint, lo, hi) if hi - lo == len(rows) else
         torch.cat([store.rows(hookpoint, int(r), int(r) + 1) for r in rows.tolist()]))
    with torch.no_grad():
        return model.encode(x.float().to(device)).float().cpu()


def add_image_evidence(model, store, hookpoint: str, examples: Sequence[tuple[tuple[Example, ...], ...]],
                       device: str = "cpu") -> tuple[list[list[tuple[Example, ...]]], dict[str, Any]]:
    """Per latent, its (top, quantile) examples with their ``image`` entries, and ``{"thumbnails": {context:
    data URI}, "patch_grid": [rows, cols] or None}``. Heat maps (patch-level stores) and thumbnails are kept
    for the examples a report shows (:func:`shown_examples`) only, so the concept dictionary stays small."""
    grid = store.manifest["images"].get("patch_grid") if store.level == "token" else None
    index = _ImageRows(store)
    tagged = [tuple(tuple(dataclasses.replace(ex, image={"context": int(index.ctx[ex.row]), "grid": grid,
                                                         "heat": None, "heat_max": 0.0}) for ex in group)
                    for group in groups) for groups in examples]
    shown: dict[int, list[tuple[int, int, int]]] = {}  # image -> (latent, group, example) shown in the report
    for j, (top, quant) in enumerate(tagged):
        keep = {id(e) for group in shown_examples(top, quant) for e in group}
        for g, group in enumerate((top, quant)):
            for e, ex in enumerate(group):
                if id(ex) in keep:
                    shown.setdefault(ex.image["context"], []).append((j, g, e))
    out = [[list(group) for group in groups] for groups in tagged]
    for ctx, uses in shown.items():
        rows = index.rows(ctx)
        codes = _image_codes(model, store, hookpoint, rows, device) if grid else None
        for j, g, e in uses:
            if codes is not None:
                heat, top = _heat(codes[:, j], index.pos[rows])
                ex = out[j][g][e]
                out[j][g][e] = dataclasses.replace(ex, image={**ex.image, "heat": heat, "heat_max": top})
    records = store.image_records
    thumbs = {str(c): records[c]["thumbnail"] for c in sorted(shown) if c in records}
    return [[tuple(group) for group in groups] for groups in out], {"thumbnails": thumbs, "patch_grid": grid}
