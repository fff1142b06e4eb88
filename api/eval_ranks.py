"""``conceptdict eval`` under ``torchrun``: each rank reads only its own range of a block artifact's latents.

``torchrun --nproc-per-node N -m conceptdict eval DICT --store S`` joins the job as ``train`` does
(``conceptdict.ranks.join``) and splits the dictionary over every rank as latent shards
(``saes.distributed.process_group_comm(N)``): rank r opens the artifact lazily and holds latents ``[r L / N,
(r + 1) L / N)`` (a CLT's: of each layer), read a block at a time (``saes.lazy_ranks``). Every rank reads the same
rows; each encodes with its latents (per-row TopK merged over the ranks as latent-sharded training merges it), decodes
its part, and the parts are summed; the per-latent counts are summed over the ranks. Rank 0 writes eval.json; the
other ranks write nothing. The numbers are one process's to float32 rounding (tests/test_eval_ranks.py).

What is not split is refused before any row or latent is read (:func:`refuse`, :func:`refuse_run`), each with its
fix: a kind whose rule reads other latents, a dictionary that is not a folder in conceptdict's layout, a set of
per-layer transcoders, ``--metrics``, rows from a model's forward, and a CLT's replacement-model scores. A one-space
dictionary's CE loss recovered and KL score are measured on every rank alike (each runs the language model; the
dictionary's output at the hookpoint is the ranks' summed reconstruction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conceptdict import ranks
from conceptdict.activations.live import LiveSource
from conceptdict.saes import SparseCoder
from conceptdict.saes.comm import Comm
from conceptdict.settings import ConfigError

ONE_PROCESS = "or run `conceptdict eval` in one process (without torchrun), which reads it a block at a time"


def job() -> Comm | None:
    """Join the job torchrun describes (``ranks.join``, as ``train``); its seam with every rank a latent shard, or
    None in one process."""
    from conceptdict.saes.distributed import process_group_comm

    size = ranks.join().size
    return process_group_comm(size) if size > 1 else None


def refuse(dictionary: Any, layers: list[Path], metrics: list[str], comm: Comm) -> None:
    """What eval does not split over ranks, refused before anything is read, each with its fix."""
    from conceptdict.saes import kind_spec
    from conceptdict.saes.artifact import load_native_config, native_kind
    from conceptdict.saes.formats import locate

    n = comm.shards.size
    if layers:
        raise ConfigError(f"{dictionary} is a set of {len(layers)} per-layer transcoders; under torchrun eval splits "
                          f"one dictionary over its {n} ranks: evaluate each layer's folder, {ONE_PROCESS}")
    if isinstance(dictionary, SparseCoder) or str(dictionary).startswith("hf:"):
        raise ConfigError(f"under torchrun eval splits a saved dictionary over its {n} ranks, each reading its own "
                          f"latents from the files: pass a local folder in conceptdict's layout, {ONE_PROCESS}")
    directory, fmt = locate(dictionary)
    if fmt != "conceptdict":
        raise ConfigError(f"{directory} is a {fmt} dictionary; under torchrun eval reads conceptdict's own layout a "
                          f"range of latents per rank: save it in that layout first (conceptdict export), "
                          f"{ONE_PROCESS}")
    kind = native_kind(load_native_config(directory))
    if not kind_spec(kind).shardable:
        raise ConfigError(f"a {kind} dictionary is not split over ranks (its rule reads other latents): "
                          f"{ONE_PROCESS} (it loads a {kind} whole)")
    if metrics:
        raise ConfigError(f"--metrics {','.join(metrics)}: under torchrun eval measures its own table only (the "
                          f"yardsticks compare every latent with every other); drop --metrics, {ONE_PROCESS}")


def refuse_run(run: Any, splices: bool) -> None:
    """What is refused once the run's source is known (still before any row is read): rows from a model's forward,
    and a cross-layer transcoder's replacement model (``splices``: a causal LM and contexts are at hand). A
    one-space dictionary is spliced on every rank alike: each rank runs the language model, and the dictionary's
    output at the hookpoint is the ranks' summed reconstruction."""
    if isinstance(run.source, LiveSource):
        raise ConfigError(f"{run.where} was trained from a model's forward; under torchrun eval reads a store: pass "
                          f"--store STORE, {ONE_PROCESS}")
    if splices and run.dictionary.spec.layered:
        raise ConfigError(f"{run.where}: a {run.dictionary.kind} split over ranks is not spliced into the language "
                          f"model as a replacement model (CE loss recovered, KL score; it reads the whole decoder): "
                          f"pass --contexts 0, or evaluate it whole in one process")


__all__ = ["job", "refuse", "refuse_run"]
