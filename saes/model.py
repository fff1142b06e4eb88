"""`SparseCoder`: one module for every dictionary kind (TopK, BatchTopK, ReLU-L1; crosscoders with S > 1).

The parameters keep the S sources flattened so one set of kernels serves SAEs and crosscoders:
``W_enc [S*D, L]``, ``b_enc [L]``, ``W_dec [L, S*D]``, ``b_dec [S*D]`` (viewed as ``[S, D, L]`` /
``[S, L, D]`` / ``[S, D]`` on disk when S > 1). What differs between kinds -- how the training step picks
the active latents, its sparsity penalty, the inference rule, its settings -- is a kind's :class:`KindSpec`, one
module of saes/kinds/ listed in its registry, so a new kind is a module, not a subclass.

Shapes: B batch rows, D input width per source, S sources, L latents, K kept entries per row.

For users (``cd.load``, ``cd.train``), :meth:`SparseCoder.encode`, :meth:`~SparseCoder.decode` and ``sae(x)`` take any
leading shape (``[..., D]``; a dictionary over S > 1 sources, a crosscoder: ``[..., S, D]``), any float dtype (computed
in the dictionary's, returned in the input's) and numpy arrays (returned as numpy arrays); ``sae.cfg`` is what the
dictionary is (:class:`DictionaryConfig`), ``sae.device`` / ``sae.dtype`` where and in what it computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from . import kernels
from .comm import LOCAL, shard_bias, shard_sum
from .kinds import KINDS, KindSpec, TrainOutput, clt, kind_spec
from .kinds.common import pre_activations, relative_acts
from .latents import latent_groups, shard_ranges

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["KINDS", "DictionaryConfig", "KindSpec", "SparseCoder", "TrainOutput", "kind_spec"]


@dataclass(frozen=True)
class DictionaryConfig:
    """What a dictionary is (``sae.cfg``): its shape and kind from the module, where it was trained from its config
    (``sae.config``, the config.json it was loaded with; empty fields for a dictionary built in Python)."""

    kind: str
    """The dictionary kind (saes/kinds/): topk, batchtopk, crosscoder, transcoder, ..."""
    d_in: int
    """D: the input width per source."""
    latents: int
    """L: the number of latents."""
    k: int
    """Active latents per row (TopK), or on average (BatchTopK and the thresholded kinds)."""
    sources: int
    """S: the sources it reads at once (1: an SAE; a crosscoder's models or hookpoints; a cross-layer transcoder's
    layers); its input is then [..., S, D]."""
    hookpoints: tuple[str, ...] = ()
    """The hookpoints it was trained on (a transcoder: its input, then its output)."""
    model: str | None = None
    """The model the activations came from, when recorded."""
    level: str | None = None
    """token or sentence (the store's level), when recorded."""
    stores: tuple[str, ...] = ()
    """The activation stores it was trained on."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types."""
        from .tables import plain

        return plain(self)


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
                 kernel_impl: str = "auto", dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 init: bool = True) -> None:
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
        if layered:  # a cross-layer transcoder holds only its decoder's triangle (saes/kinds/clt.py)
            clt.add_decoder_blocks(self, **kw)
        else:
            self.W_dec = nn.Parameter(torch.empty(n_latents, width, **kw))
        self.b_dec = nn.Parameter(torch.zeros(width, **kw))
        if self.spec.skip:
            self.W_skip = nn.Parameter(torch.zeros(width, width, **kw))
        self.register_buffer("threshold", torch.full((n_latents,), -1.0, **kw))
        self.register_buffer("norm_scale", torch.ones(n_sources, **kw))
        for name in self.spec.buffers:
            self.register_buffer(name, torch.zeros(n_latents, **kw))
        if init and torch.device(device).type != "meta":  # meta: shapes only (saes.sizing counts them)
            self.reset_parameters()  # init=False: the caller draws them (training, once, from its seeded generator)

    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.kind)

    @property
    def W_dec(self) -> Tensor:
        """The decoder [L, S*D]; a cross-layer transcoder holds its triangle (:meth:`decoder_parts`): made on read."""
        if self.spec.layered or "W_dec" not in self._parameters:  # (the latter: until __init__ registers it)
            return clt.whole_decoder(self)
        return self._parameters["W_dec"]

    def decoder_parts(self) -> list[tuple[Tensor, slice, int]]:
        """The parameters that hold the decoder: (tensor, its rows (latents), its first column) -- the whole W_dec, or
        a cross-layer transcoder's block per layer l (rows: layer l's latents, columns from l D on)."""
        if not self.spec.layered:
            return [(self.W_dec, slice(0, self.n_latents), 0)]
        return [(w, lat, l * self.d_in) for l, (w, (lat, _)) in
                enumerate(zip(clt.decoder_blocks(self), clt.layer_slices(self)))]

    @torch.no_grad()
    def assign_decoder(self, W: Tensor) -> None:
        """Set the decoder from its whole [L, S*D] form (a cross-layer transcoder keeps the entries it holds)."""
        for part, rows, col in self.decoder_parts():
            part.copy_(W[rows, col:])

    def sparse_decode(self, values: Tensor, indices: Tensor) -> Tensor:
        """A sparse code (values, latent indices [B, K]) -> its decode [B, S*D], without b_dec."""
        if self.spec.layered:
            return clt.decode_code(self, values, indices)
        return kernels.sparse_decode(values, indices, self.W_dec, None, impl=self.kernel_impl, skip_zero_grads=True)

    def dense_decode(self, f: Tensor) -> Tensor:
        """Dense codes f [B, L] -> f W_dec [B, S*D], without b_dec (a CLT block by block)."""
        return clt.dense_decode(self, f) if self.spec.layered else f @ self.W_dec

    @property
    def device(self) -> torch.device:
        """Where the weights are (``sae.to("cuda")`` moves them and returns the dictionary)."""
        return self.b_enc.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, in which encode / decode compute (``sae.to(torch.bfloat16)`` changes it)."""
        return self.b_enc.dtype

    @property
    def cfg(self) -> DictionaryConfig:
        """What this dictionary is: kind, d_in, latents, k, sources, and from ``.config`` (its config.json) the
        hookpoints, model, level and stores it was trained on."""
        config = getattr(self, "config", None) or {}
        model = config.get("model")
        return DictionaryConfig(self.kind, self.d_in, self.n_latents, self.k, self.n_sources,
                                tuple(config.get("hookpoints") or ()),
                                model.get("id") if isinstance(model, dict) else model, config.get("level"),
                                tuple(str(p) for p in config.get("stores") or ()))

    def reset_parameters(self, generator: torch.Generator | None = None, shard: tuple[int, int] = (0, 1)) -> None:
        """Random unit-norm decoder rows, ``W_enc = W_dec^T``, zero biases. A transcoder's decoder starts at
        zero (sparsify's rule: it predicts another activation, so a tied decoder would start with a random map;
        the first steps give each latent its direction). ``shard`` (i, N): this module is latent shard i of N of a
        dictionary of N L latents (saes.latents: a CLT's slice of each layer), and takes those rows of its draw."""
        with torch.no_grad():
            L, width = self.n_latents, self.n_sources * self.d_in
            ours, w = shard_ranges(L * shard[1], latent_groups(self, "W_dec"), *shard), torch.empty(L, width)
            for s, e in _draw_blocks(L * shard[1], width):  # the whole draw, a block of rows at a time; keep ours
                block = torch.randn((e - s, width), generator=generator, dtype=torch.float32)
                for lo, hi, at in ours:
                    a, b = max(s, lo), min(e, hi)
                    if a < b:
                        w[at + a - lo: at + b - lo] = block[a - s: b - s]
            w /= w.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self.assign_decoder(w * (0 if self.spec.transcodes else 1))
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
        return torch.arange(self.n_latents, device=self.b_enc.device) // per_layer

    def decoder_mask(self) -> Tensor | None:
        """bool [L, S*D]: the decoder entries a layered kind has (a latent of layer l writes to layers >= l); the
        others are zero (not held). None for every other kind."""
        columns = torch.arange(self.n_sources * self.d_in, device=self.device) // self.d_in
        return columns[None, :] >= self.layer_of_latent()[:, None] if self.spec.layered else None

    def reconstruct(self, x: Tensor, f: Tensor | tuple[Tensor, Tensor], comm: Comm = LOCAL) -> Tensor:
        """The flattened reconstruction [B, S*D] of the target from the encoder input x and the code f [B, L] (or
        packed, (values, indices) [B, K]: decoded sparsely, :meth:`sparse_decode`): f W_dec + b_dec, plus x W_skip
        for kinds with a skip path. With latent shards (``comm.shards``, saes.comm) f is this shard's latents' code
        [B, L_s]: each shard decodes its part and the parts are summed, the biases and the skip path counted once."""
        out = (self.sparse_decode(*f) if isinstance(f, tuple) else self.dense_decode(f)) + shard_bias(self.b_dec, comm)
        if self.spec.skip and comm.shards.rank == 0:
            out = out + x @ self.W_skip
        return shard_sum(out, comm)

    def codes(self, x: Tensor, comm: Comm = LOCAL) -> Tensor:
        """Dense codes [B, L] of the flattened input x [B, S*D] under the inference rule (what :meth:`encode` gives
        after flattening); with latent shards, this shard's latents' codes [B, L_s], chosen among every shard's
        where the rule selects across latents (``KindSpec.shard_encode``: per-row TopK)."""
        if comm.shards.size > 1 and self.spec.shard_encode is not None:
            return self.spec.shard_encode(self, x, comm)
        return self.spec.encode(self, x)

    # -- inference ------------------------------------------------------------------------------
    def input_rows(self, x: Tensor | np.ndarray, what: str, tail: tuple[int, ...],
                   meaning: str) -> tuple[Tensor, Callable[[Tensor, tuple[int, ...]], Any]]:
        """(x [..., *tail] as rows [N, prod(tail)] in this dictionary's dtype, a function that gives a result [N, *out]
        back as [..., *out] in the input's dtype and type). A numpy array is moved to the dictionary's device and the
        result comes back as a numpy array; a tensor must be on the dictionary's device. ``what`` / ``meaning`` name
        the call and the expected shape in the one-line error."""
        want = f"[..., {', '.join(map(str, tail))}] ({meaning})"
        as_numpy = isinstance(x, np.ndarray)
        if as_numpy:
            try:
                x = torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
            except TypeError:
                raise TypeError(f"{what} expects floating-point values {want}, got a numpy array of "
                                f"{x.dtype}") from None
        elif not isinstance(x, Tensor):
            raise TypeError(f"{what} expects a tensor or numpy array {want}, got {type(x).__name__}")
        if not x.is_floating_point():
            given = f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
            raise TypeError(f"{what} expects floating-point values {want}, got {given}; convert it with .float()")
        if x.dim() < len(tail) or tuple(x.shape[x.dim() - len(tail):]) != tail:
            raise ValueError(f"{what} expects {want}, got {list(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{what} got a tensor on {x.device} but this dictionary is on {self.device}: move one, "
                             f"sae.to({str(x.device)!r}) or x.to({str(self.device)!r})")
        lead, dtype = x.shape[:x.dim() - len(tail)], x.dtype

        def back(out: Tensor, shape: tuple[int, ...]) -> Any:
            out = out.reshape(*lead, *shape).to(dtype)
            return out.detach().cpu().numpy() if as_numpy else out

        return x.reshape(-1, math.prod(tail)).to(self.dtype), back

    def source_rows(self, x: Tensor | np.ndarray, what: str) -> tuple[Tensor, Callable[[Tensor, tuple[int, ...]], Any]]:
        """:meth:`input_rows` of a dictionary input: [..., D], or [..., S, D] over S > 1 sources."""
        S, D = self.n_sources, self.d_in
        if S == 1:
            return self.input_rows(x, what, (D,), "d_in of this dictionary")
        return self.input_rows(x, what, (S, D), f"{S} sources x d_in {D} of this dictionary")

    def rule(self, rows: Tensor) -> Tensor:
        """The kind's inference rule on rows [N, S*D] in this process -> codes [N, L] (no rows: [0, L], whatever the
        kind's kernels make of an empty batch)."""
        return self.spec.encode(self, rows) if rows.shape[0] else rows.new_zeros(0, self.n_latents)

    def encode(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """x [..., D] (S > 1 sources: [..., S, D]) -> dense codes [..., L] under the kind's inference rule; computed
        in the dictionary's dtype, returned in x's (module docstring)."""
        rows, back = self.source_rows(x, "encode")
        return back(self.rule(rows), (self.n_latents,))

    def dense_activations(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """x [..., D] or [..., S, D] -> [..., L]: every latent's ReLU activation before the kind's selection (TopK,
        threshold): relu(pre), or s(x) relu(pre / s(x)) for the row-relative kinds (``row_scale``)."""
        x, back = self.source_rows(x, "dense_activations")
        if not self.spec.relative:
            return back(torch.relu(pre_activations(self, x)), (self.n_latents,))
        acts, s = relative_acts(self, x)
        return back(acts * s, (self.n_latents,))

    def output_shape(self) -> tuple[int, ...]:
        """The trailing shape of a reconstruction: (D,), or (S, D) over S > 1 sources."""
        return (self.d_in,) if self.n_sources == 1 else (self.n_sources, self.d_in)

    def decode(self, f: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Codes f [..., L] -> x_hat [..., D] (S > 1 sources: [..., S, D]), in f's dtype."""
        rows, back = self.input_rows(f, "decode", (self.n_latents,), "the latents of this dictionary")
        return back(self.dense_decode(rows) + self.b_dec, self.output_shape())

    def forward(self, x: Tensor | np.ndarray) -> Tensor | np.ndarray:
        """Reconstruction of x, same shape and dtype as x (a transcoder: its prediction of the output from the
        input x)."""
        rows, back = self.source_rows(x, "sae(x)")
        return back(self.reconstruct(rows, self.rule(rows)), self.output_shape())

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
        if name.startswith("W_dec_"):  # a cross-layer transcoder's decoder block: rows are its layer's latents
            return 0
        per_latent = {"W_dec", "b_enc", "threshold", *self.spec.buffers,
                      *(self.spec.train_params(self) if self.spec.train_params else {})}
        return 0 if name in per_latent else None

    def add_train_params(self) -> None:
        """Register the kind's extra training parameters (``KindSpec.train_params``), after the weights."""
        for name, t in (self.spec.train_params(self) if self.spec.train_params else {}).items():
            self.register_parameter(name, nn.Parameter(t.to(self.b_enc)))

    def drop_train_params(self) -> None:
        """Remove the extra training parameters (after ``KindSpec.finish`` wrote the inference form)."""
        for name in (self.spec.train_params(self) if self.spec.train_params else {}):
            delattr(self, name)

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every (flattened) decoder row to unit norm."""
        for W, _, _ in self.decoder_parts():
            W /= W.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_decoder_grad(self) -> None:
        """Drop the component of W_dec.grad parallel to each (unit) decoder row, so a step keeps norms ~1."""
        for W, g in ((W, W.grad) for W, _, _ in self.decoder_parts() if W.grad is not None):
            kernels.project_rows(W.detach(), g, impl=self.kernel_impl)  # g -= (g.w / |w|^2) w

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
        for W, _, col in self.decoder_parts():
            W.div_(c_out[None, col:])
        self.b_dec.div_(c_out)
        if self.spec.skip:
            self.W_skip.mul_(c_in[:, None] / c_out[None, :])
        self.norm_scale.mul_(scale.to(self.norm_scale))

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, d_in={self.d_in}, n_latents={self.n_latents}, k={self.k}, "
                f"n_sources={self.n_sources}")

    def __repr__(self) -> str:
        """One line: kind, shape, hookpoint(s), dtype, device."""
        from .tables import short_list

        c = self.cfg
        hooks = (f", hookpoint={short_list(c.hookpoints)[1:-1]}" if len(c.hookpoints) == 1 else
                 f", hookpoints={short_list(c.hookpoints, 2, 30)}" if c.hookpoints else "")
        sources = f", sources={c.sources}" if c.sources > 1 else ""
        return (f"SparseCoder({c.kind}{sources}, d_in={c.d_in}, latents={c.latents}, k={c.k}{hooks}, "
                f"{str(self.dtype).removeprefix('torch.')}, {self.device})")
