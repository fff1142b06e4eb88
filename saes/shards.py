"""Saving the dictionary of a latent-sharded run (``TrainConfig.latent_shards``) without joining it on every process.

At the end of a sharded run every latent shard holds its latents, calibrated and evaluated through the seam
(``saes.calibration``, ``saes.evaluation`` with ``comm``). :func:`save_trained` writes the artifact from there:

- a dictionary of at most ``single_file_gib`` GiB of weights is gathered onto ONE process, latent shard 0 of data
  rank 0 (the others only send their latents), which writes today's ``weights.safetensors``;
- a larger one is never whole on any process: each shard writes its own block of latents
  (``saes.artifact.save_dictionary_part``), then shard 0 writes ``weights.index.json`` and config.json
  (``saes.artifact.finish_parts``); ``saes.load_dictionary`` (``cd.load`` and every command) joins the files.

Only data rank 0 of each shard writes (its data-parallel copies hold the same latents).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .artifact import disk_latent_axes, disk_tensors, finish_parts, save_dictionary, save_dictionary_part
from .comm import Comm
from .latents import interleave, latent_groups
from .model import SparseCoder

GIB = 2 ** 30


def gather_shards(model: SparseCoder, shards: Comm, to_first: bool = False) -> SparseCoder | None:
    """The whole dictionary (with the training parameters ``model`` holds) out of every latent shard's ``model``, on
    every shard; ``to_first``: on shard 0 alone (the others only send theirs and get None), e.g. to save it."""
    state = {}
    for name, t in model.state_dict().items():
        axis = model.latent_axis(name)
        t = t.detach()
        if axis is None:
            state[name] = t
            continue
        rows = t.movedim(axis, 0).contiguous()
        joined = shards.gather_to_first(rows) if to_first else shards.gather_rows(rows)
        state[name] = None if joined is None else interleave(joined, shards.size,
                                                             latent_groups(model, name)).movedim(0, axis)
    if to_first and shards.rank != 0:
        return None
    whole = SparseCoder(model.d_in, model.n_latents * shards.size, model.k, model.kind, n_sources=model.n_sources,
                        kernel_impl=model.kernel_impl, device=model.device)
    if set(state) - set(whole.state_dict()):  # the training parameters, when ``model`` still has them
        whole.add_train_params()
    whole.load_state_dict(state)
    whole.training_summary = getattr(model, "training_summary", None)
    return whole


def weights_bytes(model: SparseCoder, comm: Comm) -> int:
    """Bytes of the whole dictionary's saved weights, ``model`` being this latent shard's (``comm.shards``): every
    shard's per-latent tensors plus the shared ones once; the same number on every shard."""
    axes, tensors = disk_latent_axes(model), disk_tensors(model)
    own = sum(t.numel() * t.element_size() for k, t in tensors.items() if axes[k] is not None)
    shared = sum(t.numel() * t.element_size() for k, t in tensors.items() if axes[k] is None)
    return int(comm.shards.all_sum(torch.tensor(own, dtype=torch.int64))) + shared


def save_trained(model: SparseCoder, out: Path | None, extra: dict[str, Any] | None, comm: Comm,
                 single_file_gib: float) -> str | None:
    """Save a trained dictionary to ``out`` (None on the processes that do not write: every one but data rank 0 of
    each latent shard, the same for every shard of a data group): unsharded, ``saes.artifact.save_dictionary``;
    with latent shards ``model`` is this shard's latents, saved as the module docstring says. Returns how it was
    saved ("one file", "one file per shard"), None where nothing was written."""
    shards = comm.shards
    if out is None:
        return None
    if shards.size == 1:
        save_dictionary(model, out, extra=extra)
        return "one file"
    if weights_bytes(model, comm) <= single_file_gib * GIB:
        whole = gather_shards(model, shards, to_first=True)
        if whole is not None:
            save_dictionary(whole, out, extra=extra)
        shards.barrier()
        return "one file"
    save_dictionary_part(model, out, shards.rank, shards.size)
    shards.barrier()  # every block written before the index names them
    if shards.rank == 0:
        finish_parts(model, out, shards.size, extra=extra)
    shards.barrier()
    return "one file per shard"
