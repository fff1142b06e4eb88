"""The cuts inside a training step's loop (issue 53, the whole process): the reconstruction loss's gradient in one
pass (``saes.loss.squared_error``) is autograd's bit for bit, so whole runs end with the same weights, and the batch
check's float32 sum refuses every NaN / inf batch while letting finite rows whose sum overflows through."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from conceptdict.saes import train, train_config, training
from conceptdict.saes.batches import check_batch
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.loss import squared_error
from golden.make_golden import SETTINGS, _batches

pytestmark = pytest.mark.unit

HAS_NUMBA = importlib.util.find_spec("numba") is not None


def _autograd(target, x_hat):
    """The loss as the step wrote it before: autograd's pow / sum / subtraction."""
    err = target - x_hat
    return err.pow(2).sum(), err.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4096, 768), (37, 5), (3, 2, 11)])
@pytest.mark.parametrize("target_grad", [False, True])
def test_the_one_pass_gradient_is_autograds_bit_for_bit(dtype, shape, target_grad):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    target = torch.randn(shape, generator=g, dtype=dtype) * 3
    x_hat = torch.randn(shape, generator=g, dtype=dtype)
    total_var = (target - target.mean(0)).pow(2).sum()  # the step's denominator: its grad is not 1 or a power of 2
    grads = []
    for fn in (squared_error, _autograd):
        t = target.clone().requires_grad_(target_grad)
        xh = x_hat.clone().requires_grad_(True)
        sq, err = fn(t, xh)
        assert not err.requires_grad
        loss = sq / total_var + 0.25 * (err * x_hat).sum()  # the error used elsewhere in the loss (AuxK's residual)
        loss.backward()
        grads.append((sq.detach(), err, xh.grad, t.grad))
    (sq, err, gx, gt), (sq0, err0, gx0, gt0) = grads
    assert torch.equal(sq, sq0) and torch.equal(err, err0)
    assert torch.equal(gx, gx0)
    assert gt is None and gt0 is None if not target_grad else torch.equal(gt, gt0)


def test_without_a_gradient_it_is_the_plain_sum():
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    with torch.no_grad():
        sq, err = squared_error(x, y)
    assert not sq.requires_grad and torch.equal(sq, (x - y).pow(2).sum()) and torch.equal(err, x - y)


def _train(kind: str, **kw):
    settings = dict(SETTINGS, kind=kind, tokens=64 * 6) | kw
    return train(train_config(**flat_for_kind(settings, kind)), functools.partial(_batches, kind))


RUNS = [("topk", {"kernel_impl": "torch", "precision": "float32"}),
        ("batchtopk", {"kernel_impl": "reference", "precision": "float32", "dead_tokens": 64}),  # AuxK on its residual
        ("jumprelu", {"kernel_impl": "torch", "precision": "float32"}),
        ("transcoder", {"kernel_impl": "torch", "precision": "float64"}),
        pytest.param("topk", {"kernel_impl": "numba", "precision": "bf16", "dead_tokens": 64},
                     marks=pytest.mark.skipif(not HAS_NUMBA, reason="no numba"))]


@pytest.mark.parametrize("kind,kw", RUNS)
def test_runs_end_with_the_weights_of_autograds_loss(kind, kw, monkeypatch):
    new = _train(kind, **kw).state_dict()
    monkeypatch.setattr(training, "squared_error", _autograd)
    old = _train(kind, **kw).state_dict()
    assert new.keys() == old.keys()
    for name in new:
        assert torch.equal(new[name], old[name]), f"{kind} {kw}: {name} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_batch_check_refuses_every_non_finite_batch(dtype, bad):
    x = torch.randn(64, 8).to(dtype)
    x[17, 3] = bad
    with pytest.raises(ValueError, match="batch 4 from store s holds 1 NaN/inf values of 512"):
        check_batch(x, 4, "store s")
    x[5, 0], x[9, 1] = float("inf"), float("-inf")  # + and - inf: their sum is NaN, still refused
    with pytest.raises(ValueError, match="holds 3 NaN/inf"):
        check_batch(x, 4, "store s")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (float16 rows cannot overflow a float32 sum)
def test_finite_rows_whose_sum_overflows_pass_the_batch_check(dtype):
    x = torch.full((16, 4), 3e38, dtype=dtype)
    assert not torch.isfinite(x.sum(dtype=torch.float32))
    out = check_batch(x, 0, "store s")
    assert out.dtype == torch.float32 and torch.equal(out, x.float())
