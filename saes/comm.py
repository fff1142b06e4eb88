"""The communication seam of the training loop: everything a step needs to know about other processes.

:func:`conceptdict.saes.train` runs ONE loop and ONE step for every kind. Where the step needs a number
of the whole batch (its row count, the FVU denominator, the BatchTopK cut, the latents that fired, the
gradients) it asks a :class:`Comm`. In one process that is :data:`LOCAL`, whose operations are the
identity; under torch.distributed it is ``saes.distributed.TorchComm``, which all-reduces and gathers.
A data-parallel run is therefore the same code as a single-process run, and a new kind written against
this seam trains data-parallel without further work.

Latent sharding (``TrainConfig.latent_shards``) is a second communicator on the same seam: ``comm.shards``, the
processes that hold the other latents of this process's dictionary and read the same rows. A ``Comm``'s own
operations span its data group (the processes holding the same latents, each its part of the batch); what spans
the latents goes through ``comm.shards`` (the decode's partial sums, the TopK candidates, the gradients of the
parameters every shard holds), and what spans the whole job through :func:`job_sum` / :func:`job_min` /
:func:`job_gather`. One process, or data parallel alone, has ``shards.size == 1`` and every such step is the identity.

Shapes: B global batch rows, B_r this process's rows, F = S*D the flattened width, L latents (L_s this shard's).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Comm(Protocol):
    """How this process's part of a batch meets the other processes' parts."""

    rank: int
    """This process's index in the job (0 in one process)."""
    size: int
    """Processes in the job (1 in one process)."""

    def all_sum(self, t: Tensor) -> Tensor:
        """Sum of ``t`` over processes (a tensor on t's device)."""

    def all_min(self, t: Tensor) -> Tensor:
        """Elementwise minimum of ``t`` over processes."""

    def any(self, mask: Tensor) -> Tensor:
        """Elementwise OR of a bool tensor over processes."""

    def gather_rows(self, x: Tensor) -> Tensor:
        """Every process's rows of x [B_r, ...] concatenated in rank order -> [B, ...]."""

    def gather_to_first(self, x: Tensor) -> Tensor | None:
        """:meth:`gather_rows` onto process 0 alone (the others only send and get None): what one writer needs."""

    def reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over processes, in place."""

    def barrier(self) -> None:
        """Wait for every process."""

    @property
    def shards(self) -> "Comm":
        """The latent-shard group: the processes holding this dictionary's other latents (size 1: unsharded)."""


class LocalComm:
    """The seam of one process: this process holds the whole batch, every operation is the identity."""

    rank = 0
    size = 1

    def all_sum(self, t: Tensor) -> Tensor:
        return t

    def all_min(self, t: Tensor) -> Tensor:
        return t

    def any(self, mask: Tensor) -> Tensor:
        return mask

    def gather_rows(self, x: Tensor) -> Tensor:
        return x

    def gather_to_first(self, x: Tensor) -> Tensor | None:
        return x

    def reduce_grads(self, model: torch.nn.Module) -> None:
        return None

    def barrier(self) -> None:
        return None

    @property
    def shards(self) -> "LocalComm":
        return self


LOCAL = LocalComm()
"""The one-process seam (the default of ``saes.train``)."""


def is_main(comm: Comm) -> bool:
    """True on the process that logs and writes files (rank 0 of the job: data rank 0 of latent shard 0)."""
    return comm.rank == 0 and comm.shards.rank == 0


def job_sum(comm: Comm, t: Tensor) -> Tensor:
    """Sum of ``t`` over every process of the job (the data group, then the latent shards)."""
    return comm.shards.all_sum(comm.all_sum(t))


def job_min(comm: Comm, t: Tensor) -> Tensor:
    """Elementwise minimum of ``t`` over every process of the job."""
    return comm.shards.all_min(comm.all_min(t))


def job_gather(comm: Comm, x: Tensor) -> Tensor:
    """Every process's rows of ``x`` concatenated (data ranks within each shard, then the shards)."""
    return comm.shards.gather_rows(comm.gather_rows(x))


class _ShardSum(torch.autograd.Function):
    """Sum over the latent shards; its gradient is the incoming one unchanged (every shard computes the same loss
    of the sum, so d loss / d part = d loss / d sum on each)."""

    @staticmethod
    def forward(ctx, t: Tensor, shards: "Comm") -> Tensor:
        return shards.all_sum(t)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


def shard_sum(t: Tensor, comm: Comm) -> Tensor:
    """The sum over the latent shards of each one's part ``t`` (a partial reconstruction), differentiable; ``t``
    itself without sharding."""
    return t if comm.shards.size == 1 else _ShardSum.apply(t, comm.shards)


def shard_bias(bias: Tensor, comm: Comm) -> Tensor:
    """A parameter every shard holds (b_dec), added to one part of a :func:`shard_sum`: itself on shard 0, zeros
    elsewhere, so the sum holds it once and its gradient from that sum reaches one shard."""
    return bias if comm.shards.rank == 0 else torch.zeros_like(bias)


class BatchStats(NamedTuple):
    """Statistics of one step's WHOLE batch, identical on every process; computed once per step by the loop
    and handed to the kind's forward (penalties normalised by the batch use them, never local ones)."""

    rows: int
    """B, the rows of the whole batch."""
    total_var: Tensor
    """0-dim: sum over the whole batch of |x - mean(x)|^2, clamped at 1e-12 (the FVU denominator)."""

    @property
    def row_var(self) -> Tensor:
        """Mean squared distance of a row to the batch mean, total_var / B."""
        return (self.total_var / self.rows).clamp_min(1e-12)


def centred_sum_sq(x: Tensor, comm: Comm) -> tuple[int, Tensor]:
    """(rows B, sum over the whole batch of |x - mean|^2) for this process's rows x [B_r, F]."""
    rows = int(comm.all_sum(torch.tensor(x.shape[0])))  # a CPU count: no device sync in one process
    mean = comm.all_sum(x.sum(dim=0)) / rows
    return rows, comm.all_sum((x - mean).pow(2).sum())


def batch_stats(x: Tensor, comm: Comm) -> BatchStats:
    """Row count and FVU denominator of the batch whose rows x [B_r, F] this process holds."""
    rows, total = centred_sum_sq(x, comm)
    return BatchStats(rows, total.clamp_min(1e-12))


class StepInputs(NamedTuple):
    """What the loop hands a kind's training forward besides the model and this process's rows (built by
    keyword)."""

    stats: BatchStats
    """The whole batch's statistics."""
    comm: Comm
    """The seam, for kinds whose selection spans the batch (BatchTopK's global cut)."""
    dead: Tensor | None = None
    """bool [L]: the dead latents the AuxK code must cover; None: no AuxK code this step."""
    k_aux: int = 0
    """Dead latents per row in the AuxK code."""
    settings: Any = None
    """The kind's settings (an instance of its ``KindSpec.settings`` dataclass: JumpReLU's bandwidth, Matryoshka's
    groups, ReLU's ``l1_coeff``); None outside a training run and for kinds without settings."""
    warmup: float = 1.0
    """Warm-up factor in (0, 1] of the kind's sparsity coefficient at this step (JumpReLU)."""
    schedule: float = 1.0
    """The learning rate's schedule factor at this step (its lr over the base lr: warm-up, then 1, then the final
    decay to 0), for penalties that follow it (the ``code_l1`` tie-break of the selection kinds)."""
    code_l1: float = 0.0
    """Weight of the selection kinds' L1 tie-break (the run's resolved ``code_l1``); 0 outside a training run."""
    per_row: bool = False
    """batchtopk, matryoshka, jumprelu: select per row (TopK) at this step, the run's TopK start
    (``TrainConfig.topk_start``)."""
    matmul_dtype: torch.dtype | None = None
    """torch.bfloat16 / float16: the dtype of the fused encoder's matmul (``TrainConfig.precision``), handed to
    ``kernels.encode(mm_dtype=)``; None: float32."""


def local_inputs(x: Tensor, **kw) -> StepInputs:
    """StepInputs of a batch x [B, F] held whole by this process (tests, evaluation, one-off calls)."""
    return StepInputs(batch_stats(x, LOCAL), LOCAL, **kw)
