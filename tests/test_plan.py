"""``conceptdict plan`` / ``cd.plan`` (saes/sizing.py): the memory of a training run per rank before it starts.

The plan counts the dictionary on torch's meta device; these tests hold its counts to the tensors a real run builds
(the shard's SparseCoder of training.py, its gradients, the Adam state after one step) for every kind, and its shard
choice to its own definition. bench/sharding.py compares its peaks with measured ones."""

from __future__ import annotations

import pytest
import torch

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.saes import SparseCoder
from conceptdict.saes.kinds import KINDS, kind_spec
from conceptdict.saes.update import make_optimizer

pytestmark = pytest.mark.unit

D, L = 8, 64


def sources_of(kind: str) -> int:
    spec = kind_spec(kind)
    return 3 if spec.layered else 2 if spec.sources == "several" else 1


def bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shards", [1, 2])
def test_the_plan_counts_what_a_shard_holds(kind, shards):
    """weights / gradients / Adam equal the bytes of the model a shard rank builds (training.py: L / N latents, the
    shared entries whole), its parameters' gradients and the Adam moments after one step."""
    if shards > 1 and not kind_spec(kind).shardable:
        pytest.skip(f"{kind} trains in one process only (its plan for N > 1 is marked so)")
    S = sources_of(kind)
    plan = cd.plan(kind=kind, d_model=D, latents=L * S, k=2, sources=S, latent_shards=shards, precision="float32")
    model = SparseCoder(D, L * S // shards, 2, kind, n_sources=S)
    model.add_train_params()
    assert plan.weights == bytes_of([*model.parameters(), *model.buffers()])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert plan.gradients == bytes_of(p.grad for p in model.parameters())
    opt = make_optimizer(model, lr=1e-3)
    for q in opt.params:  # the optimizer steps storage-order aliases (saes/update.py), given their gradients
        q.grad = torch.zeros_like(q)
    opt.step()
    moments = [t for state in opt.state.values() for name, t in state.items() if name != "step"]
    assert plan.adam == bytes_of(moments)
    if shards == 1:
        assert plan.parameters == sum(p.numel() for p in model.parameters())


def test_precision_moves_what_it_touches():
    base = cd.plan(d_model=64, latents=1024, precision="float32")
    bf16 = cd.plan(d_model=64, latents=1024, precision="bf16")
    assert cd.plan(d_model=64, latents=1024).config.precision == "bf16"  # auto on a GPU
    assert cd.plan(kind="spade", d_model=64, latents=1024).config.precision == "float32"  # a float32-only kind
    f64 = cd.plan(d_model=64, latents=1024, precision="float64")
    # the encoder's bf16 copy, and the decoder's rounded rows: float32 on a GPU (bf16 on a CPU)
    assert bf16.matmul_copy == 64 * 1024 * 2 + 1024 * 64 * 4 and base.matmul_copy == 0
    cpu = cd.plan(d_model=64, latents=1024, precision="bf16", device="cpu")
    assert cpu.matmul_copy == 64 * 1024 * 2 + 1024 * 64 * 2
    assert bf16.pre_activations * 2 == base.pre_activations
    assert f64.weights == 2 * base.weights and f64.adam == 2 * base.adam


def test_a_gpu_keeps_the_data_path_in_host_memory_and_a_cpu_chunks_its_scores():
    gpu = cd.plan(d_model=64, latents=1 << 16, batch_size=4096, precision="float32")
    cpu = cd.plan(d_model=64, latents=1 << 16, batch_size=4096, device="cpu", precision="float32")
    assert gpu.host == gpu.data + gpu.allocator and gpu.data > 0 and cpu.host == 0
    assert cpu.peak - cpu.data < gpu.peak  # a CPU selects row chunks, a GPU the whole batch's scores
    assert gpu.pre_activations == 4096 * (1 << 16) * 4


def test_the_smallest_shard_count_that_fits_is_the_smallest():
    """``fits`` is the smallest latent shard count whose peak fits the device with 10% spare: the one below it
    does not fit."""
    whole = dict(d_model=512, latents=1 << 20, batch_size=1024)
    budget = cd.plan(**whole, latent_shards=8).peak / 0.9 / 2 ** 30
    plan = cd.plan(**whole, device_gib=budget)
    assert plan.fits == 8
    assert cd.plan(**whole, latent_shards=4).peak > budget * 0.9 * 2 ** 30
    assert cd.plan(**whole, device_gib=1e-6).fits is None


def test_a_gemma_sized_clt_on_80_gib_devices(capsys):
    """The cross-layer transcoder of a Gemma-2-2B (26 layers, d_model 2304, 16,384 latents per layer): the number
    the plan gives is pinned, so a change in how a CLT is stored or counted is noticed here."""
    assert main(["plan", "--kind", "clt", "--d-model", "2304", "--latents", str(26 * 16384), "--sources", "26",
                 "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "14,231,759,360 parameters" in out  # the decoder as its triangle (26,500,098,560 with the whole matrix)
    assert "fits 80 GiB with 10% spare: --latent-shards 4" in out
    assert "does not train with --latent-shards yet" not in out  # it trains sharded (test_distributed_shards.py)


@pytest.mark.parametrize("settings, message", [
    (dict(latents=1000, latent_shards=3), "not a multiple of latent_shards=3"),
    (dict(kind="clt", latents=1000, sources=3), "not a multiple of sources=3"),
    (dict(batch_size=100, data_ranks=3), "not a multiple of data_ranks=3"),
    (dict(device_gib=0), "device_gib=0"),
    (dict(kind="nope"), "nope"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        cd.plan(**settings)
