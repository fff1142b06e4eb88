"""Obviously-correct dense torch references for every kernel in this package.

Everything here is plain autograd over dense tensors: slow (several dense [B, L] passes), but easy to
check by eye. Every fast implementation is tested against these, values and gradients.

Shapes: B batch rows, D input width (for crosscoders S*D, the sources flattened), L latents,
K kept entries per row (k for TopK; the row's maximum for BatchTopK, padded with zeros).
"""

from __future__ import annotations

import torch
from torch import Tensor


def pre_activations(x: Tensor, W_enc: Tensor, b_enc: Tensor) -> Tensor:
    """x [B, D], W_enc [D, L], b_enc [L] -> pre [B, L] (before the ReLU)."""
    return x @ W_enc + b_enc


def topk_rows(acts: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """acts [B, L] (already ReLU'd) -> values [B, k], indices [B, k] (int64), per row, largest first."""
    values, indices = acts.topk(k, dim=-1, sorted=True)
    return values, indices


def batch_topk(acts: Tensor, k: int, scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Keep the top ``k * B`` entries of the whole batch.

    acts [B, L] (already ReLU'd); ``scale`` [L] optional ranking weights (a crosscoder ranks
    ``acts * sum_s |d_j^s|`` but keeps the unscaled ``acts``). Returns values [B, K], indices [B, K]
    padded with (0.0, 0) where a row keeps fewer than K = the largest per-row count, and the
    smallest kept activation (unscaled), a 0-dim tensor used for the inference threshold.
    Entries equal to zero are never kept; entries tied with the (k*B)-th largest score all are (the cut
    is a value, so the choice does not depend on how the batch is ordered or split over processes).
    """
    B, L = acts.shape
    n_keep = min(k * B, B * L)
    score = acts if scale is None else acts * scale
    cut = score.flatten().topk(n_keep, sorted=False).values.min() if n_keep else score.new_tensor(float("inf"))
    keep = (score >= cut) & (acts > 0)
    counts = keep.sum(dim=1)
    K = max(int(counts.max().item()) if B else 0, 1)
    # stable order: kept entries first (in latent order), then padding
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :K]
    indices = torch.where(torch.arange(K, device=acts.device) < counts[:, None], order, 0)
    values = acts.gather(1, indices) * (torch.arange(K, device=acts.device) < counts[:, None])
    kept = acts[keep]
    smallest = kept.min() if kept.numel() else acts.new_zeros(())
    return values, indices, smallest.detach()


def grads_kept(values: Tensor, skip_zero_grads: bool | Tensor) -> Tensor:
    """``values`` whose gradient is cut where ``skip_zero_grads`` says: nowhere (False), at the values exactly 0
    (True), or where the bool mask [B, K] is False."""
    if not isinstance(skip_zero_grads, Tensor) and not skip_zero_grads:
        return values
    keep = skip_zero_grads if isinstance(skip_zero_grads, Tensor) else values != 0
    return torch.where(keep, values, values.detach())


def sparse_decode(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor,
                  skip_zero_grads: bool | Tensor = False, rows_dtype: torch.dtype | None = None) -> Tensor:
    """values [B, K], indices [B, K], W_dec [L, D], b_dec [D] -> x_hat [B, D] = sum_j v_j W_dec[i_j] + b_dec.

    ``skip_zero_grads``: values exactly 0 get a zero gradient (a bool tensor [B, K]: the entries where it is False);
    ``rows_dtype``: W_dec's rows are read rounded to it, its gradient is W_dec's (see ``saes.kernels.sparse_decode``)."""
    if rows_dtype is not None:
        W_dec = rounded_rows(W_dec, rows_dtype)
    values = grads_kept(values, skip_zero_grads)
    B = values.shape[0]
    L = W_dec.shape[0]
    dense = values.new_zeros(B, L).scatter_add(1, indices, values)
    return dense @ W_dec if b_dec is None else dense @ W_dec + b_dec


@torch.no_grad()
def project_rows(W: Tensor, G: Tensor) -> None:
    """In place: G[r] -= (<G[r], W[r]> / |W[r]|^2) W[r] for every row r (|W[r]|^2 at least 1e-24), without [L, D]
    temporaries."""
    coef = torch.linalg.vecdot(W, G) / W.norm(dim=1).square().clamp_min(1e-24)
    G.addcmul_(W, coef[:, None], value=-1)


def adam_rows(W: Tensor, G: Tensor, M: Tensor, V: Tensor, step: Tensor, lr: float, beta1: float, beta2: float,
              eps: float, unit: bool, copy: Tensor | None) -> None:
    """The unfused update of one weight matrix W [L, F], in place: torch's fused Adam step (moments M, V; ``step``
    the step count after this step's increment), then with ``unit`` every row divided by its norm (clamped at
    1e-12), then with ``copy`` W rounded into it (a tensor of W's shape in another dtype, e.g. the bf16 copy)."""
    torch._fused_adam_([W], [G], [M], [V], [], [step], amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                       weight_decay=0.0, eps=eps, maximize=False, grad_scale=None, found_inf=None)
    if unit:
        W /= W.norm(dim=1, keepdim=True).clamp_min(1e-12)
    if copy is not None:
        copy.copy_(W)


def rounded_rows(W: Tensor, dtype: torch.dtype) -> Tensor:
    """W rounded to ``dtype`` (and back to W's) in value, W itself in gradient: a product with it reads the rounded
    weights and hands their gradient to W unchanged (what the fast kernels do with a bf16 copy of the weights)."""
    return W + (W.detach().to(dtype).to(W.dtype) - W.detach())


def encode_topk(x: Tensor, W_enc: Tensor, b_enc: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """x [B, D] -> values [B, k], indices [B, k] of TopK(ReLU(x W_enc + b_enc)).

    Gradients flow to x, W_enc and b_enc through the kept values only."""
    acts = torch.relu(pre_activations(x, W_enc, b_enc))
    return topk_rows(acts, k)


def encode_aux(x: Tensor, W_enc: Tensor, b_enc: Tensor, dead: Tensor, k_aux: int) -> tuple[Tensor, Tensor]:
    """AuxK codes: top ``k_aux`` of ReLU(pre) among the ``dead`` latents (bool [L]) per row.

    Returns values [B, K'], indices [B, K'] with K' = min(k_aux, #dead); K' = 0 gives empty tensors."""
    n_dead = int(dead.sum().item())
    kk = min(k_aux, n_dead)
    B = x.shape[0]
    if kk == 0:
        return x.new_zeros(B, 0), torch.zeros(B, 0, dtype=torch.long, device=x.device)
    acts = torch.relu(pre_activations(x, W_enc, b_enc))
    masked = acts.masked_fill(~dead, -1.0)
    values, indices = masked.topk(kk, dim=-1, sorted=True)
    return values.clamp_min(0.0), indices


def encode(
    x: Tensor,
    W_enc: Tensor,
    b_enc: Tensor,
    k: int,
    *,
    batch: bool = False,
    scale: Tensor | None = None,
    dead: Tensor | None = None,
    k_aux: int = 0,
    shift: Tensor | None = None,
    row_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused encode, densely: (values, indices, aux_values, aux_indices, smallest); see kernels.encode."""
    if shift is not None:
        x = x - shift
    if row_scale is not None:
        x = x / row_scale
    B = x.shape[0]
    acts = torch.relu(pre_activations(x, W_enc, b_enc))
    smallest = acts.new_zeros(())
    if k == 0:
        values, indices = acts.new_zeros(B, 0), torch.zeros(B, 0, dtype=torch.long, device=x.device)
    elif batch:
        values, indices, smallest = batch_topk(acts, k, scale)
    else:
        values, indices = topk_rows(acts, k)
    if dead is None or k_aux == 0:
        aux_values, aux_indices = encode_aux(x, W_enc, b_enc, torch.zeros(W_enc.shape[1], dtype=torch.bool), 0)
    else:
        aux_values, aux_indices = encode_aux(x, W_enc, b_enc, dead, k_aux)
    return values, indices, aux_values, aux_indices, smallest


# ---------------------------------------------------------------- the JumpReLU, Matryoshka and SpaDE kinds


def gather_pre(x: Tensor, W_enc: Tensor, indices: Tensor, values: Tensor | None = None) -> Tensor:
    """(x W_enc) at indices [B, K] -> [B, K], by the dense matmul; ``values`` (given): those values, with the
    gradient of the gathered product."""
    pre = (x @ W_enc).gather(1, indices)
    return pre if values is None else values + (pre - pre.detach())


def pack(mask: Tensor) -> tuple[Tensor, Tensor]:
    """bool [B, L] -> (indices [B, K], kept [B, K]): each row's True columns in increasing order, padded with
    (0, False) to K = the largest row count (at least 1)."""
    counts = mask.sum(dim=1)
    K = max(int(counts.max()) if mask.shape[0] else 0, 1)
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :K]
    kept = torch.arange(K, device=mask.device) < counts[:, None]
    return torch.where(kept, order, 0), kept


def encode_above(x: Tensor, W_enc: Tensor, b_enc: Tensor, floor: Tensor, k: int = 1,
                 shift: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The entries of pre = (x - shift) W_enc + b_enc above ``floor`` [L]: (pre there [B, K], indices, kept [B, K]),
    by the dense matmul (``k`` only sizes the fast implementations' buffers)."""
    pre = pre_activations(x if shift is None else x - shift, W_enc, b_enc)
    indices, kept = pack(pre > floor)
    return pre.gather(1, indices), indices, kept


def sparsemax(z: Tensor) -> Tensor:
    """Sparsemax over the last axis (Martins & Astudillo 2016): the Euclidean projection of each row onto the
    probability simplex, max(z - tau, 0) with tau from the sorted row."""
    zs = z.sort(dim=-1, descending=True).values
    cs = zs.cumsum(dim=-1)
    j = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    size = (1 + j * zs > cs).sum(dim=-1, keepdim=True)
    tau = (cs.gather(-1, size - 1) - 1) / size.to(z.dtype)
    return (z - tau).clamp_min(0)


@torch.no_grad()
def sparsemax_support(pre: Tensor, scale: Tensor, m: int = 0) -> tuple[Tensor, Tensor]:
    """The support of sparsemax(pre * scale) per row of pre [n, L], from the whole sorted row (as ``sparsemax``):
    (indices [n, K] by decreasing score, zero-padded after each row's support; size [n]), K the largest size.
    ``m`` (the fast searches' candidates per row) is not used."""
    zs, order = (pre * scale).sort(dim=1, descending=True)
    j = torch.arange(1, pre.shape[1] + 1, device=pre.device, dtype=zs.dtype)
    size = (1 + j * zs > zs.cumsum(dim=1)).sum(dim=1)
    K = max(int(size.max()) if size.numel() else 0, 1)
    return order[:, :K] * (torch.arange(K, device=pre.device) < size[:, None]), size


def sparsemax_pack(pre: Tensor, scale: Tensor, m: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`sparsemax_support`'s (indices, size) and the scores ``pre`` there, 0 after each row's support [n, K]."""
    idx, size = sparsemax_support(pre, scale, m)
    return idx, size, scores_at_support(pre, idx, size)


def scores_at_support(pre: Tensor, idx: Tensor, size: Tensor) -> Tensor:
    """pre [n, L] at the packed support idx [n, K] (its first ``size`` entries a row), 0 after it."""
    return torch.where(torch.arange(idx.shape[1], device=idx.device) < size[:, None], pre.gather(1, idx), 0.0)


@torch.no_grad()
def code_fired(values: Tensor, indices: Tensor, n_latents: int) -> tuple[Tensor, Tensor]:
    """(fired [L] bool: the latents with a positive entry, count [B] int64: each row's positive entries) of a
    zero-padded code values / indices [B, K]. The entries that did not fire write into a slot past the last latent,
    cut off (no boolean index)."""
    active = values > 0
    fired = torch.zeros(n_latents + 1, dtype=torch.bool, device=values.device)
    fired[torch.where(active, indices, n_latents)] = True
    return fired[:n_latents], active.sum(dim=1)


def encode_sparsemax(x: Tensor, W_enc: Tensor, b_enc: Tensor, scale: Tensor,
                     n_candidates: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """f = sparsemax((x W_enc + b_enc) * scale) per row, packed: (f [B, K], indices, z there [B, K], kept)."""
    z = pre_activations(x, W_enc, b_enc) * scale
    f = sparsemax(z)
    indices, kept = pack(f > 0)
    return f.gather(1, indices) * kept, indices, z.gather(1, indices), kept


def prefix_decodes(values: Tensor, indices: Tensor, W_dec: Tensor, b_dec: Tensor,
                   bounds: list[int]) -> list[Tensor]:
    """For each bound m: b_dec + sum of the code's entries with index < m decoded, [B, D] each (dense)."""
    dense = values.new_zeros(values.shape[0], W_dec.shape[0]).scatter_add(1, indices, values)
    cols = torch.arange(W_dec.shape[0], device=values.device)
    return [(dense * (cols < m)) @ W_dec + b_dec for m in bounds]
