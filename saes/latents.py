"""How a dictionary's per-latent tensors split over latent shards and join again.

A tensor's latent axis (``SparseCoder.latent_axis``) runs over G equal groups of latents. Most kinds have one group,
so latent shard i of N holds the contiguous range [i L / N, (i + 1) L / N). A cross-layer transcoder's latents come
in S layer groups (layer-major: layer l's latents are [l P, (l + 1) P)), and a shard holds the same slice of every
layer's group, [l P + i P / N, l P + (i + 1) P / N) for each l: each shard is then itself a CLT of L / N latents
with P / N per layer, and every layer's work and memory is spread evenly over the shards. Joining N shards puts
each group's slices side by side; cutting takes each group's slice.

The number of groups of one tensor is :func:`latent_groups` (memory and checkpoints) or
``saes.artifact.disk_latent_groups`` (files): a CLT's per-layer tensors (its decoder blocks ``W_dec_l``, its
encoder on disk ``[S, D, P]``) run over one layer's latents and have one group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .model import SparseCoder


def latent_groups(model: SparseCoder, name: str) -> int:
    """The groups along the latent axis of ``model``'s state or parameter ``name``: a cross-layer transcoder's
    layers (S) for the tensors over all its latents, 1 for its per-layer decoder blocks and for every other kind."""
    if not model.spec.layered or name.startswith("W_dec_"):
        return 1
    return model.n_sources


def shard_ranges(latents: int, groups: int, shard: int, shards: int) -> list[tuple[int, int, int]]:
    """(start, stop, local start) of the ranges of a whole dictionary's ``latents`` that latent shard ``shard`` of
    ``shards`` holds, in order: one range per group."""
    per_group = latents // groups
    n = per_group // shards
    return [(g * per_group + shard * n, g * per_group + (shard + 1) * n, g * n) for g in range(groups)]


def _range(pieces: list[Tensor], axis: int, shard: int, shards: int) -> Tensor:
    """Shard ``shard`` of ``shards`` of the equal ``pieces`` joined along ``axis`` (copied out of the pieces it
    spans)."""
    n = pieces[0].shape[axis]
    lo, hi = shard * n * len(pieces) // shards, (shard + 1) * n * len(pieces) // shards
    return torch.cat([t.narrow(axis, max(lo, j * n) - j * n, min(hi, (j + 1) * n) - max(lo, j * n))
                      for j, t in enumerate(pieces) if max(lo, j * n) < min(hi, (j + 1) * n)], dim=axis)


def cut(parts: list[Tensor], axis: int, groups: int, shard: int, shards: int) -> Tensor:
    """Latent shard ``shard`` of ``shards`` out of a tensor held as ``len(parts)`` latent shards (in order; each
    part's latent axis ``axis`` in ``groups`` groups): each group's slice, the groups in order (a copy)."""
    out = []
    for g in range(groups):
        pieces = [t.narrow(axis, g * (t.shape[axis] // groups), t.shape[axis] // groups) for t in parts]
        out.append(_range(pieces, axis, shard, shards))
    return torch.cat(out, dim=axis)


def join(parts: list[Tensor], axis: int, groups: int) -> Tensor:
    """The whole tensor out of its latent shards ``parts`` (in order)."""
    return cut(parts, axis, groups, 0, 1)


def interleave(rows: Tensor, shards: int, groups: int) -> Tensor:
    """The whole tensor out of its ``shards`` latent shards stacked along axis 0 in shard order (as a gather
    returns them: [N L_s, ...]), its groups put back in place."""
    if groups == 1 or shards == 1:
        return rows
    n = rows.shape[0] // (shards * groups)
    return rows.reshape(shards, groups, n, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def place(whole: Tensor, part: Tensor, axis: int, groups: int, offset: int) -> None:
    """Copy the latent shard ``part`` into ``whole`` along ``axis``, each of its groups' slices where it belongs;
    ``offset``: how many latents the parts before it hold (over every group)."""
    n, total = part.shape[axis] // groups, whole.shape[axis] // groups
    for g in range(groups):
        whole.narrow(axis, g * total + offset // groups, n).copy_(part.narrow(axis, g * n, n))
