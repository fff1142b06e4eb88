"""A cross-layer transcoder (kinds ``clt``, ``clt-batchtopk``) read lazily: a range of every layer's latents at a time.

A CLT's latents come in S layer groups of P (layer l's latents are ``[l P, (l + 1) P)``; saes.latents), and its
block artifact's file i holds the i-th slice of every layer's latents (``W_enc [S, D, P/N]``, ``W_dec [S, L/N, D]``
and ``b_enc`` / ``threshold`` [L/N] layer-major). :class:`LazyCLT` reads the same way: a block is a range
``[a, b)`` of latents *within a layer*, taken from every layer, so that each block is itself a CLT of S (b - a)
latents (a :class:`SparseCoder`, as a latent shard is) and its encoder, its triangle of decoder blocks and its
inference rule are the kind's own. Over the blocks:

- encode: per layer and row, the k largest of every block's k largest of that layer (``clt``: TopK per layer over
  the whole layer, as the whole CLT's; ``clt-batchtopk``'s JumpReLU reads one latent at a time and needs no merge);
- decode: the sum of the blocks' partial decodes per target layer (block l's latents write to layers l..S-1), plus
  ``b_dec``.

Peak: one block's weights (its W_dec read as ``[S, S (b - a), D]``, the triangle's zeros included, and a copy of its
encoder while it is built) and the caller's buffers. ``latents(a, b)`` / :attr:`~LazyCLT.blocks` name ranges within a
layer (not global latent ids as :class:`~saes.lazy.LazyDictionary`'s do); :meth:`LazyCLT.pieces` maps a block's
columns to the whole CLT's.

Naming (``naming.pipeline.Naming.blocks``) goes layer by layer, in latent order: :meth:`~LazyCLT.layer_latents`
``(l, a, b)`` reads latents ``[a, b)`` of layer l alone (:class:`LayerLatents`: that layer's encoder columns, whose
``encode`` reads layer l's input alone, and the latents' decoder rows to every layer), a ``1/S`` of a block; ``clt``'s
per-row cutoffs are found per layer (:meth:`~LazyCLT.layer_cutoffs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .artifact import (
    disk_latent_axes,
    disk_latent_groups,
    load_native_config,
    native_kind,
)
from .comm import LOCAL, Comm
from .kinds import KindSpec
from .lazy import BLOCK_MIB, LazyDictionary, file_pieces, kth_largest
from .lazy_io import WeightsFile
from .lazy_ranks import clip, merged, one_process, summed
from .model import SparseCoder


class LazyCLT(LazyDictionary):
    """A saved cross-layer transcoder (one file or one per latent shard) read a range of every layer's latents at a
    time (module docstring); ``encode`` / ``decode`` / ``sae(x)`` / ``saes.evaluate`` give the whole CLT's results."""

    def __init__(self, directory: str | Path, device: str | torch.device = "cpu",
                 block_latents: int | None = None, comm: Comm = LOCAL) -> None:
        self.path = Path(directory)
        self.config = cfg = load_native_config(self.path)
        self.kind, self.d_in, self.n_latents = native_kind(cfg), int(cfg["d_in"]), int(cfg["n_latents"])
        self.k, self.n_sources = int(cfg["k"]), int(cfg["n_sources"])
        self.training_summary = cfg.get("training")
        self._device = torch.device(device)
        if not self.spec.layered:
            raise ValueError(f"{self.path} holds a {self.kind} dictionary, not a cross-layer transcoder; open it with "
                             f"saes.lazy.open_lazy")
        S = self.n_sources
        self.per_layer = self.n_latents // S
        # (file, first latent of each layer it holds, end): file i holds slice i of every layer's latents
        self.files = [(f, a // S, b // S) for f, a, b in self._files()]
        meta = self._meta(S * (self.k + 1))  # a small CLT of this kind: which tensors run over the latents, in how many groups
        self.axes, self.groups = disk_latent_axes(meta), disk_latent_groups(meta)
        first = self.files[0][0]
        self.shared = {name: first.read(name) for name, axis in self.axes.items()
                       if axis is None and name in first.tensors}
        self._block_latents = block_latents
        self.over(comm)  # split over comm's ranks: this rank's range of each layer's latents (saes.lazy_ranks)

    def __repr__(self) -> str:
        return (f"LazyCLT({self.kind}, d_in={self.d_in}, layers={self.n_sources}, latents={self.n_latents}, "
                f"k={self.k}, {len(self.blocks)} blocks, {self.path})")

    def _blocks(self, block_latents: int | None) -> list[tuple[int, int]]:
        """The ranges of each layer's latents read one at a time: each file's, in pieces of at most ``block_latents``
        per layer (None: :data:`saes.lazy.BLOCK_MIB` of weights over every layer); a piece never holds k latents of a
        layer or fewer (it joins the one before)."""
        if block_latents is None:
            f, a, b = self.files[0]
            per_latent = sum(math.prod(s) * torch.empty((), dtype=d).element_size() // ((b - a) * self.n_sources)
                             for n, (d, s, _) in f.tensors.items() if self.axes.get(n) is not None)
            block_latents = max(1, int(BLOCK_MIB * 2 ** 20 // max(per_latent * self.n_sources, 1)))
        if block_latents <= self.k:
            raise ValueError(f"block_latents={block_latents} must exceed k={self.k}: a block's TopK keeps k of each "
                             f"layer's latents; raise block_latents")
        return file_pieces(clip(self.files, *self.part), block_latents, self.k)

    def pieces(self, start: int, stop: int) -> list[tuple[int, slice]]:
        """(the whole CLT's first latent, the block's columns) of each layer's part of block ``[start, stop)``."""
        n = stop - start
        return [(l * self.per_layer + start, slice(l * n, (l + 1) * n)) for l in range(self.n_sources)]

    span_words = "the range of each layer's latents"

    @property
    def span(self) -> int:
        """Where a block's range ends at most: each layer's latents."""
        return self.per_layer

    def _read(self, f: WeightsFile, name: str, n_file: int, lo: int, hi: int) -> list[Tensor]:
        """Latents ``[lo, hi)`` of every layer's slice in file ``f`` (``n_file`` of each layer's latents) of tensor
        ``name``: one tensor (an encoder [S, D, hi - lo]) or one per layer (the tensors over every layer's latents)."""
        axis = self.axes[name]
        if self.groups[name] == 1:
            return [f.read(name, axis, lo, hi)]
        return [f.read(name, axis, l * n_file + lo, l * n_file + hi) for l in range(self.n_sources)]

    def latents(self, start: int, stop: int) -> SparseCoder:
        """Latents ``[start, stop)`` of every layer as an in-memory CLT of S (stop - start) latents (layer-major, read
        from the files that hold them; its ``encode`` is the kind's rule on those latents alone). A NaN or Inf in
        them is refused as a whole dictionary's is (``saes.formats.check_finite``)."""
        return super().latents(start, stop)

    def _read_block(self, start: int, stop: int) -> SparseCoder:
        parts: dict[str, list[list[Tensor]]] = {}  # name -> per file -> its pieces
        for f, a, b in self.files:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                for name in f.tensors:
                    if self.axes.get(name) is not None:
                        parts.setdefault(name, []).append(self._read(f, name, b - a, lo - a, hi - a))
        t = {}
        for name, per_file in parts.items():  # each layer's pieces over the files, then the layers in order
            t[name] = torch.cat([torch.cat([p[g] for p in per_file], dim=self.axes[name])
                                 for g in range(len(per_file[0]))], dim=self.axes[name])
        parts.clear()
        t.update(self.shared)
        return self.coder(self._meta(self.n_sources * (stop - start)), t,
                          f"latents [{start}, {stop}) of every layer of {self.path}")

    def layer_latents(self, layer: int, start: int, stop: int) -> LayerLatents:
        """Latents ``[start, stop)`` of layer ``layer`` alone (:class:`LayerLatents`: what naming reads of them),
        read from the files that hold them: that layer's encoder columns, biases and thresholds, and the latents'
        decoder rows to every layer. A NaN or Inf in them is refused as a whole dictionary's is."""
        if not 0 <= layer < self.n_sources:
            raise ValueError(f"layer_latents({layer}, {start}, {stop}): this {self.kind} has layers "
                             f"0..{self.n_sources - 1}")
        return self.held(f"layer_latents({layer}, {start}, {stop})", start, stop,
                         lambda: self._read_layer(layer, start, stop), key=layer)

    def _read_layer(self, layer: int, start: int, stop: int) -> LayerLatents:
        from .formats import check_finite

        parts: dict[str, list[Tensor]] = {}  # name -> per file, layer ``layer``'s piece
        for f, a, b in self.files:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                for name in f.tensors:
                    axis = self.axes.get(name)
                    if axis is not None and self.groups[name] == 1:  # the encoder [S, D, n]: this layer's [1, D, m]
                        parts.setdefault(name, []).append(f.read(name, axis, lo - a, hi - a, index=layer)[None])
                    elif axis is not None:  # layer-major over every layer's latents: this layer's slice
                        n = b - a
                        parts.setdefault(name, []).append(f.read(name, axis, layer * n + lo - a, layer * n + hi - a))
        t = {n: p[0] if len(p) == 1 else torch.cat(p, dim=self.axes[n]) for n, p in parts.items()}
        parts.clear()
        what = f"latents [{start}, {stop}) of layer {layer} of {self.path}"
        directions = t.pop("W_dec").permute(1, 0, 2).float()  # [S, m, D] -> [m, S, D]
        check_finite(torch.nn.ParameterDict({"W_dec": torch.nn.Parameter(directions, requires_grad=False)}), what)
        t.update(W_dec=directions[:, layer], b_dec=self.shared["b_dec"][layer])  # a one-layer CLT of its own layer
        if "norm_scale" in self.shared:
            t["norm_scale"] = self.shared["norm_scale"][layer: layer + 1]
        coder = self.coder(SparseCoder(self.d_in, stop - start, self.k, self.kind, device="meta"), t, what)
        return LayerLatents(layer, coder, directions)

    def layer_cutoffs(self, layer: int, batches: Callable[[], Iterable[tuple[int, Tensor]]],
                      n_rows: int) -> Tensor | None:
        """Of ``clt`` (TopK per layer): per row of ``batches()`` ((first row, layer ``layer``'s inputs [n, D]) pieces
        covering rows ``[0, n_rows)``), the k-th largest code of that layer over every block [n_rows]
        (``saes.lazy.kth_largest``), so that a block's codes of that layer at or above it are the whole CLT's; None
        for ``clt-batchtopk`` (JumpReLU reads one latent at a time)."""
        if self.spec.shard_encode is None:
            return None
        one_process(self, f"layer_cutoffs({layer})")
        return kth_largest((self.layer_latents(layer, a, b) for a, b in self.blocks), batches, n_rows, self.k,
                           self._device)

    def decoder_directions(self) -> Tensor:
        """Decoder rows in raw activation units [L, S, D] (zero to the layers before a latent's own), as
        ``SparseCoder``'s; only ``W_dec`` is read, one file at a time."""
        one_process(self, "decoder_directions()")
        S, P = self.n_sources, self.per_layer
        out = torch.empty(self.n_latents, S, self.d_in)
        for f, a, b in self.files:
            part = f.read("W_dec")  # [S, S (b - a), D]: layer l's slice at [l (b - a), (l + 1) (b - a))
            for l in range(S):
                out[l * P + a: l * P + b] = part[:, l * (b - a): (l + 1) * (b - a)].permute(1, 0, 2)
            del part
        return out

    # -- inference over blocks --------------------------------------------------------------------
    @torch.no_grad()
    def block_codes(self, rows: Tensor) -> Iterator[tuple[int, SparseCoder, Tensor]]:
        """(first latent of each layer, block, the block's codes [N, S (stop - start)], layer-major) for each block,
        of rows [N, S*D]: together the whole CLT's codes. ``clt`` keeps, per layer and row, the k largest of every
        block's k largest of that layer (read in a first pass); split over ranks, over every rank's (collective)."""
        if self.spec.shard_encode is None:
            for a, b in self.blocks:
                block = self.latents(a, b)
                yield a, block, block.rule(rows)
                del block
            return
        N, S = rows.shape[0], self.n_sources
        values, indices = [], []
        for a, b in self.blocks:
            top = self.latents(a, b).rule(rows).view(N, S, b - a).topk(self.k, dim=2)
            values.append(top.values)
            indices.append(top.indices + a)
        best = torch.cat(values, 2).topk(self.k, dim=2)
        keep_v = merged(best.values, self.k, self.comm)  # [N, S, k]; over ranks, each layer's k largest of every rank's
        keep_i = torch.cat(indices, 2).gather(2, best.indices)  # [N, S, k], within a layer
        for a, b in reversed(self.blocks):  # the last block read first: it is still held
            block = self.latents(a, b)
            mine = (keep_i >= a) & (keep_i < b)
            f = rows.new_zeros(N, S, b - a)
            f.scatter_add_(2, torch.where(mine, keep_i - a, 0), torch.where(mine, keep_v, 0))
            yield a, block, f.view(N, S * (b - a))
            del block, f

    def cutoffs(self, batches: Callable[[], Iterable[tuple[int, Tensor]]], n_rows: int) -> Tensor | None:
        """Refused: a CLT's TopK is per layer, and so are its cutoffs (:meth:`layer_cutoffs`)."""
        raise ValueError(f"{self.path} is a {self.kind}, whose TopK is per layer: its cutoffs are per layer too, "
                         f"layer_cutoffs(layer, batches, n_rows) over that layer's input rows")

    @torch.no_grad()
    def codes_and_reconstruction(self, rows: Tensor,
                                 each: Callable[[Tensor, int], None] | None = None) -> Tensor:
        """The prediction [N, S*D] of the layers' outputs from their inputs, rows [N, S*D]: the blocks' partial
        decodes summed per target layer, plus ``b_dec``; ``each(codes, first latent)`` on each layer's part of each
        block's codes as they come."""
        total = None
        for a, block, f in self.block_codes(rows):
            part = block.dense_decode(f)
            total = part if total is None else total + part
            if each is not None:
                for first, cols in self.pieces(a, a + block.n_latents // self.n_sources):
                    each(f[:, cols], first)
            del block, f, part
        return self.finish(rows, summed(total, self.comm))

    def encode(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """x [..., S, D] (the layers' inputs) -> dense codes [..., L], equal to the whole CLT's."""
        rows, back = self.source_rows(x, "encode")
        N, S = rows.shape[0], self.n_sources
        f = rows.new_zeros(N, S, self.per_layer)
        for a, block, part in self.block_codes(rows):
            f[:, :, a: a + part.shape[1] // S] = part.view(N, S, -1)
            del block, part
        return back(summed(f.view(N, self.n_latents), self.comm), (self.n_latents,))

    @torch.no_grad()
    def decode(self, f: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Codes f [..., L] -> the layers' outputs [..., S, D]."""
        rows, back = self.input_rows(f, "decode", (self.n_latents,), "the latents of this dictionary")
        by_layer = rows.view(rows.shape[0], self.n_sources, self.per_layer)
        total = sum(self.latents(a, b).dense_decode(by_layer[:, :, a:b].reshape(rows.shape[0], -1))
                    for a, b in self.blocks)
        return back(summed(total, self.comm) + self.shared_tensor("b_dec"), self.output_shape())


class LayerLatents:
    """Latents ``[start, stop)`` of one layer of a lazily read CLT (:meth:`LazyCLT.layer_latents`), as naming reads
    them: ``encode`` takes that layer's input rows [N, D] alone, through ``coder`` (these latents as a one-layer CLT
    of the kind: their encoder, and their decoder to their own layer's output; its ``encode`` is the kind's rule on
    them alone); ``decoder_directions`` gives their decoder rows to every layer [m, S, D] in raw activation units
    (zero to the layers before their own), as the whole CLT's rows of these latents."""

    def __init__(self, layer: int, coder: SparseCoder, directions: Tensor) -> None:
        self.layer, self.coder, self.directions = layer, coder, directions
        self.kind, self.d_in, self.k, self.n_latents = coder.kind, coder.d_in, coder.k, coder.n_latents
        self.n_sources = directions.shape[1]

    @property
    def spec(self) -> KindSpec:
        return self.coder.spec

    def encode(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """The layer's inputs x [..., D] -> codes [..., m] (``SparseCoder.encode`` of ``coder``)."""
        return self.coder.encode(x)

    def decoder_directions(self) -> Tensor:
        return self.directions


__all__ = ["LayerLatents", "LazyCLT"]
