"""Cross-layer transcoders (CLT; Ameisen et al. 2025, "Circuit Tracing"): one dictionary that replaces the MLPs of
S layers at once.

Latents come in S equal blocks of P = L / S. Block l reads only layer l's MLP input x_l (the residual stream
before the MLP) and writes to the MLP outputs of layer l and every later layer:

    f_l = TopK(x_l W_enc^l + b_enc^l)               (k per layer, so the whole code keeps S k latents)
    y_hat_m = sum_{l <= m} f_l W_dec^{l -> m} + b_dec_m

As a :class:`SparseCoder`, ``n_sources = S`` layers of width D, ``W_enc [D, L]`` (column block l is layer l's
encoder), ``W_dec [L, S*D]`` whose entries from a latent of layer l to a layer m < l are zero
(:meth:`SparseCoder.decoder_mask`; they are not held, see Memory below), ``b_dec [S*D]`` the outputs' bias. The training data is [B, 2S, D]: the S layers' MLP inputs, then their outputs
(``--hookpoint`` in that order), split by :meth:`SparseCoder.split` like a transcoder's pair. The per-layer FVU is
``EvalResult.per_source_fvu``; the decoder norm of each latent per target layer is
:meth:`SparseCoder.decoder_norms`.

Kinds: ``clt`` (TopK per layer and row, as above) and ``clt-batchtopk`` (BatchTopK per layer: the top k*B entries of
each layer's block over the batch, as the CLT libraries train; inference is JumpReLU with one threshold per layer,
estimated while training and calibrated per layer so that each layer's mean L0 on unseen rows is k).

Training is the one loop: per layer the shared TopK / BatchTopK training code (``common.train_code``: one fused
encode with that layer's AuxK code over its dead latents, BatchTopK's cut over every process), then per layer one
sparse decode through its block into the layers it reaches (the decode is the sum of S sparse decodes over the
upper block triangle of W_dec, half the work of one decode over the full width).

Memory: the decoder is held as its triangle, one parameter per layer, ``W_dec_l`` [P, (S - l) D] (layer l's latents
to the outputs of layers l..S-1: :func:`decoder_blocks`); the entries to earlier layers, which a CLT never writes,
are neither stored nor stepped by Adam. ``model.W_dec`` is the whole [L, S*D] made from the blocks on each read
(zeros below), and ``state_dict()`` / files / checkpoints keep that whole layout (hooks convert on save and load),
so every reader and every saved artifact is unchanged. With ``W_enc`` [D, L], Adam's two moments and the gradient,
a CLT holds 4 (D L (S + 1) / 2 + D L) floats: S = 26 layers, D = 2304, P = 16384 per layer plans at 217 GiB in
float32 on one device with the step's buffers (``conceptdict plan --kind clt``), against 400 GiB with the whole
decoder.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..comm import LOCAL, Comm, StepInputs, shard_bias, shard_sum
from .batchtopk import ThresholdSettings
from .common import relu_scores, shard_code, threshold_encode, train_code
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


def layer_slices(model: SparseCoder) -> list[tuple[slice, slice]]:
    """For each layer l: (its latents' slice of L, its input's slice of S*D)."""
    P, D = model.n_latents // model.n_sources, model.d_in
    return [(slice(l * P, (l + 1) * P), slice(l * D, (l + 1) * D)) for l in range(model.n_sources)]


class LayerEncoder(NamedTuple):
    """Layer l's encoder as ``common.train_code`` reads a model: uncentred (b_dec 0: the outputs' bias is not the
    input's), its k, its P latents."""

    W_enc: Tensor
    b_enc: Tensor
    b_dec: Tensor
    k: int
    n_latents: int
    kernel_impl: str


def block_name(layer: int) -> str:
    """The parameter holding layer ``layer``'s decoder block."""
    return f"W_dec_{layer}"


def decoder_blocks(model: SparseCoder) -> list[Tensor]:
    """Layer l's decoder block [P, (S - l) D] for each l: its latents' weights to the outputs of layers l..S-1."""
    return [getattr(model, block_name(l)) for l in range(model.n_sources)]


def add_decoder_blocks(model: SparseCoder, **kw: Any) -> None:
    """Register the decoder's blocks (uninitialised) and the hooks that give ``state_dict`` / ``load_state_dict``
    the whole [L, S*D] ``W_dec``."""
    S, D, P = model.n_sources, model.d_in, model.n_latents // model.n_sources
    for l in range(S):
        model.register_parameter(block_name(l), nn.Parameter(torch.empty(P, (S - l) * D, **kw)))
    model.register_state_dict_post_hook(_whole_in_state)
    model.register_load_state_dict_pre_hook(_blocks_from_state)


WRITES = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
          "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
"""The in-place operators of a tensor (besides the methods whose names end in ``_``)."""


class MadeOnRead(torch.Tensor):
    """A CLT's whole decoder as :func:`whole_decoder` makes it: any op reads it (and gives a plain tensor), an
    in-place one raises, since writing into this copy would change nothing the dictionary holds."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or name in WRITES or (kwargs or {}).get("out") is not None:
            raise RuntimeError(f"W_dec of a cross-layer transcoder is its decoder blocks joined when read; writing "
                               f"into it ({name}) would change nothing: set it with sae.assign_decoder(W) or write "
                               f"the blocks (sae.decoder_parts())")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _joined(blocks: list[Tensor], d: int) -> Tensor:
    """[L, S*D]: each layer's block [P, (S - l) D] with zeros to the earlier layers, stacked."""
    return torch.cat([F.pad(w, (l * d, 0)) for l, w in enumerate(blocks)])


def whole_decoder(model: SparseCoder) -> Tensor:
    """[L, S*D]: the blocks with zeros to the earlier layers (differentiable in the blocks; read-only:
    :class:`MadeOnRead`)."""
    return _joined(decoder_blocks(model), model.d_in).as_subclass(MadeOnRead)


def block_views(model: SparseCoder, W: Tensor) -> list[Tensor]:
    """The parts of a whole [L, S*D] decoder ``W`` that the blocks hold, in order."""
    D = model.d_in
    return [W[lat, l * D:] for l, (lat, _) in enumerate(layer_slices(model))]


def _whole_in_state(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    blocks = [state.pop(prefix + block_name(l)) for l in range(module.n_sources)]
    state[prefix + "W_dec"] = _joined(blocks, module.d_in)


def _blocks_from_state(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    W = state.pop(prefix + "W_dec", None)
    if W is None:
        return
    want = (module.n_latents, module.n_sources * module.d_in)
    if tuple(W.shape) != want:
        raise ValueError(f"W_dec has shape {tuple(W.shape)}, this {module.kind} needs {want}; load a dictionary of "
                         f"the same kind, latents, layers and width")
    for l, part in enumerate(block_views(module, W)):
        state[prefix + block_name(l)] = part


def dense_decode(model: SparseCoder, f: Tensor) -> Tensor:
    """Dense codes f [B, L] -> f W_dec [B, S*D] (without b_dec), block by block."""
    D, out = model.d_in, None
    for l, ((lat, _), w) in enumerate(zip(layer_slices(model), decoder_blocks(model))):
        part = F.pad(f[:, lat] @ w, (l * D, 0))
        out = part if out is None else out + part
    return out


def decode_code(model: SparseCoder, values: Tensor, indices: Tensor) -> Tensor:
    """A sparse code over all layers (values, latent indices [B, K]) -> its decode [B, S*D] without b_dec, each layer's
    entries through its block (the columns holding any of layer l's entries, others masked: a code built layer by
    layer, as AuxK's, reads each column in one block)."""
    P, D, out = model.n_latents // model.n_sources, model.d_in, None
    layer = indices // P
    for l, w in enumerate(decoder_blocks(model)):
        here = layer == l
        cols = here.any(0)
        if not bool(cols.any()):
            continue
        v, i = values[:, cols] * here[:, cols], (indices[:, cols] - l * P).clamp(0, P - 1)
        part = F.pad(kernels.sparse_decode(v, i, w, None, impl=model.kernel_impl, skip_zero_grads=True), (l * D, 0))
        out = part if out is None else out + part
    return out if out is not None else values.new_zeros(values.shape[0], model.n_sources * D)


def layered_decode(model: SparseCoder, values: list[Tensor], indices: list[Tensor], comm: Comm = LOCAL) -> Tensor:
    """sum over layers l of the sparse decode of layer l's code (values, indices within the layer [B, K_l]) through
    its block into the outputs of layers >= l -> [B, S*D] (with ``b_dec``). With latent shards (``comm.shards``)
    each shard decodes its latents of every layer and the partial decodes are summed (differentiable)."""
    D, out = model.d_in, None
    for l, (w, v, i) in enumerate(zip(decoder_blocks(model), values, indices)):
        part = kernels.sparse_decode(v, i, w, None, impl=model.kernel_impl, skip_zero_grads=True)
        part = F.pad(part, (l * D, 0))
        out = part if out is None else out + part
    return shard_sum(out + shard_bias(model.b_dec, comm), comm)


_ALIASES: dict[int, tuple[weakref.ref, Tensor]] = {}
"""id(W_enc) -> (a reference to it, a detached alias of it: same storage and version counter), kept so that the
layers' encoder columns have one base from step to step (``kernels.copies.rounded`` caches the bf16 copy by its
base); an entry goes when its W_enc does."""


def _alias(W: Tensor) -> Tensor:
    hit = _ALIASES.get(id(W))
    if hit is not None and hit[0]() is W and hit[1].data_ptr() == W.data_ptr() and hit[1].stride() == W.stride() \
            and hit[1].shape == W.shape:
        return hit[1]
    if hit is None or hit[0]() is not W:
        weakref.finalize(W, _ALIASES.pop, id(W), None)
    _ALIASES[id(W)] = (weakref.ref(W), W.detach())
    return _ALIASES[id(W)][1]


def layer_encoder_weights(model: SparseCoder) -> list[Tensor]:
    """Each layer's encoder columns ``W_enc[:, lat]`` [D, P] for a training step, their gradients written into ONE
    ``W_enc.grad``.

    Slicing the parameter (``model.W_enc[:, lat]``) would let autograd make each layer's gradient [D, P], widen it to a
    zero-padded [D, L], add the layers' and copy the sum into W_enc's layout: three transient gradients of the whole
    encoder's size on top of the layers' own. Here each layer's columns are a leaf (a view of W_enc's storage), and as
    soon as a layer's gradient is made it is added into its columns of ``W_enc.grad`` (allocated at zero by the first
    layer, in W_enc's layout) and dropped, so the kernel's buffer serves the next layer: the backward holds W_enc's
    gradient plus one layer's. The sums are the same numbers (each entry is one layer's gradient plus zero)."""
    W = model.W_enc
    if not (W.requires_grad and torch.is_grad_enabled()):
        return [W[:, lat] for lat, _ in layer_slices(model)]
    alias, views = _alias(W), []
    for lat, _ in layer_slices(model):
        view = alias[:, lat].requires_grad_()
        view.register_post_accumulate_grad_hook(functools.partial(_into_columns, W, lat))
        views.append(view)
    return views


@torch.no_grad()
def _into_columns(W: Tensor, lat: slice, view: Tensor) -> None:
    """Add a layer's gradient (``view.grad``) into its columns ``lat`` of ``W.grad`` and free it."""
    if W.grad is None:
        W.grad = torch.zeros_like(W)
    W.grad[:, lat].add_(view.grad)
    view.grad = None


def _train_rule(model: SparseCoder, x: Tensor, inputs: StepInputs, batch: bool) -> TrainOutput:
    """x: the layers' (normalised) MLP inputs [B_r, S*D]; returns the prediction of their outputs [B_r, S*D]. Per layer
    the shared training code (TopK per row, or BatchTopK over the batch: ``batch``), then :func:`layered_decode`."""
    dead, zero = inputs.dead, x.new_zeros(())
    codes = []
    for (lat, src), W_enc in zip(layer_slices(model), layer_encoder_weights(model)):
        layer = LayerEncoder(W_enc, model.b_enc[lat], zero, model.k, lat.stop - lat.start, model.kernel_impl)
        codes.append(train_code(layer, x[:, src], inputs._replace(dead=dead[lat] if dead is not None else None),
                                batch=batch))
    y_hat = layered_decode(model, [c.values for c in codes], [c.indices for c in codes], inputs.comm)
    fired = torch.cat([c.fired for c in codes])
    aux = None
    if dead is not None:
        aux = kernels.SparseCode(torch.cat([c.aux.values for c in codes], 1),
                                 torch.cat([c.aux.indices + lat.start for c, (lat, _) in
                                            zip(codes, layer_slices(model))], 1))
    smallest = None
    if batch:  # one threshold estimate per layer, over its latents
        P = model.n_latents // model.n_sources
        smallest = torch.stack([c.smallest for c in codes]).repeat_interleave(P)
    return TrainOutput(y_hat, fired, sum(c.l0 for c in codes), None, smallest, aux)


def _topk_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Kind ``clt``: TopK per layer and row."""
    return _train_rule(model, x, inputs, batch=False)


def _batchtopk_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Kind ``clt-batchtopk``: BatchTopK per layer (per row while ``inputs.per_row``, the run's TopK start)."""
    return _train_rule(model, x, inputs, batch=not inputs.per_row)


def _topk_encode(model: SparseCoder, x: Tensor, comm: Comm = LOCAL) -> Tensor:
    """Inference of ``clt``: TopK per layer of x_l W_enc^l + b_enc^l, as dense codes [B, L]. With latent shards
    (``comm.shards``): this shard's latents, each layer's kept where they are among the row's k largest of that
    layer over every shard (``common.shard_code``)."""
    f = torch.zeros(x.shape[0], model.n_latents, dtype=x.dtype, device=x.device)
    for lat, src in layer_slices(model):
        code = kernels.encode_topk(x[:, src], model.W_enc[:, lat], model.b_enc[lat], model.k, impl=model.kernel_impl)
        f.scatter_(1, code.indices + lat.start, shard_code(code.values, model.k, comm))
    return f


# inference of clt-batchtopk is JumpReLU: relu(pre) where it exceeds its latent's (its layer's) threshold;
# common.pre_activations reads each layer's input with its own encoder
KINDS = (
    KindSpec(_topk_train, _topk_encode, uses_aux=True, uses_threshold=False, sources="pair", layered=True,
             name="clt", mixed_precision=True, shard_encode=_topk_encode, shardable=True),
    KindSpec(_batchtopk_train, threshold_encode, uses_aux=True, uses_threshold=True, scores=relu_scores,
             sources="pair", layered=True, name="clt-batchtopk", settings=ThresholdSettings, calibrated=True,
             mixed_precision=True, shardable=True),
)
