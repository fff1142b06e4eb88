"""The optimisation pieces of one training step (saes.training.step): Adam in storage order, the learning-rate
schedule, the AuxK loss, the update (gradient projection, clipping, renormalisation) and the bookkeeping after a step
(dead-latent counters, the running threshold estimate)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .adam import Adam, RowsStep
from .checkpoint import TrainState
from .comm import LOCAL, Comm, centred_sum_sq, shard_sum
from .kernels import copies
from .model import SparseCoder


def make_optimizer(model: SparseCoder, lr: float) -> Adam:
    """Adam (betas 0.9, 0.999), fused (``saes.adam``: torch's fused kernel without torch.optim's start-up cost): the
    unfused CPU Adam cost ~300 ms against ~80 ms fused per step for 2.1M parameters in bench/train_step.py, several
    encoder matmuls' worth at D=768, L=16384.

    It steps each parameter in storage order (``_storage_order``): W_enc is a transposed view of
    latent-major storage, and the fused CPU Adam copies a non-contiguous tensor to a contiguous one and
    back (+45 ms per step at D=768, L=16384); Adam is elementwise, so stepping the contiguous alias is the
    same update. ``apply_update`` points the aliases' gradients at the parameters' before the step."""
    return Adam([_storage_order(p) for p in model.parameters()], lr=lr, betas=(0.9, 0.999))


def _storage_order(p: Tensor) -> Tensor:
    """``p``, or for a transposed 2-D parameter a detached alias of its contiguous storage (same memory)."""
    if p.is_contiguous() or p.dim() != 2 or not p.t().is_contiguous():
        return p
    return p.detach().t()


def _link_grads(model: SparseCoder, opt: Adam) -> None:
    """Give the optimizer's storage-order aliases (``make_optimizer``) their parameters' gradients."""
    params = [q for group in opt.param_groups for q in group["params"]]
    for p, q in zip(model.parameters(), params):
        if q is not p:
            q.grad = None if p.grad is None else p.grad.t()


def lr_at(step: int, base: float, warmup: int, total: int | None, decay_fraction: float) -> float:
    """Linear warm-up over ``warmup`` steps, constant, then linear decay to 0 over the last fraction of ``total``."""
    factor = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if total:
        decay_steps = int(total * decay_fraction)
        start = total - decay_steps
        if decay_steps > 0 and step >= start:
            factor = min(factor, max(0.0, (total - step) / decay_steps))
    return base * factor


def aux_loss(aux: "kernels.SparseCode", model: SparseCoder, residual: Tensor, comm: Comm = LOCAL) -> Tensor:
    """AuxK (OpenAI): the dead latents' code ``aux`` [B_r, K'] reconstructs the detached residual e [B_r, F]
    through ``model``'s decoder WITHOUT b_dec (:meth:`SparseCoder.sparse_decode`); returns this process's part of
    ||e - e_hat||^2 / ||e - mean(e)||^2 (the denominator over the whole batch; 0 when K' = 0). Latent shards: each
    decodes its latents' part of the code and the parts are summed."""
    sharded = comm.shards.size > 1
    if aux.values.shape[1] == 0 and not sharded:
        return residual.new_zeros(())
    e_hat = model.sparse_decode(aux.values, aux.indices) if aux.values.shape[1] else torch.zeros_like(residual)
    e_hat = shard_sum(e_hat, comm)
    _, denom = centred_sum_sq(residual, comm)
    return (residual - e_hat).pow(2).sum() / denom.clamp_min(1e-12)


def apply_update(model: SparseCoder, opt: Adam, loss: Tensor, lr: float, grad_clip: float,
                 comm: Comm = LOCAL) -> None:
    """Backpropagate ``loss`` (a parameter it does not reach gets a zero gradient), sum the gradients over
    processes, remove the decoder-gradient component parallel to each row, clip, take the Adam step at ``lr`` and
    renormalise the decoder rows."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():
        # a trainable parameter the step's loss did not reach takes a zero gradient, in one process as in
        # several (the processes' sum needs one), so that Adam's state never depends on the process count
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    comm.reduce_grads(model)
    shared = [p for name, p in model.named_parameters() if model.latent_axis(name) is None]
    if comm.shards.size > 1:  # every shard holds these: each has its latents' part of their gradient
        for p in shared:
            p.grad.copy_(comm.shards.all_sum(p.grad))
    unit = model.spec.unit_decoder
    if unit:
        model.remove_parallel_decoder_grad()
    if grad_clip > 0:
        clip_grads(model, grad_clip, comm, shared)
    _link_grads(model, opt)
    rows = fused_rows(model, opt)
    opt.step(rows)
    for i, how in rows.items():
        if how.copy is not None:  # written by the step from the new weights: current at their new version
            copies.refreshed(list(model.parameters())[i], torch.bfloat16)
    if unit and not rows:
        model.normalize_decoder()


def fused_rows(model: SparseCoder, opt: Adam) -> dict[int, RowsStep]:
    """The parameters the Adam step updates with ``kernels.adam_rows`` in one pass (by index): with the ``numba``
    kernels, the decoder's matrices (renormalised in the pass when the kind keeps unit rows) and the encoder's,
    each writing its bf16 copy when the step keeps one (``copies.kept``: the bf16 step read it). Empty otherwise:
    then Adam is torch's fused kernel over every parameter and the renormalisation a pass of its own."""
    impl = kernels.resolve_impl("adam_rows", model.kernel_impl, model.device, model.dtype)
    if impl != "numba":
        return {}
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    decoder = [index.get(id(W)) for W, _, _ in model.decoder_parts()]
    if None in decoder:
        return {}
    rows = {}
    for i in [*decoder, index.get(id(model.W_enc))]:
        if i is None or i in rows or params[i].dim() != 2:
            continue
        kept = copies.kept(params[i], torch.bfloat16)
        # Adam steps the parameter in storage order (make_optimizer): the copy in that order too
        copy = None if kept is None else (kept if opt.params[i] is params[i] else kept.t())
        rows[i] = RowsStep(unit=i in decoder and model.spec.unit_decoder, copy=copy, impl=impl)
    return rows


@torch.no_grad()
def clip_grads(model: SparseCoder, max_norm: float, comm: Comm, shared: list[Tensor]) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over the whole dictionary: with latent shards the norm counts every
    shard's latents once and the parameters every shard holds (``shared``) once.

    The gradients are multiplied only when the norm is above ``max_norm``: clip_grad_norm_ multiplies them by its
    coefficient clamped at 1 every step, and a multiplication by 1 changes no number (the same gradients, bit for
    bit) but reads and writes every gradient (~25 ms at D 768, L 16384 on this 2-core CPU). One process: the norm
    is :func:`grad_norm`'s (clip_grad_norm_'s in value, its float32 sums in another order)."""
    if comm.shards.size == 1:
        params = list(model.parameters())
        total = grad_norm([p.grad for p in params if p.grad is not None])
        if not max_norm / (total + 1e-6) >= 1.0:  # (a NaN norm multiplies, as clip_grad_norm_ does)
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return
    ids = {id(p) for p in shared}

    def sq(grads: list[Tensor]) -> Tensor:  # sum of squares, from one norm per tensor (no [L, D] temporaries)
        return torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().square().sum() if grads else \
            torch.zeros((), dtype=torch.float64)

    own = sq([p.grad for p in model.parameters() if id(p) not in ids])
    total = (comm.shards.all_sum(own) + sq([p.grad for p in shared])).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if not coef >= 1.0:  # a multiplication by 1 changes nothing (see above)
        for p in model.parameters():
            p.grad.mul_(coef.to(p.grad.dtype))


def grad_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of every gradient together (in their dtype, as ``torch.nn.utils.get_total_norm``): each one's sum of
    squares as the dot product of its storage with itself (BLAS, every thread; ``vector_norm`` and ``foreach_norm``
    reduce on one: 5.2-6.2 against 1.9 ms for a [16384, 768] pair at 2 threads on the AMX Xeon), summed in float64.
    The same norm as ``get_total_norm`` but for summation order (the dot's is the closer to the exact sum)."""
    if not grads:
        return torch.zeros(())
    sq = [torch.dot(f, f) for f in (_storage_order(g).reshape(-1) for g in grads)]  # (reshape then copies nothing)
    return torch.stack(sq).double().sum().sqrt().to(grads[0].dtype)


@torch.no_grad()
def update_threshold(model: SparseCoder, smallest: float | Tensor, momentum: float, st: TrainState) -> None:
    """theta <- m' * theta + (1 - m') * smallest with m' = min(m, n / (n + 1)) after n updates: the plain mean of
    the first 1 / (1 - m) estimates, then the exponential running estimate (short runs get a settled theta).
    ``smallest``: one number, or one per latent [L] (a cross-layer transcoder's, one per layer)."""
    n = st.threshold_updates
    m = min(momentum, n / (n + 1))
    model.threshold.mul_(m).add_((1 - m) * smallest)
    st.threshold_updates += 1


def as_threshold(model: SparseCoder, smallest: Tensor) -> float | Tensor:
    """A kind's ``TrainOutput.smallest`` as :func:`update_threshold` takes it: a float for one threshold, else a
    tensor [L] on the threshold's device."""
    return float(smallest) if smallest.dim() == 0 else smallest.detach().to(model.threshold)


def record_step(model: SparseCoder, st: TrainState, fired: Tensor, rows: int, smallest: Tensor | None,
                threshold_start: int, momentum: float) -> None:
    """After a step over ``rows`` rows: dead-latent counters (``fired`` bool [L]), the BatchTopK threshold
    estimate, and the step / row counts."""
    st.since_fired += rows
    st.since_fired[fired.cpu()] = 0
    if smallest is not None and st.step >= threshold_start:
        update_threshold(model, as_threshold(model, smallest), momentum, st)
    st.step += 1
    st.rows += rows
