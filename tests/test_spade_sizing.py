"""SpaDE's support search keeps a recycled [rows, L] int32 index buffer on a CPU (``numba_impl.sparsemax_support``):
the memory plan counts it with the pre-activations."""

from __future__ import annotations

import pytest
from conceptdict.saes.kernels.sparse import ROW_CHUNK
from conceptdict.saes.sizing import PlanConfig, plan_memory

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shards", [1, 4])
def test_plan_counts_the_support_buffer_on_cpu(shards):
    def pre(kind, device):
        cfg = PlanConfig(kind=kind, device=device, precision="float32", latent_shards=shards)
        return plan_memory(cfg).pre_activations

    L_r = 16384 // shards
    assert pre("spade", "cpu") == pre("topk", "cpu") + ROW_CHUNK * L_r * 4
    assert pre("spade", "cuda") == pre("topk", "cuda")  # on a GPU the torch search: no such buffer
