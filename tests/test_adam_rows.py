"""``kernels.adam_rows``: Adam, the decoder renormalisation and the bf16 copy of a weight matrix in one pass.

Every implementation against the dense reference (torch's fused Adam, then ``W /= W.norm(dim=1)``, then the copy),
bit for bit, over several steps; and whole training runs with the fused update against the same runs with it off
(``update.fused_rows`` returning nothing: the unfused path), which must end with identical weights and Adam state.
Marked ``equivalence``: ``make test`` runs them again under ATen's ``avx2`` and ``default`` kernels, whose roundings
the numba kernel follows (fused multiply-adds or not)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conceptdict.saes import kernels, train, train_config, update
from conceptdict.saes.kernels import copies, reference

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]

HAS_NUMBA = importlib.util.find_spec("numba") is not None
IMPLS = ["reference", "torch", pytest.param("numba", marks=pytest.mark.skipif(not HAS_NUMBA, reason="no numba"))]
BF16 = torch.bfloat16


def _steps(impl: str | None, shape: tuple[int, int], unit: bool, with_copy: bool, steps: int = 6):
    """W, its moments and copy after ``steps`` updates through ``impl`` (None: ``reference.adam_rows`` directly)."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(shape, generator=g)
    W[1] = 0  # a zero row: its norm is clamped at 1e-12
    M, V, step = torch.zeros(shape), torch.zeros(shape), torch.zeros(())
    copy = torch.empty(shape, dtype=BF16) if with_copy else None
    for s in range(steps):
        # gradients over several orders of magnitude, row by row (Adam's denominators near eps and far from it)
        G = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 2, (shape[0], 1), generator=g)
        step += 1
        if impl is None:
            reference.adam_rows(W, G, M, V, step, 1e-3, 0.9, 0.999, 1e-8, unit, copy)
        else:
            kernels.adam_rows(W, G, M, V, step, 1e-3, (0.9, 0.999), 1e-8, unit=unit, copy=copy, impl=impl)
    return W, M, V, copy


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(40, 768), (9, 16), (33, 64), (5, 19), (3, 7)])
@pytest.mark.parametrize("unit,with_copy", [(True, True), (False, True), (True, False)])
def test_adam_rows_equals_the_unfused_update_bit_for_bit(impl, shape, unit, with_copy):
    want = _steps(None, shape, unit, with_copy)
    got = _steps(impl, shape, unit, with_copy)
    for a, b in zip(got, want):
        if b is not None:
            assert torch.equal(a, b)
    W = want[0]
    if unit:
        norms = W.norm(dim=1)
        assert torch.allclose(norms[norms > 0], torch.ones(()), atol=1e-6)
    if with_copy:
        assert torch.equal(want[3], W.to(BF16))


def test_adam_rows_the_reference_is_torch_adam_then_the_renormalisation():
    """The reference itself: torch.optim.Adam(fused=True) on the matrix, then the division by the row norms."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(6, 8, generator=g))
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    W, M, V, step = p.detach().clone(), torch.zeros(6, 8), torch.zeros(6, 8), torch.zeros(())
    for _ in range(3):
        G = torch.randn(6, 8, generator=g)
        p.grad = G.clone()
        opt.step()
        with torch.no_grad():
            p /= p.norm(dim=1, keepdim=True).clamp_min(1e-12)
        step += 1
        reference.adam_rows(W, G, M, V, step, 1e-3, 0.9, 0.999, 1e-8, True, None)
        assert torch.equal(W, p.detach())


@pytest.mark.skipif(not HAS_NUMBA, reason="no numba")
@pytest.mark.parametrize("kind,precision", [("topk", "bf16"), ("topk", "float32"), ("batchtopk", "bf16"),
                                            ("clt", "float32"), ("relu", "float32")])
def test_training_with_the_fused_update_ends_as_without_it(kind, precision, monkeypatch):
    """numba kernels, a few steps: the fused update (Adam + renormalisation + bf16 copies in one pass) and the
    unfused one (torch's fused Adam, the renormalisation, copies remade at the next read) give the same weights."""
    S = 2 if kind == "clt" else 1
    g = torch.Generator().manual_seed(0)
    shape = (64, 2 * S, 16) if kind == "clt" else (64, 16)
    batches = [torch.randn(shape, generator=g) for _ in range(7)]
    cfg = train_config(kind=kind, latents=48, k=4, batch_size=64, kernel_impl="numba", precision=precision,
                       eval_batches=1, calibration_batches=0, lr=3e-3, device="cpu")
    fused = train(cfg, batches)
    called = []
    original = update.fused_rows

    def off(model, opt):
        called.append(bool(original(model, opt)))
        return {}

    monkeypatch.setattr(update, "fused_rows", off)
    copies.release_copies()
    unfused = train(cfg, batches)
    assert called and called[-1], "the fused path was not taken in the first run"
    for (name, a), (_, b) in zip(fused.state_dict().items(), unfused.state_dict().items()):
        assert torch.equal(a, b), name
