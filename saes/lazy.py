"""A saved dictionary read lazily: its weights stay on disk and a range of latents is read when asked for.

:class:`LazyDictionary` (``cd.load(DIR, lazy=True)``; ``eval``, ``export`` (saelens, sparsify), ``name`` and ``score``
open a dictionary this way when loading it whole would not fit in the process's memory, :func:`reads_lazily`) holds the config and the tensors every latent shares (``b_dec``,
``norm_scale``, ``W_skip``) and reads the rest a block of latents at a time: :meth:`~LazyDictionary.latents` gives an
in-memory :class:`SparseCoder` of latents ``[start, stop)``, and ``encode`` / ``decode`` / ``sae(x)`` run over the
blocks (:attr:`~LazyDictionary.blocks`), one block in memory at a time. An inference rule that selects across latents
(per-row TopK: ``KindSpec.shard_encode``) keeps each row's k largest over every block's k largest, as latent shards
do, so the codes equal the whole dictionary's; :meth:`~LazyDictionary.cutoffs` gives each row's k-th largest code
over every block, for a caller that holds one block over many rows (``naming``'s evidence).

The weights files are read with ``pread`` at the offsets their safetensors header names (``saes.lazy_io``), not mapped: a mapping
counts its whole file against a process's address-space limit (``ulimit -v``), a read only the block it holds. So
a dictionary larger than the memory of the process is read in ``block_latents`` pieces; peak: one block's weights
(plus a copy of its encoder while it is built) and the caller's buffers. :func:`save_tensors_of` writes a layout's
weights file the same way, one block at a time.

Under ``torchrun`` (``comm``: the seam of ``saes.distributed.process_group_comm``) each rank holds its own contiguous
range of latents (:attr:`~LazyDictionary.part`), reads only blocks within it and computes with the other ranks
(``saes.lazy_ranks``): ``conceptdict eval`` on N processes, each holding 1/N of the latents.

Kinds: those whose latents can be split (``KindSpec.shardable``: topk, batchtopk, jumprelu, relu, crosscoders, and
cross-layer transcoders, whose latents split within each layer: ``saes.lazy_clt.LazyCLT``, which :func:`open_lazy`
gives for them); the others read their neighbours (Matryoshka's prefixes, SpaDE's simplex) and are loaded whole
(``cd.load(DIR)``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .artifact import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    disk_latent_axes,
    load_native,
    load_native_config,
    native_kind,
    native_state,
    read_index,
)
from .comm import LOCAL, Comm
from .kinds import KindSpec, kind_spec
from .lazy_io import DTYPES, TensorsWriter, WeightsFile, write_blocks
from .lazy_ranks import clip, merged, one_process, rank_range, summed
from .model import SparseCoder

BLOCK_MIB = 512
"""Default most MiB of weights in one block when none is given (a file of a block artifact larger than this is
read in several blocks)."""


def file_pieces(files: Sequence[tuple[Any, int, int]], block_latents: int, k: int) -> list[tuple[int, int]]:
    """Each file's latent range ``[a, b)`` (``files``: (file, a, b)) in pieces of at most ``block_latents``; a piece
    of k latents or fewer joins the one before (a block's TopK keeps k of its latents)."""
    out: list[tuple[int, int]] = []
    for _, a, b in files:
        for s in range(a, b, block_latents):
            e = min(b, s + block_latents)
            if out and e - s <= k:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
    if len(out) > 1 and out[0][1] - out[0][0] <= k:  # a first piece too small (a rank's range cut near a file's end)
        out[:2] = [(out[0][0], out[1][1])]
    return out


@torch.no_grad()
def kth_largest(blocks: Iterable[Any], batches: Callable[[], Iterable[tuple[int, Tensor]]], n_rows: int, k: int,
                device: torch.device) -> Tensor:
    """Per row of ``batches()`` ((first row, x) pieces covering rows ``[0, n_rows)``), the k-th largest code over
    the ``blocks`` (each with ``encode``, whose codes hold each row's k largest of its latents) [n_rows]: one block
    in memory at a time, ``batches()`` read once per block; holds each row's k best [n_rows, k]."""
    best = torch.full((n_rows, k), -math.inf)
    for block in blocks:
        for start, x in batches():
            top = block.encode(x.to(device)).float().topk(k, dim=1).values.cpu()
            stop = start + top.shape[0]
            best[start:stop] = torch.cat([best[start:stop], top], 1).topk(k, dim=1).values
        del block  # before the next one is read
    return best[:, -1].clone()


class LazyDictionary:
    """A saved dictionary (this project's layout, one file or one per latent shard) read a block of latents at a
    time (module docstring). ``encode`` / ``decode`` / ``sae(x)`` take what :class:`SparseCoder`'s do and give the
    same results; :meth:`latents` a block in memory; :meth:`whole` the whole dictionary."""

    source_rows = SparseCoder.source_rows
    input_rows = SparseCoder.input_rows
    output_shape = SparseCoder.output_shape
    flatten_input = SparseCoder.flatten_input
    flatten_batch = SparseCoder.flatten_batch
    split = SparseCoder.split
    data_sources = SparseCoder.data_sources
    cfg = SparseCoder.cfg

    def __init__(self, directory: str | Path, device: str | torch.device = "cpu",
                 block_latents: int | None = None, comm: Comm = LOCAL) -> None:
        self.path = Path(directory)
        self.config = load_native_config(self.path)
        cfg = self.config
        self.kind, self.d_in, self.n_latents = native_kind(cfg), int(cfg["d_in"]), int(cfg["n_latents"])
        self.k, self.n_sources = int(cfg["k"]), int(cfg["n_sources"])
        self.training_summary = cfg.get("training")
        self._device = torch.device(device)
        spec = self.spec
        if spec.layered:
            raise ValueError(f"a {self.kind} dictionary is read a range of every layer's latents at a time: open it with "
                             f"open_lazy({str(self.path)!r}) (saes.lazy_clt.LazyCLT)")
        if not spec.shardable:
            raise ValueError(f"a {self.kind} dictionary is not read in blocks of latents (its rule reads other "
                             f"latents); load it whole: cd.load({str(self.path)!r})")
        self.files = self._files()
        self.axes = disk_latent_axes(self._meta(self.n_latents))
        first = self.files[0][0]
        self.shared = {name: first.read(name) for name, axis in self.axes.items()
                       if axis is None and name in first.tensors}
        self._block_latents = block_latents
        self.over(comm)

    # -- what it is -----------------------------------------------------------------------------
    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.kind)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def __repr__(self) -> str:
        return (f"LazyDictionary({self.kind}, d_in={self.d_in}, latents={self.n_latents}, k={self.k}, "
                f"{len(self.blocks)} blocks, {self.path})")

    def requires_grad_(self, flag: bool = True) -> LazyDictionary:
        """Nothing to do: its blocks are made without gradients (here so that it reads like a SparseCoder)."""
        return self

    def eval(self) -> LazyDictionary:
        return self

    def over(self, comm: Comm) -> LazyDictionary:
        """Split this dictionary over the latent shards of ``comm`` (``saes.lazy_ranks``; ``LOCAL``: one process
        holds every latent): :attr:`part` is this rank's range, :attr:`blocks` its blocks, :attr:`read_ranges` the
        (key, start, stop) of every block read from the files from here on; the block held is let go. Returns it."""
        self.comm, self._held = comm, None
        self.part = rank_range(self.span, self.k, comm.shards, str(self.path))
        self.read_ranges: set[tuple[Any, int, int]] = set()
        self.blocks = self._blocks(self._block_latents)
        return self

    def _meta(self, n_latents: int) -> SparseCoder:
        return SparseCoder(self.d_in, n_latents, self.k, self.kind, n_sources=self.n_sources, device="meta")

    def _files(self) -> list[tuple[WeightsFile, int, int]]:
        """(file, first latent, end) of each weights file, in latent order."""
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            return [(WeightsFile(self.path / WEIGHTS_FILE), 0, self.n_latents)]
        index = read_index(self.path)
        out, start = [], 0
        for name, n in zip(index["files"], index["latents_per_file"]):
            out.append((WeightsFile(self.path / name), start, start + int(n)))
            start += int(n)
        if start != self.n_latents:
            raise ValueError(f"{index_path}: its files hold {start} latents but {CONFIG_FILE} says {self.n_latents}; "
                             f"save the dictionary again")
        return out

    def _blocks(self, block_latents: int | None) -> list[tuple[int, int]]:
        """The latent ranges read one at a time: each file's latents, in pieces of at most ``block_latents`` (None:
        :data:`BLOCK_MIB` of weights); a piece never holds k latents or fewer (it joins the one before)."""
        if block_latents is None:
            per_latent = sum(math.prod(s) * torch.empty((), dtype=d).element_size() // s[self.axes[n]]
                             for n, (d, s, _) in self.files[0][0].tensors.items() if self.axes.get(n) is not None)
            block_latents = max(1, BLOCK_MIB * 2 ** 20 // max(per_latent, 1))
        if block_latents <= self.k:
            raise ValueError(f"block_latents={block_latents} must exceed k={self.k}: a block's TopK keeps k of its "
                             f"latents; raise block_latents")
        return file_pieces(clip(self.files, *self.part), block_latents, self.k)

    # -- reading ----------------------------------------------------------------------------------
    span_words = "the range"
    """What a block's range is, in :meth:`held`'s error (a CLT's: a range of each layer's latents)."""

    @property
    def span(self) -> int:
        """Where a block's range ends at most: the latents (a CLT's: each layer's)."""
        return self.n_latents

    def held(self, call: str, start: int, stop: int, read: Callable[[], Any], key: Any = None) -> Any:
        """The block ``read()`` gives of latents ``[start, stop)`` (of :attr:`span`), checked to hold more than k
        latents (``call`` names the call in the error). The block read last is kept: asked for again (the same
        ``key`` and range) it is given without reading; another one is read after the one held is let go."""
        lo, hi = self.part
        if not lo <= start < stop <= hi or stop - start <= self.k:
            mine = f" (rank {self.comm.shards.rank} of {self.comm.shards.size}'s)" if self.comm.shards.size > 1 else ""
            raise ValueError(f"{call}: {self.span_words} must lie in [{lo}, {hi}){mine} and hold more than "
                             f"k={self.k} latents")
        if self._held is not None and self._held[0] == (key, start, stop):
            return self._held[1]
        self._held = None  # let the block held before go first
        self.read_ranges.add((key, start, stop))
        block = read()
        self._held = ((key, start, stop), block)
        return block

    def latents(self, start: int, stop: int) -> SparseCoder:
        """Latents ``[start, stop)`` as an in-memory dictionary of ``stop - start`` latents (read from the files that
        hold them; its ``encode`` is the kind's rule on those latents alone). A NaN or Inf in them is refused as a
        whole dictionary's is (``saes.formats.check_finite``)."""
        return self.held(f"latents({start}, {stop})", start, stop, lambda: self._read_block(start, stop))

    def _read_block(self, start: int, stop: int) -> SparseCoder:
        """Latents ``[start, stop)`` read from the files that hold them (:meth:`latents`)."""
        parts: dict[str, list[Tensor]] = {}
        for f, a, b in self.files:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                for name in f.tensors:
                    if self.axes.get(name) is not None:
                        parts.setdefault(name, []).append(f.read(name, self.axes[name], lo - a, hi - a))
        t = {n: p[0] if len(p) == 1 else torch.cat(p, dim=self.axes[n]) for n, p in parts.items()}
        parts.clear()
        t.update(self.shared)
        return self.coder(self._meta(stop - start), t, f"latents [{start}, {stop}) of {self.path}")

    def coder(self, model: SparseCoder, t: dict[str, Tensor], what: str) -> SparseCoder:
        """``model`` (its shapes, on the meta device) with the on-disk tensors ``t`` (``saes.artifact``'s layout) as
        its weights: float32 on this device, without gradients. ``t`` is emptied: the read tensors become the
        parameters, no second copy. A NaN or Inf is refused as a whole dictionary's is (``saes.formats.check_finite``,
        naming ``what``)."""
        from .formats import check_finite

        state = native_state(model, t, self.path)
        t.clear()
        state["W_enc"] = state["W_enc"].t().contiguous().t()  # latent-major, as every SparseCoder's encoder
        # checked as read: a CLT's state_dict would join its decoder blocks into one more copy of W_dec
        check_finite(torch.nn.ParameterDict({n: torch.nn.Parameter(v, requires_grad=False) for n, v in state.items()}),
                     what)
        model.load_state_dict({n: v.to(torch.float32) for n, v in state.items()}, assign=True)
        state.clear()
        model.to(self._device)
        model.training_summary = self.training_summary
        return model.requires_grad_(False).eval()

    def decoder_directions(self) -> Tensor:
        """Decoder rows in raw activation units: [L, D] (S = 1) or [L, S, D], as ``SparseCoder``'s; only ``W_dec`` is
        read (half the weights, in memory whole: what a concept dictionary keeps of each latent)."""
        one_process(self, "decoder_directions()")
        S, D = self.n_sources, self.d_in
        out = torch.empty(self.n_latents, S, D) if S > 1 else torch.empty(self.n_latents, D)
        for f, a, b in self.files:
            part = f.read("W_dec")  # [S, n, D] on disk with S > 1 sources
            out[a:b] = part.permute(1, 0, 2) if S > 1 else part
            del part
        return out

    def whole(self) -> SparseCoder:
        """The whole dictionary in memory (``load_native``), with ``.config`` and ``.path``."""
        one_process(self, "whole()")
        model = load_native(self.path, self._device)
        model.config, model.path = self.config, self.path
        return model.requires_grad_(False)

    # -- inference over blocks --------------------------------------------------------------------
    @torch.no_grad()
    def block_codes(self, rows: Tensor) -> Iterator[tuple[int, SparseCoder, Tensor]]:
        """(first latent, block, the block's codes [N, stop - start]) for each block, of rows [N, S*D]: together the
        whole dictionary's codes. A rule that selects across latents keeps each row's k largest of every block's k
        largest (read in a first pass), as latent shards do (``kinds.common.shard_keep``). Split over ranks: this
        rank's blocks, the k largest over every rank's (collective)."""
        if self.spec.shard_encode is None:
            for a, b in self.blocks:
                block = self.latents(a, b)
                yield a, block, block.rule(rows)
                del block  # (and the caller drops its name for it) before the next block is read
            return
        values, indices = [], []
        for a, b in self.blocks:
            top = self.latents(a, b).rule(rows).topk(self.k, dim=1)
            values.append(top.values)
            indices.append(top.indices + a)
        best = torch.cat(values, 1).topk(self.k, dim=1)
        keep_v, keep_i = merged(best.values, self.k, self.comm), torch.cat(indices, 1).gather(1, best.indices)
        for a, b in reversed(self.blocks):  # the last block read first: it is still held
            block = self.latents(a, b)
            mine = (keep_i >= a) & (keep_i < b)
            f = rows.new_zeros(rows.shape[0], b - a)
            yield a, block, f.scatter_add_(1, torch.where(mine, keep_i - a, 0), torch.where(mine, keep_v, 0))
            del block, f

    def cutoffs(self, batches: Callable[[], Iterable[tuple[int, Tensor]]], n_rows: int) -> Tensor | None:
        """Of a rule that selects across latents (per-row TopK): per row of ``batches()`` ((first row, x) pieces
        covering rows ``[0, n_rows)``), the k-th largest code over every block [n_rows], so that a block's own
        codes at or above it are the whole dictionary's (:meth:`block_codes` per row); None for the other rules.
        Read block by block, ``batches()`` once per block (:func:`kth_largest`)."""
        if self.spec.shard_encode is None:
            return None
        one_process(self, "cutoffs()")
        return kth_largest((self.latents(a, b) for a, b in self.blocks), batches, n_rows, self.k, self._device)

    def finish(self, x: Tensor, decoded: Tensor) -> Tensor:
        """The reconstruction from the sum of the blocks' decodes [N, S*D] and the encoder input x: plus b_dec, and
        x W_skip for a kind with a skip path."""
        out = decoded + self.shared_tensor("b_dec")
        return out + x @ self.shared_tensor("W_skip") if self.spec.skip else out

    def shared_tensor(self, name: str) -> Tensor:
        """A tensor every latent shares, in the in-memory layout (b_dec [S*D], W_skip [D, D])."""
        return self.shared[name].reshape(-1).to(self._device) if name == "b_dec" else self.shared[name].to(self._device)

    @torch.no_grad()
    def codes_and_reconstruction(self, rows: Tensor,
                                 each: Callable[[Tensor, int], None] | None = None) -> Tensor:
        """The reconstruction [N, S*D] of rows [N, S*D] (a transcoder: its output), and ``each(codes, first latent)``
        as they come (split over ranks: this rank's latents' codes; the reconstruction is the whole one)."""
        total = None
        for a, block, f in self.block_codes(rows):
            part = block.dense_decode(f)
            total = part if total is None else total + part
            if each is not None:
                each(f, a)
            del block, f, part  # one block in memory at a time
        return self.finish(rows, summed(total, self.comm))

    def encode(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """x [..., D] (S sources: [..., S, D]) -> dense codes [..., L], equal to the whole dictionary's."""
        rows, back = self.source_rows(x, "encode")
        f = rows.new_zeros(rows.shape[0], self.n_latents)
        for a, block, part in self.block_codes(rows):
            f[:, a: a + part.shape[1]] = part
            del block, part  # one block in memory at a time
        return back(summed(f, self.comm), (self.n_latents,))

    @torch.no_grad()
    def decode(self, f: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Codes f [..., L] -> x_hat [..., D] (S sources: [..., S, D])."""
        rows, back = self.input_rows(f, "decode", (self.n_latents,), "the latents of this dictionary")
        total = sum(self.latents(a, b).dense_decode(rows[:, a:b]) for a, b in self.blocks)
        return back(summed(total, self.comm) + self.shared_tensor("b_dec"), self.output_shape())

    def __call__(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Reconstruction of x, as ``SparseCoder.forward``."""
        rows, back = self.source_rows(x, "sae(x)")
        return back(self.codes_and_reconstruction(rows), self.output_shape())


def open_lazy(directory: str | Path, device: str | torch.device = "cpu", block_latents: int | None = None,
              comm: Comm = LOCAL) -> LazyDictionary:
    """:class:`LazyDictionary` of a dictionary saved by ``saes.artifact`` (one file, or one per latent shard); of a
    cross-layer transcoder, a ``saes.lazy_clt.LazyCLT`` (``block_latents``: latents of each layer in a block).
    ``comm``: split over its latent shards, this rank reading only its range (``saes.lazy_ranks``)."""
    if kind_spec(native_kind(load_native_config(directory))).layered:
        from .lazy_clt import LazyCLT

        return LazyCLT(directory, device, block_latents, comm)
    return LazyDictionary(directory, device, block_latents, comm)


LOAD_FACTOR = 4
"""Bytes per byte of weights that a command reading a dictionary whole is taken to need: about 2 for the load
(``load_native`` holds the joined tensors and the module's parameters at once, plus one file), the rest for the
command's own buffers that grow with the latents (eval's ``[batch, L]`` codes: at D 512, L 65,536 and batch 512 they
were 1.5 times the weights). A rule of thumb, not a plan: ``lazy=True`` reads lazily whatever it says."""


def _status(key: str) -> int | None:
    """Bytes of ``key`` (VmSize, ...) in /proc/self/status; None where there is none."""
    path = Path("/proc/self/status")
    lines = path.read_text().splitlines() if path.exists() else []
    return next((int(ln.split()[1]) * 1024 for ln in lines if ln.startswith(key + ":")), None)


def available_memory() -> int | None:
    """Bytes this process can still take: the least of the machine's MemAvailable, the room under its address-space
    limit (``ulimit -v``, RLIMIT_AS) and under its cgroup's ``memory.max``; None where none of them is known."""
    import resource

    room = []
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        room += [int(ln.split()[1]) * 1024 for ln in meminfo.read_text().splitlines() if ln.startswith("MemAvailable:")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _status("VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        room.append(soft - size)
    cgroup = Path("/sys/fs/cgroup")
    if (cgroup / "memory.max").exists() and (cgroup / "memory.current").exists():
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room.append(int(limit) - int((cgroup / "memory.current").read_text()))
    return min(room) if room else None


LAZY_ENV = "CONCEPTDICT_LAZY"
"""Environment variable that overrides :func:`reads_lazily`'s rule for every command: 1, lazily whenever the kind
allows; 0, never."""


def reads_lazily(directory: str | Path, available: int | None = None) -> bool:
    """Whether the commands read the dictionary saved at ``directory`` (this project's layout) lazily: when its kind
    can be read in blocks and reading it whole (:data:`LOAD_FACTOR` x its weights) would not fit in ``available``
    bytes (default :func:`available_memory`). A dictionary that fits is loaded whole: the same numbers bit for bit
    and one pass over its weights. :data:`LAZY_ENV` set to 1 or 0 decides instead."""
    directory = Path(directory)
    spec = kind_spec(native_kind(load_native_config(directory)))
    if not spec.shardable:
        return False
    pinned = os.environ.get(LAZY_ENV, "").strip()
    if pinned in ("0", "1"):
        return pinned == "1"
    if pinned:
        raise ValueError(f"{LAZY_ENV}={pinned!r}: set it to 1 (read dictionaries lazily), 0 (never) or leave it unset")
    files = ([directory / f for f in read_index(directory)["files"]] if (directory / INDEX_FILE).exists()
             else [directory / WEIGHTS_FILE])
    available = available_memory() if available is None else available
    return available is not None and LOAD_FACTOR * sum(f.stat().st_size for f in files) > available


def save_tensors_of(model: SparseCoder | LazyDictionary, path: Path, make: Callable[[SparseCoder], dict[str, Tensor]],
                    metadata: dict[str, str]) -> Path:
    """Write the safetensors file of ``make(model)`` (a layout's tensors of a dictionary) to ``path``; a lazy
    dictionary's is written block by block (``saes.lazy_io.write_blocks``)."""
    from .artifact import save_tensors

    if isinstance(model, SparseCoder):
        save_tensors(path, make(model), metadata)
        return path
    write_blocks(model, make, lambda shapes: TensorsWriter(path, shapes, metadata))
    return path


__all__ = ["DTYPES", "LazyDictionary", "WeightsFile", "available_memory", "kth_largest", "open_lazy", "reads_lazily",
           "save_tensors_of"]
