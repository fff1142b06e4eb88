"""Data-parallel training over ``torch.distributed``: the seam that makes N processes train the dictionary
one process would.

There is no training loop here: :func:`conceptdict.saes.train` is the one loop, and :class:`TorchComm` is
the communication seam (saes.comm) it is handed under ``torchrun --nproc_per_node=N``. Every process holds
a full copy of the dictionary and reads its own contiguous slice of every GLOBAL batch
(``conceptdict.activations.stream_batches(..., part=(rank, world_size))``), so ``--batch-size`` is the global batch and
``--tokens`` / ``--seed`` mean what they mean in one process. Through the seam each step makes the loss of
one process out of per-process parts:

- batch statistics are global (``saes.comm.batch_stats``): the FVU and AuxK denominators, the row count
  behind the dead-latent counter, the normalisers of the kinds' penalties (small all-reduces);
- BatchTopK kinds select over the GLOBAL batch: each process keeps its local top ``k * B`` candidates, the
  candidates' scores are gathered (:meth:`TorchComm.gather_rows`) and the ``k * B``-th largest is the cut
  every process applies; the inference threshold is learned from the global smallest kept score
  (``saes.model.sparse_train_forward``);
- each process back-propagates its part of that global loss and the gradients are summed by an explicit
  all-reduce per parameter (:meth:`TorchComm.reduce_grads`), after which every process takes the same step;
- the dead-latent "fired" masks are OR-reduced, the logged metrics are global.

The training state is therefore independent of the number of processes: checkpoints (written by rank 0
only) resume under any number of processes, or in one.

Latent shards (``--latent-shards N``, :func:`process_group_comm`): rank ``g`` of the job's ``N x R`` processes holds
latent shard ``g % N`` and reads data part ``g // N``. The :class:`TorchComm` a process trains with spans its data
group (the R processes holding its latents); its ``shards`` is the TorchComm of its shard group (the N consecutive
ranks reading its rows). Joining the job (process group, device, quiet ranks) is the command line's
(``conceptdict.ranks``); this module only talks over a group that exists.

Shapes: B global batch rows, B_r this process's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import LOCAL, Comm


class TorchComm:
    """The seam over a group of the initialised process group (gloo reduces CPU tensors, nccl CUDA ones):
    ``group`` None is every process; ``shards`` the latent-shard group's seam (None: unsharded, the identity)."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, shards: Comm | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchComm needs an initialised torch.distributed process group; run under torchrun "
                               "through the conceptdict command (it joins the job) or train with the default seam")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._nccl = dist.get_backend() == "nccl"
        self._shards = shards if shards is not None else LOCAL

    @property
    def shards(self) -> Comm:
        return self._shards

    def _to_comm(self, t: Tensor) -> Tensor:
        return t.cuda() if self._nccl else t.cpu()

    def _reduce(self, t: Tensor, op: "dist.ReduceOp.RedOpType") -> Tensor:
        buf = self._to_comm(t.detach().clone())
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def all_sum(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def all_min(self, t: Tensor) -> Tensor:
        return self._reduce(t, dist.ReduceOp.MIN)

    def any(self, mask: Tensor) -> Tensor:
        return self._reduce(mask.to(torch.uint8), dist.ReduceOp.MAX).bool()

    def gather_rows(self, x: Tensor) -> Tensor:
        counts = self.all_sum(torch.zeros(self.size, dtype=torch.int64).index_fill_(0, torch.tensor(self.rank),
                                                                                   x.shape[0])).tolist()
        buf = self._to_comm(x.new_zeros((max(counts), *x.shape[1:])))
        buf[: x.shape[0]] = self._to_comm(x)
        parts = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)]).to(x.device)

    def gather_to_first(self, x: Tensor) -> Tensor | None:
        counts = self.all_sum(torch.zeros(self.size, dtype=torch.int64).index_fill_(0, torch.tensor(self.rank),
                                                                                   x.shape[0])).tolist()
        buf = self._to_comm(x.new_zeros((max(counts), *x.shape[1:])))
        buf[: x.shape[0]] = self._to_comm(x)
        parts = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(buf, parts, group=self.group, group_dst=0)
        return torch.cat([p[:n] for p, n in zip(parts, counts)]).to(x.device) if parts is not None else None

    def reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over processes, in place (``training.apply_update`` gives each
        trainable parameter one); each process's loss is its part of the global loss, so every process then
        holds the one-process gradient."""
        if self.size == 1:
            return
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if self._nccl or p.grad.device.type == "cpu":
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            else:
                p.grad.copy_(self.all_sum(p.grad))

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def process_group_comm(latent_shards: int = 1) -> Comm:
    """The seam of this process: :class:`TorchComm` over its data group when a process group of several processes
    is initialised (with ``latent_shards`` > 1 its ``shards`` spans its shard group), else the identity seam.
    Every process of the job must call it alike (it creates the groups)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if latent_shards > 1:
            raise ValueError(f"latent_shards={latent_shards} needs {latent_shards} x R processes: run under torchrun "
                             f"--nproc_per_node={latent_shards} (or a multiple), or drop --latent-shards")
        return LOCAL
    world, rank = dist.get_world_size(), dist.get_rank()
    if latent_shards <= 1:
        return TorchComm()
    if world % latent_shards:
        raise ValueError(f"latent_shards={latent_shards} does not divide the job's {world} processes; run "
                         f"latent_shards x data ranks processes (torchrun --nproc_per_node)")
    data_groups = world // latent_shards
    mine: dict[str, "dist.ProcessGroup"] = {}
    for d in range(data_groups):  # every process creates every group, in the same order
        g = dist.new_group([d * latent_shards + i for i in range(latent_shards)])
        if rank // latent_shards == d:
            mine["shards"] = g
    for i in range(latent_shards):
        g = dist.new_group([d * latent_shards + i for d in range(data_groups)])
        if rank % latent_shards == i:
            mine["data"] = g
    return TorchComm(mine["data"], shards=TorchComm(mine["shards"]))
