"""`SparseCoder`: one module for every dictionary kind (TopK, BatchTopK, ReLU-L1; crosscoders with S > 1).

The parameters keep the S sources flattened so one set of kernels serves SAEs and crosscoders:
``W_enc [S*D, L]``, ``b_enc [L]``, ``W_dec [L, S*D]``, ``b_dec [S*D]`` (viewed as ``[S, D, L]`` /
``[S, L, D]`` / ``[S, D]`` on disk when S > 1). What differs between kinds -- how the training step picks
the active latents, its sparsity penalty, the inference rule, its settings -- is a kind's :class:`KindSpec`, one
module of saes/kinds/ listed in its registry, so a new kind is a module, not a subclass.

Shapes: B batch rows, D input width per source, S sources, L latents, K kept entries per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .comm import LOCAL, shard_bias, shard_sum
from .kinds import KINDS, KindSpec, TrainOutput, kind_spec
from .kinds.common import pre_activations, relative_acts

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["KINDS", "KindSpec", "SparseCoder", "TrainOutput", "kind_spec"]


def _draw_blocks(rows: int, width: int, elements: int = 1 << 20) -> list[tuple[int, int]]:
    """Row ranges [s, e) that draw a [rows, width] normal matrix block by block with the numbers of one draw: torch's
    CPU normal fills 16 values at a time, so blocks of a multiple of 16 rows (about ``elements`` values each) give
    the same stream, and a tail under 16 values joins the block before it. A latent shard draws the whole
    dictionary's initialisation holding one block at a time, not the whole [L, width] matrix."""
    step = max(16, elements // max(width, 1) // 16 * 16)
    out, s = [], 0
    while s < rows:
        e = min(rows, s + step)
        if (rows - e) * width < 16:
            e = rows
        out.append((s, e))
        s = e
    return out


class SparseCoder(nn.Module):
    """A sparse dictionary over S sources of width D each (S = 1: an SAE).

    Parameters: ``W_enc [S*D, L]`` (a transposed view of latent-major storage), ``b_enc [L]``,
    ``W_dec [L, S*D]``, ``b_dec [S*D]``; buffer ``threshold [L]`` (the JumpReLU inference threshold of
    BatchTopK; -1 until estimated).
    """

    path: Path | str | None = None
    """The folder (or hub name) it was loaded from or trained into; None for one made in memory. API calls that
    read a dictionary's files (its config, its training's held-out rows) take it in place of that folder."""
    config: dict | None = None
    """Its config.json as read or written (None for one made in memory)."""

    def __init__(self, d_in: int, n_latents: int, k: int, kind: str = "topk", n_sources: int = 1,
                 kernel_impl: str = "auto", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        kind_spec(kind)
        if d_in < 1 or n_latents < 1 or n_sources < 1:
            raise ValueError(f"d_in={d_in}, n_latents={n_latents}, n_sources={n_sources} must all be >= 1")
        layered = kind_spec(kind).layered
        per_layer = n_latents // n_sources if layered else n_latents
        if layered and n_latents % n_sources:
            raise ValueError(f"a {kind} splits its latents equally over its {n_sources} layers; n_latents={n_latents} "
                             f"is not a multiple: pass --latents {per_layer * n_sources or n_sources}")
        if not 1 <= k < per_layer:
            raise ValueError(f"k={k} must be at least 1 and below n_latents={per_layer}"
                             f"{' per layer' if layered else ''}; lower --k or raise --latents")
        self.d_in, self.n_latents, self.k, self.kind, self.n_sources = d_in, n_latents, k, kind, n_sources
        self.kernel_impl = kernel_impl
        width = n_sources * d_in
        kw = {"dtype": dtype, "device": device}
        # stored latent-major ([L, S*D] in memory, a transposed view): each latent's encoder vector is
        # contiguous, so the sparse encoder backward writes whole rows (saes/kernels) and no transpose copy
        # is ever made; the logical shape, the files and every formula stay [S*D, L] (a layered kind: [D, L],
        # each latent reading its own layer)
        self.W_enc = nn.Parameter(torch.empty(n_latents, d_in if layered else width, **kw).t())
        self.b_enc = nn.Parameter(torch.zeros(n_latents, **kw))
        self.W_dec = nn.Parameter(torch.empty(n_latents, width, **kw))
        self.b_dec = nn.Parameter(torch.zeros(width, **kw))
        if self.spec.skip:
            self.W_skip = nn.Parameter(torch.zeros(width, width, **kw))
        self.register_buffer("threshold", torch.full((n_latents,), -1.0, **kw))
        self.register_buffer("norm_scale", torch.ones(n_sources, **kw))
        for name in self.spec.buffers:
            self.register_buffer(name, torch.zeros(n_latents, **kw))
        if layered:  # latent j of layer j // (L/S) decodes to the layers from its own on
            self.register_buffer("dec_mask", (torch.arange(width, device=device) // d_in)[None, :]
                                 >= (torch.arange(n_latents, device=device) // per_layer)[:, None], persistent=False)
        self.reset_parameters()

    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.kind)

    def reset_parameters(self, generator: torch.Generator | None = None, shard: tuple[int, int] = (0, 1)) -> None:
        """Random unit-norm decoder rows, ``W_enc = W_dec^T``, zero biases. A transcoder's decoder starts at
        zero (sparsify's rule: it predicts another activation, so a tied decoder would start with a random map;
        the first steps give each latent its direction). ``shard`` (i, N): this module holds latents
        [i L, (i + 1) L) of a dictionary of N L, and takes those rows of the whole dictionary's draw."""
        with torch.no_grad():
            i, n = shard
            L, width = self.n_latents, self.W_dec.shape[1]
            w = torch.empty(L, width)
            for s, e in _draw_blocks(L * n, width):  # the whole draw, a block of rows at a time; keep our rows
                block = torch.randn((e - s, width), generator=generator, dtype=torch.float32)
                a, b = max(s, i * L), min(e, (i + 1) * L)
                if a < b:
                    w[a - i * L: b - i * L] = block[a - s: b - s]
            w /= w.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self.W_dec.copy_(w * (0 if self.spec.transcodes else 1))
            if self.spec.layered:  # each latent's encoder: its row's block of its own layer, at unit norm
                w = w.view(self.n_latents, self.n_sources, self.d_in)[torch.arange(self.n_latents),
                                                                      self.layer_of_latent()]
                w /= w.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self.W_enc.copy_(w.T)
            self.b_enc.zero_()
            self.b_dec.zero_()
            if self.spec.skip:
                self.W_skip.zero_()

    # -- shapes ---------------------------------------------------------------------------------
    def flatten_input(self, x: Tensor) -> Tensor:
        """x [B, D] (S = 1) or [B, S, D] -> [B, S*D]; the error names the expected shape."""
        S, D = self.n_sources, self.d_in
        ok = (x.dim() == 2 and S == 1 and x.shape[1] == D) or (x.dim() == 3 and x.shape[1:] == (S, D))
        if not ok:
            want = f"[B, {D}]" if S == 1 else f"[B, {S}, {D}]"
            raise ValueError(f"input of shape {list(x.shape)} does not fit this dictionary: expected {want} "
                             f"(d_in={D}, n_sources={S})")
        return x.reshape(x.shape[0], S * D)

    @property
    def data_sources(self) -> int:
        """Sources in a training / evaluation batch: 2 (input, output) per layer for transcoders, else
        ``n_sources``."""
        return 2 * self.n_sources if self.spec.transcodes else self.n_sources

    def flatten_batch(self, x: Tensor) -> Tensor:
        """A training / evaluation batch -> [B, data_sources * D]: a transcoder's [B, 2, D] (input, output)
        pairs (a cross-layer transcoder's [B, 2S, D]: the S layers' inputs, then their outputs), else
        :meth:`flatten_input`."""
        if not self.spec.transcodes:
            return self.flatten_input(x)
        S = self.data_sources
        if x.dim() != 3 or x.shape[1:] != (S, self.d_in):
            what = ("give two hookpoints, the component's input then its output" if S == 2 else
                    f"give {S} hookpoints, the {S // 2} MLP inputs then their outputs")
            raise ValueError(f"a {self.kind} trains and evaluates on (input, output) pairs [B, {S}, {self.d_in}]; got "
                             f"{list(x.shape)}: {what}")
        return x.reshape(x.shape[0], S * self.d_in)

    def split(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """A flattened batch (:meth:`flatten_batch`) -> (encoder input, reconstruction target): the same rows
        for an SAE or crosscoder, the input and output halves for a transcoder."""
        if not self.spec.transcodes:
            return batch, batch
        half = self.n_sources * self.d_in
        return batch[:, :half], batch[:, half:]

    # -- layers (cross-layer transcoders) ---------------------------------------------------------
    def layer_of_latent(self) -> Tensor:
        """[L] int64: the layer whose input each latent reads (all 0 unless the kind is layered)."""
        per_layer = self.n_latents // self.n_sources if self.spec.layered else self.n_latents
        return torch.arange(self.n_latents, device=self.W_dec.device) // per_layer

    def decoder_mask(self) -> Tensor | None:
        """bool [L, S*D]: the decoder entries a layered kind has (a latent of layer l writes to layers >= l); the
        others stay zero. None for every other kind."""
        return self.dec_mask if self.spec.layered else None

    def reconstruct(self, x: Tensor, f: Tensor, comm: "Comm" = LOCAL) -> Tensor:
        """The flattened reconstruction [B, S*D] of the target from the encoder input x and the code f [B, L]:
        f W_dec + b_dec, plus x W_skip for kinds with a skip path. With latent shards (``comm.shards``, saes.comm)
        f is this shard's latents' code [B, L_s]: each shard decodes its part and the parts are summed, the biases
        and the skip path counted once."""
        out = f @ self.W_dec + shard_bias(self.b_dec, comm)
        if self.spec.skip and comm.shards.rank == 0:
            out = out + x @ self.W_skip
        return shard_sum(out, comm)

    def codes(self, x: Tensor, comm: "Comm" = LOCAL) -> Tensor:
        """Dense codes [B, L] of the flattened input x [B, S*D] under the inference rule (what :meth:`encode` gives
        after flattening); with latent shards, this shard's latents' codes [B, L_s], chosen among every shard's
        where the rule selects across latents (``KindSpec.shard_encode``: per-row TopK)."""
        if comm.shards.size > 1 and self.spec.shard_encode is not None:
            return self.spec.shard_encode(self, x, comm)
        return self.spec.encode(self, x)

    def unflatten_output(self, x_flat: Tensor) -> Tensor:
        """[B, S*D] -> [B, D] (S = 1) or [B, S, D]."""
        if self.n_sources == 1:
            return x_flat
        return x_flat.view(x_flat.shape[0], self.n_sources, self.d_in)

    # -- inference ------------------------------------------------------------------------------
    def encode(self, x: Tensor) -> Tensor:
        """x [B, D] or [B, S, D] -> dense codes [B, L] under the kind's inference rule."""
        return self.spec.encode(self, self.flatten_input(x))

    def dense_activations(self, x: Tensor) -> Tensor:
        """x [B, D] or [B, S, D] -> [B, L]: every latent's ReLU activation before the kind's selection (TopK,
        threshold): relu(pre), or s(x) relu(pre / s(x)) for the row-relative kinds (``row_scale``)."""
        x = self.flatten_input(x)
        if not self.spec.relative:
            return torch.relu(pre_activations(self, x))
        acts, s = relative_acts(self, x)
        return acts * s

    def decode(self, f: Tensor) -> Tensor:
        """f [B, L] -> x_hat [B, D] or [B, S, D]."""
        return self.unflatten_output(f @ self.W_dec + self.b_dec)

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction of x, same shape as x (a transcoder: its prediction of the output from the input x)."""
        flat = self.flatten_input(x)
        return self.unflatten_output(self.reconstruct(flat, self.spec.encode(self, flat)))

    def decoder_norms(self) -> Tensor:
        """Per-source decoder row norms [S, L]."""
        return self.W_dec.view(self.n_latents, self.n_sources, self.d_in).norm(dim=2).T

    def decoder_directions(self) -> Tensor:
        """Decoder rows in raw activation units: [L, D] (S = 1) or [L, S, D]."""
        w = self.W_dec.detach()
        return w if self.n_sources == 1 else w.view(self.n_latents, self.n_sources, self.d_in)

    # -- training helpers -----------------------------------------------------------------------
    def latent_axis(self, name: str) -> int | None:
        """The axis along which the state entry ``name`` (``state_dict`` naming) runs over the latents, None for
        the entries every latent shares (b_dec, W_skip, norm_scale): how latent shards split and join it."""
        if name == "W_enc":
            return 1
        per_latent = {"W_dec", "b_enc", "threshold", *self.spec.buffers,
                      *(self.spec.train_params(self) if self.spec.train_params else {})}
        return 0 if name in per_latent else None

    def add_train_params(self) -> None:
        """Register the kind's extra training parameters (``KindSpec.train_params``), after the weights."""
        for name, t in (self.spec.train_params(self) if self.spec.train_params else {}).items():
            self.register_parameter(name, nn.Parameter(t.to(self.W_dec)))

    def drop_train_params(self) -> None:
        """Remove the extra training parameters (after ``KindSpec.finish`` wrote the inference form)."""
        for name in (self.spec.train_params(self) if self.spec.train_params else {}):
            delattr(self, name)

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every (flattened) decoder row to unit norm."""
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_decoder_grad(self) -> None:
        """Drop the component of W_dec.grad parallel to each (unit) decoder row, so a step keeps norms ~1."""
        if self.W_dec.grad is None:
            return
        W, g = self.W_dec, self.W_dec.grad
        # g -= (g.w / |w|^2) w, without [L, D] temporaries (31 against 70 ms at L=16384, D=768)
        coef = torch.linalg.vecdot(W, g) / W.norm(dim=1).square().clamp_min(1e-24)
        g.addcmul_(W, coef[:, None], value=-1)

    @torch.no_grad()
    def fold_input_scale(self, scale: Tensor) -> None:
        """Make a dictionary trained on ``x * scale`` work on raw x (scale [S], one factor per source).

        pre = (c x - b) W + e = (x - b/c) (c W) + e and x_hat = x_hat'/c, so W_enc rows are multiplied by c,
        W_dec columns and b_dec divided by c; codes (and thresholds) are unchanged. A transcoder's scale is
        [c_in, c_out]: the encoder takes c_in, the decoder c_out, the skip path c_in / c_out."""
        scale = scale.to(self.W_enc)
        c_in = c_out = scale.repeat_interleave(self.d_in)
        if self.spec.transcodes:  # [c_in of each layer, then c_out of each]
            S = self.n_sources
            c_in, c_out, scale = c_in[: S * self.d_in], c_out[S * self.d_in:], scale[:S]
        if self.spec.layered:  # W_enc [D, L]: each latent's column takes its layer's c_in
            self.W_enc.mul_(scale[self.layer_of_latent()][None, :])
        else:
            self.W_enc.mul_(c_in[:, None])
        self.W_dec.div_(c_out[None, :])
        self.b_dec.div_(c_out)
        if self.spec.skip:
            self.W_skip.mul_(c_in[:, None] / c_out[None, :])
        self.norm_scale.mul_(scale.to(self.norm_scale))

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, d_in={self.d_in}, n_latents={self.n_latents}, k={self.k}, "
                f"n_sources={self.n_sources}")


def gather_shards(model: SparseCoder, shards: Comm, to_first: bool = False) -> SparseCoder | None:
    """The whole dictionary (with the training parameters ``model`` holds) out of every latent shard's ``model``, on
    every shard; ``to_first``: on shard 0 alone (the others only send theirs and get None), e.g. to save it."""
    state = {}
    for name, t in model.state_dict().items():
        axis = model.latent_axis(name)
        t = t.detach()
        if axis is None:
            state[name] = t
            continue
        rows = t.movedim(axis, 0).contiguous()
        joined = shards.gather_to_first(rows) if to_first else shards.gather_rows(rows)
        state[name] = None if joined is None else joined.movedim(0, axis)
    if to_first and shards.rank != 0:
        return None
    whole = SparseCoder(model.d_in, model.n_latents * shards.size, model.k, model.kind, n_sources=model.n_sources,
                        kernel_impl=model.kernel_impl, device=model.W_dec.device)
    if set(state) - set(whole.state_dict()):  # the training parameters, when ``model`` still has them
        whole.add_train_params()
    whole.load_state_dict(state)
    whole.training_summary = getattr(model, "training_summary", None)
    return whole
