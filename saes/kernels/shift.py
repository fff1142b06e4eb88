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


def centre(x: Tensor, shift: Tensor | None, by_sums: bool = True,
           row_scale: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(the rows (x - shift) / row_scale, then the shift and the row scale [B, 1] when :func:`shift_grad` must make
    their gradients, else None and None). The rows are computed without autograd when x takes no gradient and the
    shift does (``by_sums``: the caller follows with shift_grad); otherwise through autograd, as written."""
    if shift is None:
        return (x if row_scale is None else x / row_scale), None, None
    if by_sums and shift.requires_grad and not x.requires_grad and torch.is_grad_enabled():
        rows = x - shift.detach()
        return (rows if row_scale is None else rows / row_scale.detach()), shift, row_scale
    rows = x - shift
    return (rows if row_scale is None else rows / row_scale), None, None


def shift_grad(values: Tensor, indices: Tensor, W_rows: Tensor, shift: Tensor | None, alive: Tensor | None = None,
               row_scale: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``values`` [B, K] (the entries ``indices`` of rows W + bias, the rows (x - shift) / row_scale) unchanged, with
    the gradients of the shift and the row scale [B, 1] (where :func:`centre` handed them over): the shift's minus
    W_rows [D, L] times the values' gradients g (where ``alive`` [B, K], when given) divided by their row's scale and
    summed by latent; the row scale's minus the row's sum of g times (value - bias at the entry), over the scale.
    ``shift`` None: values as they are. (``sparse.encode`` keeps a bf16 step's ``x - shift`` in autograd: its grad_x
    reads W_enc rounded to bf16, and this product over the rounded rows would need a float32 copy of them.)"""
    if shift is None:
        return values
    if row_scale is None:
        return _ShiftGrad.apply(values, indices, W_rows, alive, None, None, shift)
    return _ShiftGrad.apply(values, indices, W_rows, alive, bias.detach(), row_scale, shift)


class _ShiftGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, W_rows, alive, bias, row_scale, shift):
        ctx.save_for_backward(values, indices, W_rows, alive, bias, row_scale)
        ctx.shift_dtype = shift.dtype
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        values, indices, W_rows, alive, bias, s = ctx.saved_tensors
        g = grad * alive if alive is not None else grad
        grad_s = grad_shift = None
        if s is not None and ctx.needs_input_grad[5]:  # d rows / d s = -rows / s; rows W at an entry: value - bias
            grad_s = ((g * (values - bias[indices])).sum(dim=1, keepdim=True) / s).neg_()
        if ctx.needs_input_grad[6]:
            g = (g if s is None else g / s).reshape(-1).to(torch.float32)
            sums = g.new_zeros(W_rows.shape[1]).index_add_(0, indices.reshape(-1), g)
            # W_rows [D, L]: a view of latent-major storage makes this a transposed matrix-vector product
            grad_shift = torch.mv(W_rows.to(torch.float32), sums).neg_().to(ctx.shift_dtype)
        return grad, None, None, None, None, grad_s, grad_shift
