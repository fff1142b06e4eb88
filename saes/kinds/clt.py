"""Cross-layer transcoders (CLT; Ameisen et al. 2025, "Circuit Tracing"): one dictionary that replaces the MLPs of
S layers at once.

Latents come in S equal blocks of P = L / S. Block l reads only layer l's MLP input x_l (the residual stream
before the MLP) and writes to the MLP outputs of layer l and every later layer:

    f_l = TopK(x_l W_enc^l + b_enc^l)               (k per layer, so the whole code keeps S k latents)
    y_hat_m = sum_{l <= m} f_l W_dec^{l -> m} + b_dec_m

As a :class:`SparseCoder`, ``n_sources = S`` layers of width D, ``W_enc [D, L]`` (column block l is layer l's
encoder), ``W_dec [L, S*D]`` whose entries from a latent of layer l to a layer m < l are zero
(:meth:`SparseCoder.decoder_mask`: the forward never reads them, the update keeps their gradient at zero), ``b_dec
[S*D]`` the outputs' bias. The training data is [B, 2S, D]: the S layers' MLP inputs, then their outputs
(``--hookpoint`` in that order), split by :meth:`SparseCoder.split` like a transcoder's pair. The per-layer FVU is
``EvalResult.per_source_fvu``; the decoder norm of each latent per target layer is
:meth:`SparseCoder.decoder_norms`.

Training is the one loop: per layer one fused encode (``kernels.encode``, with that layer's AuxK code over its
dead latents), per layer one sparse decode into the layers it reaches (the decode is the sum of S sparse
decodes over the upper block triangle of W_dec, half the work of one decode over the full width).

Memory: ``W_dec`` holds the full [L, S*D] (the triangle is about half of it) and ``W_enc`` [D, L]; with Adam's two
moments and the gradient that is 4 (S D L + D L) floats: S = 12 layers, D = 768, P = 8192 latents per layer
(L = 98304) is 4 x 13 x 768 x 98304 x 4 bytes = 15.7 GB, within one 80 GB GPU; S = 26, D = 2304, P = 16384 is
about 400 GB and needs the decoder sharded or streamed (not done here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..comm import StepInputs
from .common import fired_from_code
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def layer_slices(model: SparseCoder) -> list[tuple[slice, slice]]:
    """For each layer l: (its latents' slice of L, its input's slice of S*D)."""
    P, D = model.n_latents // model.n_sources, model.d_in
    return [(slice(l * P, (l + 1) * P), slice(l * D, (l + 1) * D)) for l in range(model.n_sources)]


def layered_decode(model: SparseCoder, values: list[Tensor], indices: list[Tensor]) -> Tensor:
    """sum over layers l of the sparse decode of layer l's code (values, indices within the layer [B, K_l]) into the
    outputs of layers >= l -> [B, S*D] (with ``b_dec``). Reads only the decoder's upper block triangle."""
    D, out = model.d_in, None
    for l, ((lat, _), v, i) in enumerate(zip(layer_slices(model), values, indices)):
        part = kernels.sparse_decode(v, i, model.W_dec[lat, l * D:], None, impl=model.kernel_impl,
                                     skip_zero_grads=True)
        part = F.pad(part, (l * D, 0))
        out = part if out is None else out + part
    return out + model.b_dec


def _train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """x: the layers' (normalised) MLP inputs [B_r, S*D]; returns the prediction of their outputs [B_r, S*D]. Per layer
    one fused TopK encode (its AuxK code from the same pre-activations), then :func:`layered_decode`."""
    dead = inputs.dead
    values, indices, aux_v, aux_i = [], [], [], []
    for lat, src in layer_slices(model):
        enc = kernels.encode(x[:, src], model.W_enc[:, lat], model.b_enc[lat], model.k,
                             dead=dead[lat] if dead is not None else None,
                             k_aux=inputs.k_aux if dead is not None else 0, impl=model.kernel_impl,
                             mm_dtype=inputs.matmul_dtype)
        values.append(enc.values)
        indices.append(enc.indices)
        if dead is not None:
            aux_v.append(enc.aux_values)
            aux_i.append(enc.aux_indices + lat.start)
    y_hat = layered_decode(model, values, indices)
    fired, l0 = fired_from_code(torch.cat(values, 1).detach(),
                                torch.cat([i + lat.start for i, (lat, _) in zip(indices, layer_slices(model))], 1),
                                model.n_latents)
    aux = kernels.SparseCode(torch.cat(aux_v, 1), torch.cat(aux_i, 1)) if dead is not None else None
    return TrainOutput(y_hat, fired, l0, None, None, aux)


def _encode(model: SparseCoder, x: Tensor) -> Tensor:
    """Inference: TopK per layer of x_l W_enc^l + b_enc^l, as dense codes [B, L]."""
    f = torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device)
    for lat, src in layer_slices(model):
        code = kernels.encode_topk(x[:, src], model.W_enc[:, lat], model.b_enc[lat], model.k, impl=model.kernel_impl)
        f.scatter_(1, code.indices + lat.start, code.values)
    return f


KINDS = (
    KindSpec(_train, _encode, uses_aux=True, uses_threshold=False, sources="pair", layered=True, name="clt",
             mixed_precision=True),
)
