"""Memory of a training run before it starts (``conceptdict plan``, ``cd.plan``): the parameters, gradients and
Adam state a rank holds, the step's buffers and the data path's, the peak per rank, and the smallest number of
latent shards that fits a device.

The parameters are counted, not derived: the dictionary of the run is built on torch's ``meta`` device (shapes, no
memory) and every tensor it holds is summed, split over ``latent_shards`` along :meth:`SparseCoder.latent_axis` as a
sharded run splits it. So a kind's own layout (a crosscoder's S-source encoder, a transcoder's skip path, a
cross-layer transcoder's decoder, a JumpReLU's log-threshold) is counted as the run holds it, with no second
formula to keep in step.

What a rank holds while it trains (bytes; ``B_r`` = batch / data ranks rows, ``N`` = latent shards, ``w`` the weight
dtype's size, 4 or 8 with ``precision float64``):

- ``weights``: every parameter and buffer, the latent axis split over N;
- ``gradients``: one per parameter; ``adam``: two moments per parameter (float32, or float64);
- ``matmul copy``: with ``precision`` bf16 / fp16, the encoder cast to that dtype for the step's matmul; in bf16 also
  the decoder rows the sparse decode reads (``saes.kernels.copies``: a bf16 copy on a CPU, the rounded rows in
  float32 on a GPU; not for a CLT, whose blocks are read in float32);
- ``pre-activations``: ``[rows, L/N]`` encoder scores in the matmul's dtype; ``rows`` is ``B_r`` on a GPU (one
  matmul), at most :data:`saes.kernels.sparse.ROW_CHUNK` rows on a CPU (row chunks, each selected and freed). A
  cross-layer transcoder encodes one layer at a time: ``[rows, L/(N S)]``. SpaDE on a CPU also keeps its support
  search's ``[rows, L/N]`` int32 index buffer (``saes.kernels.numba_impl.sparsemax_support``);
- ``layer gradient`` (a cross-layer transcoder): one layer's encoder gradient ``[D, L/(N S)]``, made by
  the kernel before it is added into W_enc's (``saes.kinds.clt.layer_encoder_weights``); the CPU kernel keeps that
  buffer for the next step;
- ``step tensors``: the batch, its reconstruction, the error and its gradient (``4 B_r W w``, W the batch's width);
- ``data``: the stream's buffer fills of ``min(buffer_rows, store_rows) / data_ranks`` rows (each rank gathers its
  rows of every batch) at the row width, float32 on a CPU (converted while gathering), the store's dtype on a GPU.
  :data:`STREAM_FILLS` of them are held at once: the fill the loop reads, the one waiting in the read-ahead queue,
  and the one the reader thread has gathered and holds until the queue has room. Plus the held-out batches, whole;
- ``allocator`` (host memory: a CPU run's peak, a GPU run's host): :data:`ALLOCATOR_SLACK`, freed memory glibc's
  malloc keeps. Once the process frees a block that malloc had mapped apart (the step's and the stream's buffers
  are), malloc raises its mmap threshold to that block's size, at most 32 MiB, and its trim threshold to twice
  that: blocks below it come from the heap, and up to 64 MiB freed at the heap's top stay resident. Measured on a
  4-shard CLT (bench/sharding.py): 67 MiB per rank less with ``MALLOC_MMAP_THRESHOLD_=33554432``, which fixes both
  thresholds (the trim threshold at its 128 KiB default).

What it leaves out, and why it is an estimate: fragmentation inside the heap, the kernels' small work
buffers, the CUDA context (~0.5 GiB per process on a GPU), the model and tokenizer of a run that reads a model
live, and the end of the run (calibration, evaluation and saving need no more than training:
``docs/guide/distributed.md#sizing``). ``bench/sharding.py`` prints this plan beside measured peaks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from .kernels.sparse import ROW_CHUNK
from .kinds import kind_spec
from .model import SparseCoder
from .precision import AUTO, MATMUL_DTYPES, native_bf16, weight_dtype

GIB = 2 ** 30
SPARE = 0.10
"""Share of a device's memory a plan leaves free when it picks the smallest shard count that fits."""
MAX_SHARDS = 4096
ALLOCATOR_SLACK = 2 * 32 * 2 ** 20
"""Freed host memory glibc's malloc keeps resident: its dynamic trim threshold, twice the mmap threshold (at most 32
MiB on 64-bit Linux) it rises to once a mapped block is freed (the module's docstring: ``allocator``)."""
STREAM_FILLS = 3
"""Buffer fills the training stream holds at once with its read-ahead of one (``activations.stream_batches(
prefetch=1)``, what ``train`` reads): the fill being read, one in the queue, one gathered and waiting for room."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class PlanConfig:
    """Settings of ``conceptdict plan``: the run to size (its training flags) and the device to fit."""

    kind: str = field(default="topk", metadata=_help("Dictionary kind (as train --kind)."))
    d_model: int = field(default=768, metadata={"min": 1, **_help("Width of one source (the model's d_model).")})
    latents: int = field(default=16384, metadata={"min": 1, **_help(
        "Latents of the whole dictionary (a cross-layer transcoder: all layers together).")})
    k: int = field(default=32, metadata={"min": 1, **_help("Active latents per row (per layer for a CLT).")})
    sources: int = field(default=1, metadata={"min": 1, **_help(
        "Sources the dictionary reads: a crosscoder's models or hookpoints, a cross-layer transcoder's layers.")})
    latent_shards: int = field(default=1, metadata={"min": 1, **_help("Processes the latents are split over.")})
    data_ranks: int = field(default=1, metadata={"min": 1, **_help("Processes the batch is split over.")})
    precision: Literal["auto", "float32", "bf16", "fp16", "float64"] = field(default="auto", metadata=_help(
        "Precision of the encoder matmul (as train --precision; auto: bf16 on a GPU, on a CPU as this one resolves "
        "it, float32 for kinds that train in float32 only)."))
    batch_size: int = field(default=4096, metadata={"min": 1, **_help("Rows per step, over all data ranks.")})
    device: Literal["cuda", "cpu"] = field(default="cuda", metadata=_help(
        "Where the step runs: a GPU computes the batch's encoder scores at once, a CPU in row chunks."))
    device_gib: float | None = field(default=None, metadata=_help(
        "Memory of one device in GiB: the plan also gives the smallest --latent-shards that fits it (10% spare)."))
    store_rows: int | None = field(default=None, metadata=_help(
        "Rows of the store the run reads (None: at least the mixing buffer's)."))
    store_bytes: int = field(default=4, metadata=_help(
        "Bytes per value in the store (4 float32, 2 bf16/float16); a GPU run's fills keep them, a CPU run's are "
        "float32."))
    buffer_rows: int = field(default=65536, metadata={"min": 1, **_help("Rows in the training stream's mixing "
                                                                         "buffer (as train --buffer-rows).")})
    heldout_batches: int = field(default=1, metadata={"min": 0, **_help(
        "Batches held out whole for evaluation and calibration.")})

    def __post_init__(self) -> None:
        spec = kind_spec(self.kind)
        if self.precision not in MATMUL_DTYPES and self.precision != AUTO:
            raise ValueError(f"precision={self.precision!r}: use one of {sorted([AUTO, *MATMUL_DTYPES])}")
        if spec.layered and self.latents % self.sources:
            raise ValueError(f"a {self.kind} splits its latents equally over its {self.sources} layers: latents="
                             f"{self.latents} is not a multiple of sources={self.sources}")
        if self.latents % self.latent_shards:
            raise ValueError(f"latents={self.latents} is not a multiple of latent_shards={self.latent_shards}")
        if self.batch_size % self.data_ranks:
            raise ValueError(f"batch_size={self.batch_size} is not a multiple of data_ranks={self.data_ranks}")
        if self.device_gib is not None and self.device_gib <= 0:
            raise ValueError(f"device_gib={self.device_gib}: give a device's memory in GiB, e.g. 80")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank holds while it trains (:func:`plan_memory`), by what holds them."""

    config: PlanConfig
    weights: int
    gradients: int
    adam: int
    matmul_copy: int
    pre_activations: int
    layer_gradient: int
    step_tensors: int
    data: int
    allocator: int
    """Freed host memory the C allocator keeps (:data:`ALLOCATOR_SLACK`): in the peak on a CPU, in ``host`` on a GPU."""
    parameters: int
    """Parameters of the whole dictionary (all shards), a count."""
    shardable: bool
    """Whether the kind trains with its latents split (``--latent-shards``); the figures for N > 1 of a kind that
    cannot are what it would hold."""
    fits: int | None = None
    """With ``device_gib``: the smallest latent shard count whose peak fits the device with 10% spare (None: none
    up to 4096)."""

    @property
    def peak(self) -> int:
        """The training peak of one rank's device: every part on a CPU; on a GPU every part but ``data``, which the
        stream holds in host memory (:attr:`host`)."""
        on_device = (self.weights + self.gradients + self.adam + self.matmul_copy + self.pre_activations
                     + self.layer_gradient + self.step_tensors)
        return on_device + (self.data + self.allocator if self.config.device == "cpu" else 0)

    @property
    def host(self) -> int:
        """Host memory of one rank's data path on a GPU run (the stream's fills, the held-out batches and the
        allocator's slack; 0 on a CPU, where :attr:`peak` counts them)."""
        return self.data + self.allocator if self.config.device == "cuda" else 0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "config"}
        return {"config": asdict(self.config), **out, "peak": self.peak, "host": self.host}

    def format(self) -> str:
        c = self.config
        head = (f"{c.kind}: {self.parameters:,} parameters (d_model {c.d_model}, {c.latents:,} latents, "
                f"{c.sources} source{'s' * (c.sources > 1)}), {c.latent_shards} latent shard"
                f"{'s' * (c.latent_shards > 1)} x {c.data_ranks} data rank{'s' * (c.data_ranks > 1)}, "
                f"{c.precision}, batch {c.batch_size} on {c.device}")
        parts = [("weights", self.weights), ("gradients", self.gradients), ("adam", self.adam),
                 ("matmul copy", self.matmul_copy), ("pre-activations", self.pre_activations),
                 ("layer gradient", self.layer_gradient), ("step tensors", self.step_tensors)]
        parts += [("data", self.data), ("allocator", self.allocator), ("peak per rank", self.peak)] \
            if c.device == "cpu" else [("peak per device", self.peak), ("host memory", self.host)]
        lines = [head] + [f"  {name:<16} {_gib(b)}" for name, b in parts if b or name.startswith("peak")]
        if not self.shardable and c.latent_shards > 1:
            lines.append(f"  note: kind {c.kind!r} does not train with --latent-shards yet; these are the figures it "
                         f"would hold")
        if c.device_gib is not None:
            lines.append(f"  fits {c.device_gib:g} GiB with 10% spare: " + (
                f"--latent-shards {self.fits}" if self.fits else "no shard count up to 4096"))
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:10.3f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:10.1f} MiB"


def _held(cfg: PlanConfig) -> tuple[int, int, int]:
    """(weight bytes, trainable bytes, parameter count) of one rank's dictionary, counted on the meta device."""
    wbytes = torch.empty((), dtype=weight_dtype(cfg.precision)).element_size()
    model = SparseCoder(cfg.d_model, cfg.latents, min(cfg.k, max(1, _per_layer(cfg) - 1)), kind=cfg.kind,
                        n_sources=cfg.sources, device="meta")
    model.add_train_params()
    n, held, trained, count = cfg.latent_shards, 0, 0, 0
    trainable = {name for name, _ in model.named_parameters()}
    held_tensors = [*model.named_parameters(), *model.named_buffers()]  # what it holds (state_dict: what it saves)
    for name, t in held_tensors:
        numel = t.numel() // n if model.latent_axis(name) is not None else t.numel()
        held += numel * wbytes
        count += t.numel() if name in trainable else 0
        trained += numel * wbytes if name in trainable else 0
    return held, trained, count


def _per_layer(cfg: PlanConfig) -> int:
    return cfg.latents // cfg.sources if kind_spec(cfg.kind).layered else cfg.latents


def plan_memory(cfg: PlanConfig) -> MemoryPlan:
    """What one rank of the run ``cfg`` describes holds while it trains (see the module's docstring), and with
    ``cfg.device_gib`` the smallest latent shard count that fits."""
    spec = kind_spec(cfg.kind)
    if cfg.precision == AUTO:  # as a run resolves it (saes.precision.resolve_precision); GPUs in use have bf16
        bf16 = spec.mixed_precision and (cfg.device == "cuda" or native_bf16(torch.device("cpu")))
        cfg = PlanConfig(**{**asdict(cfg), "precision": "bf16" if bf16 else "float32"})
    held, trained, count = _held(cfg)
    wbytes = torch.empty((), dtype=weight_dtype(cfg.precision)).element_size()
    mm = MATMUL_DTYPES[cfg.precision]
    mbytes = wbytes if mm is None else torch.empty((), dtype=mm).element_size()
    per_rank, L_r = cfg.batch_size // cfg.data_ranks, cfg.latents // cfg.latent_shards
    d_enc = cfg.d_model if (spec.layered or spec.sources != "several") else cfg.sources * cfg.d_model
    # the encoder's input width a latent reads; a pair (transcoder, CLT) batch holds inputs and outputs
    row_width = cfg.d_model * cfg.sources * (2 if spec.sources == "pair" else 1)
    out_width = cfg.d_model * cfg.sources
    matmul_copy = 0 if mm is None else d_enc * L_r * mbytes
    if mm == torch.bfloat16 and not spec.layered:  # the decode's rounded rows (saes.kernels.copies)
        matmul_copy += L_r * out_width * (mbytes if cfg.device == "cpu" else 4)
    rows = per_rank if cfg.device == "cuda" else min(per_rank, ROW_CHUNK)
    encoded = L_r // cfg.sources if spec.layered else L_r  # the latents one encoder matmul scores
    pre = rows * encoded * mbytes
    if spec.name == "spade" and cfg.device == "cpu":  # the support search's recycled index buffer
        pre += rows * encoded * 4
    layer_gradient = cfg.d_model * encoded * wbytes if spec.layered else 0
    step = per_rank * row_width * wbytes + 3 * per_rank * out_width * wbytes
    fill = min(cfg.buffer_rows, cfg.store_rows or cfg.buffer_rows) // cfg.data_ranks
    fill_bytes = 4 if cfg.device == "cpu" else cfg.store_bytes
    data = (STREAM_FILLS * fill * row_width * fill_bytes
            + cfg.heldout_batches * cfg.batch_size * row_width * wbytes)
    plan = MemoryPlan(cfg, held, trained, 2 * trained, matmul_copy, pre, layer_gradient, step, data,
                      ALLOCATOR_SLACK, count, spec.shardable)
    if cfg.device_gib is None:
        return plan
    return replace(plan, fits=_fits(cfg))


def _fits(cfg: PlanConfig) -> int | None:
    """The smallest latent shard count N (a divisor of the latents, per layer for a CLT) whose peak per rank fits
    ``device_gib`` with :data:`SPARE` left."""
    budget = cfg.device_gib * GIB * (1 - SPARE)
    per = _per_layer(cfg)
    for n in range(1, MAX_SHARDS + 1):
        if per % n:
            continue
        trial = PlanConfig(**{**asdict(cfg), "latent_shards": n, "device_gib": None})
        if plan_memory(trial).peak <= budget:
            return n
    return None


__all__ = ["MemoryPlan", "PlanConfig", "plan_memory"]
