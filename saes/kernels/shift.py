"""The encoders' ``shift=`` (``kernels.encode``, ``kernels.encode_above``): the rows minus a shift [D] (the kinds'
``x - b_dec``), with the shift's gradient made from the entries' gradients summed by latent.

The gradient of ``x - shift`` in the shift is minus the rows' gradient summed over the rows, and the rows' gradient
of a sparse encoder is a gather-sum over every entry (``encoder_backward``'s grad_x: B K D multiply-adds reading a
row of W_enc each). Summed over the rows, that is minus W_enc times the entries' gradients summed by latent (an
index_add over B K numbers, then one matrix-vector product over W_enc): when the rows themselves take no gradient,
the encoder's backward skips grad_x (``want_x=False``) and :func:`shift_grad` makes the shift's. The same sum in
another order (float32 rounding apart, not bit for bit); ``tests/test_kernels_shift.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def centre(x: Tensor, shift: Tensor | None, by_sums: bool = True) -> tuple[Tensor, Tensor | None]:
    """(x - shift, the shift when :func:`shift_grad` must make its gradient, else None). The subtraction runs without
    autograd when x takes no gradient and the shift does (``by_sums``: the caller can follow with shift_grad);
    otherwise through autograd, as ``x - shift`` (then None)."""
    if shift is None:
        return x, None
    if by_sums and shift.requires_grad and not x.requires_grad and torch.is_grad_enabled():
        return x - shift.detach(), shift
    return x - shift, None


def shift_grad(values: Tensor, indices: Tensor, W_rows: Tensor, shift: Tensor | None,
               alive: Tensor | None = None) -> Tensor:
    """``values`` [B, K] (the entries ``indices`` of (x - shift) W) unchanged, with the shift's gradient: minus
    W_rows [D, L] times the values' gradients (where ``alive`` [B, K], when given) summed by latent. W_rows: W
    (a bf16 step passes the float32 W_enc too, where its grad_x read the rounded rows: the exact product's gradient,
    without a float32 copy of the rounded rows, 50 MB a step at D 768, L 16384). ``shift`` None: values as they
    are."""
    if shift is None:
        return values
    return _ShiftGrad.apply(values, indices, W_rows, alive, shift)


class _ShiftGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, W_rows, alive, shift):
        ctx.save_for_backward(indices, W_rows, alive)
        ctx.has_alive = alive is not None
        ctx.shift_dtype = shift.dtype
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        indices, W_rows, alive = ctx.saved_tensors
        grad_shift = None
        if ctx.needs_input_grad[4]:
            g = (grad * alive if ctx.has_alive else grad).reshape(-1).to(torch.float32)
            sums = g.new_zeros(W_rows.shape[1]).index_add_(0, indices.reshape(-1), g)
            # W_rows [D, L]: a view of latent-major storage makes this a transposed matrix-vector product
            grad_shift = torch.mv(W_rows.to(torch.float32), sums).neg_().to(ctx.shift_dtype)
        return grad, None, None, None, grad_shift
