"""What the plan (saes/sizing.py) counts beyond the dictionary's tensors, held to what a run really holds: the training
stream's buffer fills, and a cross-layer transcoder's encoder gradient, which the step makes without a transient
copy of the whole encoder (saes/kinds/clt.py ``layer_encoder_weights``)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import conceptdict as cd
from conceptdict.activations import ActivationStore, ImportConfig, import_array, stream_batches
from conceptdict.saes import SparseCoder
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.kinds import clt
from conceptdict.saes.sizing import STREAM_FILLS

pytestmark = pytest.mark.unit

S, D, P = 3, 12, 20  # a CLT of 3 layers of 20 latents; no tensor of the step but W_enc is [D, S P]


class Allocations(TorchDispatchMode):
    """Records the shape of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def clt_model(kind: str = "clt") -> SparseCoder:
    g = torch.Generator().manual_seed(3)
    model = SparseCoder(D, S * P, 4, kind, n_sources=S, kernel_impl="torch")
    model.reset_parameters(generator=g)
    model.add_train_params()
    with torch.no_grad():
        for w in clt.decoder_blocks(model):
            w.copy_(torch.randn(w.shape, generator=g))
    return model


def clt_loss(model: SparseCoder) -> torch.Tensor:
    """The squared error of a training step's prediction on a fixed batch."""
    inputs, target = model.split(torch.randn(64, 2 * S * D, generator=torch.Generator().manual_seed(4)))
    out = model.spec.train_forward(model, inputs, local_inputs(target))
    return (target - out.x_hat).pow(2).sum()


@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
def test_a_clt_backward_makes_the_encoder_gradient_once(kind, monkeypatch):
    """The backward allocates one tensor of W_enc's size (its gradient), not a zero-padded one per layer, their sum
    and a layout copy; the gradient is the one plain slicing gives, bit for bit, in W_enc's layout."""
    model = clt_model(kind)
    loss = clt_loss(model)
    seen = Allocations()
    with seen:
        loss.backward()
    whole = [s for s in seen.shapes if s in {(D, S * P), (S * P, D)}]
    assert len(whole) == 1, f"the backward made {len(whole)} tensors of W_enc's size: {whole}"
    assert model.W_enc.grad.stride() == model.W_enc.stride()
    monkeypatch.setattr(clt, "layer_encoder_weights", lambda m: [m.W_enc[:, lat] for lat, _ in clt.layer_slices(m)])
    plain = clt_model(kind)
    clt_loss(plain).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, dict(plain.named_parameters())[name].grad), name


def test_a_clt_gradient_accumulates_over_backwards():
    """Two backwards without zeroing add up, as for any parameter."""
    model = clt_model()
    clt_loss(model).backward()
    once = model.W_enc.grad.clone()
    clt_loss(model).backward()
    assert torch.equal(model.W_enc.grad, 2 * once)


def test_the_plan_counts_the_fills_the_stream_holds(tmp_path):
    """The stream of a training run holds STREAM_FILLS buffer fills of the rank's rows at once (the one read, one in
    the read-ahead queue, one gathered and waiting): the plan's data term is those fills plus the held-out batch."""
    rows, width, buffer_rows, batch = 2048, 16, 256, 64
    np.save(tmp_path / "acts.npy", np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32))
    store = ActivationStore(import_array(ImportConfig(array=tmp_path / "acts.npy", out=tmp_path / "store")))
    stream = stream_batches(store, store.hookpoints[0], batch, epochs=None, buffer_rows=buffer_rows, part=(0, 2))
    next(stream)
    fill_rows = buffer_rows // 2  # this rank's half of every batch

    def fills() -> int:
        gc.collect()
        return len({t.untyped_storage().data_ptr() for t in gc.get_objects()
                    if type(t) is torch.Tensor and t.dim() == 3 and t.shape[0] == fill_rows})

    deadline = time.monotonic() + 30
    while fills() < STREAM_FILLS and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    held = fills()
    stream.close()
    assert held == STREAM_FILLS
    plan = cd.plan(d_model=width, latents=64, k=4, batch_size=batch, data_ranks=2, device="cpu", store_rows=rows,
                   buffer_rows=buffer_rows, heldout_batches=1, precision="float32")
    assert plan.data == STREAM_FILLS * fill_rows * width * 4 + batch * width * 4


def test_a_clt_plan_encodes_one_layer_at_a_time():
    """A CLT's encoder scores and its kernel's gradient buffer are one layer's latents (of this shard), not L / N."""
    one = cd.plan(kind="clt", d_model=D, latents=S * 512, k=4, sources=S, latent_shards=2, device="cpu",
                  precision="float32")
    assert one.pre_activations == 512 * (512 // 2) * 4  # ROW_CHUNK rows of one layer's latents of this shard
    assert one.layer_gradient == D * (512 // 2) * 4
    assert cd.plan(d_model=D, latents=512, k=4, device="cpu", precision="float32").layer_gradient == 0
