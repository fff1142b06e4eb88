"""The reconstruction term of a training step's loss (``saes.training.step``): the sum of squared errors, with its
gradient into the reconstruction made in one pass.

Autograd's form, ``(target - x_hat).pow(2).sum()``, runs four [B, F] passes in its backward: ``err.pow(1)`` (a
copy), ``2 * that``, ``that * grad`` and the negation for ``x_hat``. :func:`squared_error` makes the same gradient
as one multiplication, ``err * (-2 g)``: ``2 g`` and its negation are exact in binary floating point and every
element is rounded once, as there, so the gradient is the same bit for bit (``tests/test_loss.py``); the forward is
autograd's (the same subtraction, ``pow(2)`` and sum), so the loss is the same too."""

from __future__ import annotations

import torch
from torch import Tensor


class _SquaredError(torch.autograd.Function):
    """(sum of (target - x_hat)^2, the error target - x_hat, not differentiable); the gradient in one pass."""

    @staticmethod
    def forward(ctx, target: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
        err = target - x_hat
        ctx.save_for_backward(err)
        ctx.mark_non_differentiable(err)
        ctx.set_materialize_grads(False)
        return err.pow(2).sum(), err

    @staticmethod
    def backward(ctx, grad_sum: Tensor | None, _grad_err: None) -> tuple[Tensor | None, Tensor | None]:
        if grad_sum is None:
            return None, None
        (err,) = ctx.saved_tensors
        grad_target = err * (grad_sum * 2) if ctx.needs_input_grad[0] else None
        grad_x_hat = err * (grad_sum * -2) if ctx.needs_input_grad[1] else None
        return grad_target, grad_x_hat


def squared_error(target: Tensor, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over every element of (target - x_hat)^2, differentiable; the error target - x_hat [B, F], detached).
    The same numbers, and the same gradients bit for bit, as autograd's ``err = target - x_hat;
    err.pow(2).sum()``, with one [B, F] pass in the backward instead of four."""
    return _SquaredError.apply(target, x_hat)
