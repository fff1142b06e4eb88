"""Transcoders and skip transcoders, kinds of :class:`SparseCoder` that read a pair of sources.

A transcoder (Dunefsky, Chlenski, Nanda 2024) reads a component's input x (e.g. an MLP's input hookpoint) and
predicts its output y (the MLP's output hookpoint) through a sparse code:

    f = TopK(x W_enc + b_enc),   y_hat = f W_dec + b_dec   (+ x W_skip for a skip transcoder, Paulo et al. 2025)

``W_skip`` [D, D] starts at zero, so a skip transcoder begins as a plain one and learns the linear part of the
component that a sparse code would otherwise spend latents on. The encoder does not subtract ``b_dec`` (it is
the OUTPUT's bias; an input bias would be redundant with ``b_enc``), as in EleutherAI's sparsify.

Selection rule: per-row TopK. Every row keeps exactly k latents, so a transcoder and an SAE trained at the same
k are compared at the same L0 without a calibrated threshold; the row-relative BatchTopK rule of ``batchtopk``
ranks by the norm of the row it reconstructs, which for a transcoder is the output, not the input the code is
read from; and it is sparsify's rule for its transcoders, so the dictionaries export there unchanged.

Training data: one store holding both hookpoints (``conceptdict cache --hookpoint IN --hookpoint OUT``),
streamed as [B, 2, D] pairs by ``activations.stream_batches`` and split by :meth:`SparseCoder.split`; the
training loop and ``saes.evaluate`` measure FVU against the output. Both hookpoints must share D.

Kinds: ``transcoder`` and ``skip-transcoder``. Shapes: B rows, D width, L latents, K = k kept per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import kernels
from ..comm import StepInputs
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def _train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """x: the (normalised) input half [B_r, D] of the batch; returns the prediction of the output half.
    One fused TopK encode (with the AuxK code over dead latents from the same pre-activations), one sparse
    decode, plus the dense skip path."""
    dead = inputs.dead
    enc = kernels.encode(x, model.W_enc, model.b_enc, model.k, dead=dead, k_aux=inputs.k_aux if dead is not None else 0,
                         impl=model.kernel_impl, mm_dtype=inputs.matmul_dtype)
    y_hat = kernels.sparse_decode(enc.values, enc.indices, model.W_dec, model.b_dec, impl=model.kernel_impl,
                                  skip_zero_grads=True)
    if model.spec.skip:
        y_hat = y_hat + x @ model.W_skip
    active = enc.values > 0
    fired = torch.zeros(model.n_latents, dtype=torch.bool, device=x.device)
    fired[enc.indices[active]] = True
    aux = kernels.SparseCode(enc.aux_values, enc.aux_indices) if dead is not None else None
    return TrainOutput(y_hat, fired, active.sum(dim=1).float().mean().detach(), None, None, aux)


def _encode(model: SparseCoder, x: Tensor) -> Tensor:
    """Inference: TopK(x W_enc + b_enc) as dense codes [B, L]."""
    code = kernels.encode_topk(x, model.W_enc, model.b_enc, model.k, impl=model.kernel_impl)
    return torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device).scatter_(1, code.indices,
                                                                                              code.values)


KINDS = (
    KindSpec(_train, _encode, uses_aux=True, uses_threshold=False, sources="pair", name="transcoder",
             mixed_precision=True),
    KindSpec(_train, _encode, uses_aux=True, uses_threshold=False, sources="pair", skip=True,
             name="skip-transcoder", mixed_precision=True),
)
