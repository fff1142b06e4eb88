"""Models outside the stages: new texts and images as rows a dictionary encodes (a loaded model's own methods,
for a model or a model's name)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from conceptdict.activations import Model


def _loaded(model: Model | str | Path, device: str) -> Model:
    from conceptdict.store_api import load_model

    return load_model(str(model), device=device) if isinstance(model, (str, Path)) else model


def embed_texts(model: Model | str | Path, texts: Sequence[str], hookpoint: str | None = None, batch_size: int = 64,
                device: str = "cpu") -> Tensor:
    """[N, D] float32, one row per text at ``hookpoint``: what a sentence-level dictionary of that hookpoint encodes
    (``sae.encode(cd.embed_texts(model, texts, "sentence.mean_normalized"))``). A text model's default is
    ``sentence.mean_normalized`` (a token hookpoint gives the mean over each text's tokens); a CLIP-like image
    model embeds with its text tower (``text.embed``). ``model``: a loaded model or a name :func:`load_model`
    takes (loaded on ``device``). The same as ``model.embed_texts(texts, hookpoint)``."""
    return _loaded(model, device).embed_texts(list(texts), hookpoint, batch_size=batch_size)


def embed_images(model: Model | str | Path, images: Sequence[Any] | Any, hookpoint: str | None = None,
                 batch_size: int = 64, device: str = "cpu") -> Tensor:
    """[N, D] float32, one row per image (PIL images or file paths) at ``hookpoint`` of an image model (default
    ``image.embed``; a block hookpoint: the mean over the image's CLS and patch rows): what an image dictionary
    of that hookpoint encodes. The same as ``model.embed_images(images, hookpoint)``."""
    return _loaded(model, device).embed_images(images, hookpoint, batch_size=batch_size)
