"""The one owner of ranks: joining a torchrun job, this process's device, which process talks.

Every command that can run under ``torchrun --nproc_per_node=N`` calls :func:`join` first and hands what it
returns to the stages explicitly (``cache_distributed(rank=, world_size=, barrier=)``,
``stream_batches(part=(rank, size))``, ``saes.train(comm=...)``); the stages never ask the environment.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Ranks(NamedTuple):
    """This process's place in the job."""

    rank: int
    size: int

    @property
    def main(self) -> bool:
        """The process that logs, prints and writes shared files (rank 0)."""
        return self.rank == 0

    @property
    def part(self) -> tuple[int, int]:
        """(rank, size), the ``part`` argument of the stages' data splits."""
        return self.rank, self.size


def current() -> Ranks:
    """(rank, size) of the initialised process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks(0, 1)


RANK_AWARE = ("cache", "train", "eval")
"""The commands that join a torchrun job (:func:`join`) and split their work over its ranks."""


def refuse_ranks(command: str) -> None:
    """Under torchrun (``WORLD_SIZE`` > 1), a ValueError for a command that is not in :data:`RANK_AWARE`: every rank
    would run the whole job and write the same files."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size > 1 and command not in RANK_AWARE:
        raise ValueError(f"`conceptdict {command}` runs in one process, and torchrun started {size} "
                         f"(WORLD_SIZE={size}): every rank would do the whole job and write the same files. Run it "
                         f"without torchrun; "
                         f"only {', '.join(RANK_AWARE)} split their work over ranks")


def join(backend: str | None = None) -> Ranks:
    """Join the job torchrun describes (``WORLD_SIZE`` > 1 in the environment); a no-op otherwise.

    ``backend``: nccl or gloo; None picks nccl when CUDA is available, else gloo (and logs why). With CUDA,
    this process's GPU becomes ``cuda:LOCAL_RANK`` (so ``--device cuda`` / ``auto`` mean it in every stage);
    ranks other than 0 are :func:`quiet`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or (dist.is_available() and dist.is_initialized()):
        return current()
    if int(os.environ.get("RANK", "0")) != 0:
        quiet()  # before anything is logged: torchrun names the rank before the group exists
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        log.info("torch.distributed backend %s (CUDA %s)", backend,
                 "available" if backend == "nccl" else "not available")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    ranks = current()
    if not ranks.main:
        quiet()
    return ranks


def quiet() -> None:
    """Silence this rank: errors only (conceptdict's and every other logger's), no Python warnings, tqdm bars off
    (TQDM_DISABLE). Rank 0 says everything once; a warning printed by every rank says nothing more."""
    logging.getLogger("conceptdict").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    os.environ["TQDM_DISABLE"] = "1"


def leave() -> None:
    """Destroy the process group :func:`join` created (a no-op without one). Every command's exit goes through
    here (``cli.main``): a gloo or NCCL group left to the interpreter's teardown can abort the process after its
    results are written ("terminate called without an active exception"), and torch warns about it."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
