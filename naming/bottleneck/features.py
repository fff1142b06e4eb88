"""A CBM's inputs: concept activations of a labelled store through a dictionary (the encoder's ReLU activations or
its sparse code), pooled per input for token-level stores, beside the raw activations a probe reads.

Shapes: B rows, G inputs, L concepts, D raw width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


# ---------------------------------------------------------------- concept activations


def concept_activations(model, x: Tensor, codes: str = "relu") -> Tensor:
    """x [B, D] (or [B, S, D]) -> [B, L]: the encoder's ReLU activations (``relu``) or the dictionary's sparse
    inference code (``sparse``, ``model.encode``); both are >= 0 and zero where the latent's direction is absent."""
    if codes == "sparse":
        return model.encode(x)
    if codes == "relu":
        return model.dense_activations(x)
    raise ValueError(f"codes {codes!r} is not one of relu, sparse")


# ---------------------------------------------------------------- pooling


def pool_codes(codes: Tensor, groups: Tensor, mode: str = "mean", quantile: float = 0.1) -> Tensor:
    """Pool token rows codes [B, L] into inputs [G, L] by ``groups [B]`` (input index 0..G-1 of each row).

    mean / max over the input's rows; ``super``: per concept, mean of its top ceil(quantile * n) activations."""
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    L = codes.shape[1]
    if mode == "mean":
        out = codes.new_zeros(n_groups, L).index_add_(0, groups, codes)
        return out / torch.bincount(groups, minlength=n_groups).clamp_min(1)[:, None].to(codes.dtype)
    if mode == "max":
        init = codes.new_full((n_groups, L), float("-inf"))
        out = init.scatter_reduce(0, groups[:, None].expand(-1, L), codes, "amax")
        return torch.where(torch.isinf(out), torch.zeros_like(out), out)
    if mode == "super":
        order = torch.argsort(groups, stable=True)
        sizes = torch.bincount(groups, minlength=n_groups).tolist()
        out = codes.new_zeros(n_groups, L)
        for g, chunk in enumerate(torch.split(codes[order], sizes)):
            if len(chunk):
                m = max(1, math.ceil(quantile * len(chunk)))
                out[g] = chunk.topk(m, dim=0).values.mean(0)
        return out
    raise ValueError(f"pooling {mode!r} is not one of mean, max, super")


class CbmFeatures(NamedTuple):
    concepts: Tensor  # [N, L] pooled concept activations per input
    raw: Tensor  # [N, D] raw activations per input (mean over its tokens for token-level stores)
    labels: list  # [N]
    inputs: Tensor | None = None  # [N] int64 context (input) index of each, ascending: what joins two stores' inputs


def row_inputs(store) -> Tensor:
    """[rows] int64: the input (context) index of every store row."""
    if getattr(store, "level", "token") == "sequence":
        return torch.arange(store.num_rows)
    if hasattr(store, "context_index"):
        return store.context_index(0, store.num_rows).to(torch.int64)
    return torch.tensor([store.row_context(r, 0, 0).context_index for r in range(store.num_rows)])


def store_features(
    encoder, store, hookpoint: str, label_column: str, pooling: str = "super", quantile: float = 0.1,
    chunk: int = 4096, device: str = "cpu", codes: str = "relu",
) -> CbmFeatures:  # fmt: skip
    """Concept activations (:func:`concept_activations`, pooled per input) and raw activations of a labelled store."""
    labels = store.labels(label_column)
    if labels is None:
        raise ValueError(f"store {store.path} has no label column {label_column!r}; pass --label-column with one "
                         "the dataset carried into the store (see `conceptdict store info`)")  # fmt: skip
    acts, raws = [], []
    with torch.no_grad():
        for _, x in store.iter_rows(hookpoint, chunk):
            x = x.float().to(device)
            acts.append(concept_activations(encoder, x, codes).float().cpu())
            raws.append(x.cpu())
    codes_t, raw_t = torch.cat(acts), torch.cat(raws)
    if getattr(store, "level", "token") == "sequence":
        ids = store.context_index(0, store.num_rows).to(torch.int64) if hasattr(store, "context_index") else None
        return CbmFeatures(codes_t, raw_t, list(labels), ids)
    inputs = row_inputs(store)
    uniq, groups = torch.unique(inputs, return_inverse=True)
    first = torch.full((len(uniq),), -1, dtype=torch.int64)
    first.scatter_reduce_(0, groups, torch.arange(len(groups)), "amin", include_self=False)
    return CbmFeatures(
        pool_codes(codes_t, groups, pooling, quantile), pool_codes(raw_t, groups, "mean"),
        [labels[i] for i in first.tolist()], uniq,
    )  # fmt: skip


def concept_directions(model, width: int) -> Tensor | None:
    """[L, D]: each latent's decoder direction in the raw units of the CBM's inputs (``width`` wide), or None where
    the decoder does not write into that space (a transcoder's output, a crosscoder's several sources): the CBM's
    ``probe`` scale then falls back to ``std``."""
    spec = getattr(model, "spec", None)
    if spec is None or spec.transcodes or not hasattr(model, "decoder_directions"):
        return None
    d = model.decoder_directions()
    return d.detach().float() if d.ndim == 2 and d.shape[1] == width else None
