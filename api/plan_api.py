"""``cd.plan``: the memory of a training run per rank before it starts, and the smallest shard count that fits."""

from __future__ import annotations

from typing import Literal

from conceptdict.saes.sizing import MemoryPlan, PlanConfig, plan_memory
from conceptdict.settings import config_from_dict, given, takes_settings

__all__ = ["MemoryPlan", "PlanConfig", "plan"]


@takes_settings(PlanConfig)
def plan(
    *, kind: str = "topk", d_model: int = 768, latents: int = 16384, k: int = 32, sources: int = 1,
    latent_shards: int = 1, data_ranks: int = 1, precision: Literal["auto", "float32", "bf16", "fp16", "float64"] = "auto",
    batch_size: int = 4096, device: Literal["cuda", "cpu"] = "cuda", device_gib: float | None = None,
    store_rows: int | None = None, store_bytes: int = 4, buffer_rows: int = 65536, heldout_batches: int = 1,
) -> MemoryPlan:
    """What one rank of a training run holds (weights, gradients, Adam state, the step's and the data's buffers,
    the allocator's slack, the peak), counted on the dictionary itself built without memory; with ``device_gib`` the
    smallest ``latent_shards`` that fits one device with 10% spare (``MemoryPlan.fits``).

    >>> cd.plan(kind="clt", d_model=2304, latents=26 * 16384, sources=26, device_gib=80).fits
    """
    return plan_memory(config_from_dict(PlanConfig, given(locals()), "plan"))
