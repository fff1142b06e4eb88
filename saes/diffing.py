"""Model diffing over a two-source crosscoder: decoder-norm analysis and Latent Scaling.

Pure tensor code. Everything here works in ONE unit system: the crosscoder's training units (each source
normalised to mean activation norm sqrt(D)), so that decoder norms of different models are comparable.
Source A is the reference model (e.g. base), B the other one (e.g. fine-tune / chat).

- Per latent j: decoder norms ``|d_j^A|, |d_j^B|``, the relative norm difference
  ``Delta_j = 1/2 ((|d_j^B| - |d_j^A|) / max(|d_j^A|, |d_j^B|) + 1)`` in [0, 1] (1: only in B, 0: only in A),
  tags (B-only, A-only, shared, other) and the decoder cosine ``cos(d_j^A, d_j^B)``.
- Latent Scaling (Minder, Dumas et al. 2025): for direction ``d = d_j^B`` and the latent's activation f(n)
  on the tokens where it fires, ``beta = d^T sum_n f(n) y_n / (|d|^2 sum_n f(n)^2)``, the best scalar of
  ``min_beta sum_n |y_n - beta f(n) d|^2``, for the reconstruction target ``y = x_hat^m`` and the error
  target ``y = x^m - x_hat^m + f(n) d_j^m`` of each model m. ``nu_eps = beta_eps_A / beta_eps_B``,
  ``nu_r = beta_r_A / beta_r_B``. The sums are streamed over batches; tokens are never all held.

Shapes: B batch tokens, S sources, D d_in, L latents. Decoder ``directions [L, S, D]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from .model import SparseCoder

log = logging.getLogger(__name__)

SOURCE_NAMES = ("A", "B")
"""The two models of a diff, in source order (A the reference, B e.g. the fine-tune)."""
TAGS = ("B-only", "A-only", "shared", "other")
"""The one set of per-latent tags (``tag_latents``); ``conceptdict diff`` and naming both report these."""
FLAGS = ("complete_shrinkage", "latent_decoupling", "model_specific")


@dataclass
class DiffAnalysisConfig:
    """Thresholds of the per-latent diffing analysis (defaults from Minder, Dumas et al. 2025)."""

    b_only: float = field(default=0.9, metadata={
        "help": "A latent is B-only when its relative norm difference Delta is above this."})
    a_only: float = field(default=0.1, metadata={"help": "A latent is A-only when its Delta is below this."})
    shared_band: float = field(default=0.1, metadata={"help": "A latent is shared when |Delta - 0.5| is below this."})
    nu_eps_max: float = field(default=0.2, metadata={
        "help": ("A B-only latent is genuinely B-specific only if nu_eps = beta_eps_A / beta_eps_B is below this; at "
                 "or above it, the concept is still in A's reconstruction error (complete shrinkage).")})
    nu_r_max: float = field(default=0.5, metadata={
        "help": ("A B-only latent is genuinely B-specific only if nu_r = beta_r_A / beta_r_B is below this; at or "
                 "above it, A reconstructs the concept through other latents (latent decoupling).")})
    source_a: int = field(default=0, metadata={
        "help": "Index of model A (the reference, e.g. base) among the crosscoder's sources."})
    source_b: int = field(default=1, metadata={
        "help": "Index of model B (e.g. the fine-tune) among the crosscoder's sources."})

    def __post_init__(self) -> None:
        for name in ("b_only", "a_only", "shared_band"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must lie in [0, 1] (Delta is in [0, 1])")
        if self.a_only >= self.b_only:
            raise ValueError(f"a_only={self.a_only} must be below b_only={self.b_only}")
        for name in ("nu_eps_max", "nu_r_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.source_a == self.source_b or min(self.source_a, self.source_b) < 0:
            raise ValueError(
                f"source_a={self.source_a} and source_b={self.source_b} must be two different non-negative indices"
            )


# --------------------------------------------------------------------------- decoder-norm analysis


def decoder_norms(directions: Tensor) -> Tensor:
    """directions [L, S, D] -> per-source decoder norms [L, S]."""
    if directions.ndim != 3:
        raise ValueError(f"directions must be [L, S, D], got shape {tuple(directions.shape)}")
    return directions.norm(dim=-1)


def relative_norm_difference(norm_a: Tensor, norm_b: Tensor) -> Tensor:
    """Delta [L] = 1/2 ((|d_B| - |d_A|) / max(|d_A|, |d_B|) + 1) from norm_a, norm_b [L].

    1 means only in B, 0 only in A, 1/2 equal norms. A latent with both norms zero gets 1/2 (no evidence
    either way); :func:`tag_latents` tags it "other"."""
    biggest = torch.maximum(norm_a, norm_b)
    safe = torch.where(biggest > 0, biggest, torch.ones_like(biggest))
    delta = 0.5 * ((norm_b - norm_a) / safe + 1.0)
    return torch.where(biggest > 0, delta, torch.full_like(delta, 0.5))


def decoder_cosine(d_a: Tensor, d_b: Tensor) -> Tensor:
    """cos(d_j^A, d_j^B) [L] from d_a, d_b [L, D]; 0 where either direction is zero."""
    dot = (d_a * d_b).sum(-1)
    norms = d_a.norm(dim=-1) * d_b.norm(dim=-1)
    return torch.where(norms > 0, dot / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(dot))


def decoder_change(d_a: Tensor, d_b: Tensor) -> Tensor:
    """Relative decoder change [L] = |d_j^B - d_j^A| / max(|d_j^A|, |d_j^B|) from d_a, d_b [L, D], in [0, 2]: 0 the
    same vector in both models, 1 a latent present in one model only, about 2 sin(angle / 2) for equal norms. It
    sees a direction B adds on top of an existing latent, which Delta (norms only) calls "other" or "shared"; 0
    where both decoders are zero."""
    biggest = torch.maximum(d_a.norm(dim=-1), d_b.norm(dim=-1))
    change = (d_b - d_a).norm(dim=-1) / biggest.clamp_min(torch.finfo(biggest.dtype).tiny)
    return torch.where(biggest > 0, change, torch.zeros_like(change))


def tag_latents(delta: Tensor, norm_a: Tensor, norm_b: Tensor, cfg: DiffAnalysisConfig) -> list[str]:
    """One of TAGS per latent: B-only (Delta > b_only), A-only (Delta < a_only), shared
    (|Delta - 1/2| < shared_band), other (anything else, and latents whose decoder is zero in both)."""
    tags = []
    for dl, na, nb in zip(delta.tolist(), norm_a.tolist(), norm_b.tolist()):
        if na == 0.0 and nb == 0.0:
            tags.append("other")
        elif dl > cfg.b_only:
            tags.append("B-only")
        elif dl < cfg.a_only:
            tags.append("A-only")
        elif abs(dl - 0.5) < cfg.shared_band:
            tags.append("shared")
        else:
            tags.append("other")
    return tags


# --------------------------------------------------------------------------- Latent Scaling


class ScalingSums(NamedTuple):
    """Streamed sufficient statistics of Latent Scaling, each [L] float64.

    ``num_*`` = d^T sum_n f(n) y_n for each target; ``sum_f2`` = sum_n f(n)^2; ``fires`` = #tokens with f > 0."""

    num_r_a: Tensor
    num_r_b: Tensor
    num_eps_a: Tensor
    num_eps_b: Tensor
    sum_f2: Tensor
    fires: Tensor

    def __add__(self, other: ScalingSums) -> ScalingSums:  # type: ignore[override]
        return ScalingSums(*(a + b for a, b in zip(self, other)))


class LatentScaling(NamedTuple):
    """Closed-form Latent Scaling results, each [L] float64 (NaN where the latent never fired)."""

    beta_r_a: Tensor
    beta_r_b: Tensor
    beta_eps_a: Tensor
    beta_eps_b: Tensor
    nu_r: Tensor
    nu_eps: Tensor
    fires: Tensor


def scaling_sums(f: Tensor, x: Tensor, x_hat: Tensor, directions: Tensor, source_a: int = 0,
                 source_b: int = 1) -> ScalingSums:
    """Latent Scaling sums of one batch.

    f [B, L] latent activations (0 where a latent does not fire, so only firing tokens count);
    x, x_hat [B, S, D] inputs and reconstructions; directions [L, S, D] the decoder, in the units of x.
    The fitted direction is d = d_j^B. For the error target of model m,
    d^T (x^m - x_hat^m + f d_j^m) = d^T e^m + f (d^T d_j^m), so it needs no per-latent copy of the batch.
    The projections run in the inputs' dtype (float32 on real data: four [B, D] x [D, L] matmuls, the cost
    of one encoder pass each); the sums over tokens are accumulated in float64."""
    dtype = torch.promote_types(x.dtype, directions.dtype)
    f = f.to(dtype)
    d = directions[:, source_b].to(dtype)  # [L, D]
    f2 = f.square().sum(0, dtype=torch.float64)
    out = []
    for m in (source_a, source_b):
        xm, xhm = x[:, m].to(dtype), x_hat[:, m].to(dtype)
        self_dot = (directions[:, m].double() * directions[:, source_b].double()).sum(-1)  # [L]
        num_r = (f * (xhm @ d.T)).sum(0, dtype=torch.float64)
        num_eps = (f * ((xm - xhm) @ d.T)).sum(0, dtype=torch.float64) + f2 * self_dot
        out.append((num_r, num_eps))
    (num_r_a, num_eps_a), (num_r_b, num_eps_b) = out
    fires = (f > 0).sum(0).double()
    return ScalingSums(num_r_a, num_r_b, num_eps_a, num_eps_b, f2, fires)


def scaling_from_sums(sums: ScalingSums, directions: Tensor, source_b: int = 1) -> LatentScaling:
    """beta = num / (|d|^2 sum f^2) for each target, and the ratios nu = beta_A / beta_B."""
    d_sq = directions[:, source_b].double().square().sum(-1)
    den = d_sq * sums.sum_f2
    nan = torch.full_like(den, math.nan)

    def beta(num: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), nan)

    b_r_a, b_r_b, b_e_a, b_e_b = (beta(n) for n in sums[:4])

    def ratio(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(b.abs() > 0, a / torch.where(b.abs() > 0, b, torch.ones_like(b)), nan)

    return LatentScaling(b_r_a, b_r_b, b_e_a, b_e_b, ratio(b_r_a, b_r_b), ratio(b_e_a, b_e_b), sums.fires)


def latent_scaling(
    batches: Iterable[Tensor],
    encode: Callable[[Tensor], Tensor],
    decode: Callable[[Tensor], Tensor],
    directions: Tensor,
    *,
    source_a: int = 0,
    source_b: int = 1,
    max_batches: int | None = None,
) -> LatentScaling:
    """Stream batches x [B, S, D] through ``encode`` (-> f [B, L]) and ``decode`` (-> x_hat [B, S, D]),
    accumulate :class:`ScalingSums` and return the closed-form betas. ``directions [L, S, D]`` and the
    batches must be in the same units (the crosscoder's training units)."""
    total: ScalingSums | None = None
    with torch.no_grad():
        for i, x in enumerate(tqdm(batches, desc="latent scaling", unit="batch", leave=False, total=max_batches)):
            if max_batches is not None and i >= max_batches:
                break
            f = encode(x)
            part = scaling_sums(f, x, decode(f), directions, source_a, source_b)
            total = part if total is None else total + part
    if total is None:
        raise ValueError("latent_scaling got no batches; pass a non-empty batch iterator")
    return scaling_from_sums(total, directions, source_b)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class LatentDiff:
    """The per-latent diffing table; every tensor is [L] (float64 unless stated)."""

    norm_a: Tensor
    norm_b: Tensor
    delta: Tensor
    cosine: Tensor
    tags: list[str]
    scaling: LatentScaling | None
    """None when Latent Scaling was not run (no activations given)."""
    flags: dict[str, Tensor]
    """FLAGS name -> bool [L]; empty without Latent Scaling."""
    change: Tensor | None = None
    """Relative decoder change |d_B - d_A| / max(|d_A|, |d_B|) [L] (:func:`decoder_change`)."""

    @property
    def n_latents(self) -> int:
        return len(self.tags)

    def records(self) -> list[dict]:
        """One plain dict per latent (NaN -> None), for JSON and CSV tables."""
        cols: dict[str, list] = {
            "latent": list(range(self.n_latents)),
            "norm_a": self.norm_a.tolist(),
            "norm_b": self.norm_b.tolist(),
            "delta": self.delta.tolist(),
            "cosine": self.cosine.tolist(),
            "tag": list(self.tags),
        }
        if self.change is not None:
            cols["change"] = self.change.tolist()
        if self.scaling is not None:
            for name in LatentScaling._fields:
                cols[name] = self.scaling._asdict()[name].tolist()
        for name, mask in self.flags.items():
            cols[name] = [bool(v) for v in mask.tolist()]
        clean = {k: [None if isinstance(v, float) and not math.isfinite(v) else v for v in vs] for k, vs in cols.items()}
        return [dict(zip(clean, row)) for row in zip(*clean.values())]

    def changed(self, n: int = 10) -> list[dict]:
        """The ``n`` latents whose decoders differ most between the models (largest relative decoder change,
        whatever their tag), as :meth:`records`; latents that never fired on the analysed rows are left out
        (their decoders are not trained), as are all without a change column."""
        if self.change is None:
            return []
        live = self.scaling.fires > 0 if self.scaling is not None else torch.ones(self.n_latents, dtype=torch.bool)
        order = [j for j in torch.argsort(self.change, descending=True, stable=True).tolist() if live[j]]
        records = self.records()
        return [records[j] for j in order[:n]]

    def counts(self) -> dict[str, int]:
        """Latents per tag and per flag."""
        out = {tag: self.tags.count(tag) for tag in TAGS}
        out.update({name: int(mask.sum()) for name, mask in self.flags.items()})
        return out


def scaling_flags(delta: Tensor, scaling: LatentScaling, cfg: DiffAnalysisConfig) -> dict[str, Tensor]:
    """Flags of the B-only latents (Delta > b_only); other latents get False everywhere.

    complete_shrinkage: nu_eps >= nu_eps_max (A's error still holds the concept);
    latent_decoupling: nu_r >= nu_r_max (A reconstructs it through other latents);
    model_specific: neither, i.e. Delta > b_only and nu_eps < nu_eps_max and nu_r < nu_r_max.
    A latent that never fired (NaN nu) gets no flag."""
    b_only = delta > cfg.b_only
    known = torch.isfinite(scaling.nu_eps) & torch.isfinite(scaling.nu_r)
    shrink = b_only & known & (scaling.nu_eps >= cfg.nu_eps_max)
    decouple = b_only & known & (scaling.nu_r >= cfg.nu_r_max)
    specific = b_only & known & (scaling.nu_eps < cfg.nu_eps_max) & (scaling.nu_r < cfg.nu_r_max)
    return {"complete_shrinkage": shrink, "latent_decoupling": decouple, "model_specific": specific}


def analyse_latents(directions: Tensor, cfg: DiffAnalysisConfig, scaling: LatentScaling | None = None) -> LatentDiff:
    """The full per-latent table from the decoder directions [L, S, D] (training units) and, optionally,
    Latent Scaling results computed with the same ``source_a``/``source_b``."""
    S = directions.shape[1] if directions.ndim == 3 else 0
    if max(cfg.source_a, cfg.source_b) >= S:
        raise ValueError(
            f"source_a={cfg.source_a}, source_b={cfg.source_b} but the decoder has S={S} sources "
            f"(shape {tuple(directions.shape)}); pass indices below {S}"
        )
    norms = decoder_norms(directions.double())
    norm_a, norm_b = norms[:, cfg.source_a], norms[:, cfg.source_b]
    delta = relative_norm_difference(norm_a, norm_b)
    cosine = decoder_cosine(directions[:, cfg.source_a].double(), directions[:, cfg.source_b].double())
    tags = tag_latents(delta, norm_a, norm_b, cfg)
    flags = scaling_flags(delta, scaling, cfg) if scaling is not None else {}
    change = decoder_change(directions[:, cfg.source_a].double(), directions[:, cfg.source_b].double())
    return LatentDiff(norm_a, norm_b, delta, cosine, tags, scaling, flags, change)


def training_directions(model: SparseCoder) -> Tensor:
    """The decoder directions [L, S, D] of a crosscoder (S >= 2) in its training units (the raw directions times
    the per-source normalisation factor, ``saes.kinds.crosscoder.input_scale``), where the models' norms compare."""
    from .kinds.crosscoder import input_scale

    if model.n_sources < 2:
        raise ValueError(f"diffing needs a crosscoder with at least 2 sources, got n_sources={model.n_sources}; "
                         f"train with several stores (kind crosscoder)")
    return model.decoder_directions().detach().float() * input_scale(model)[None, :, None]


def decoder_table(model: SparseCoder, cfg: DiffAnalysisConfig | None = None) -> LatentDiff:
    """Delta, tag and cosine per latent of a crosscoder from its decoder alone (no Latent Scaling): the tags
    ``conceptdict diff`` reports, for anyone else who shows them (naming's concept records)."""
    return analyse_latents(training_directions(model), cfg or DiffAnalysisConfig())


def diff_crosscoder(model: SparseCoder, batches: Iterable[Tensor], cfg: DiffAnalysisConfig, *,
                    max_batches: int | None = None) -> LatentDiff:
    """The per-latent table of a trained crosscoder (a SparseCoder with S >= 2 working on raw activations).

    ``batches`` are raw x [B, S, D] (e.g. held-out rows of both models over the same tokens). Decoder norms,
    cosines and Latent Scaling are computed in the crosscoder's training units (raw activations times the
    per-source normalisation factor, see ``saes.kinds.crosscoder.input_scale``) so that the two models' norms are
    comparable; without batches (``max_batches=0``) the table has no Latent Scaling columns."""
    from .kinds.crosscoder import input_scale

    directions = training_directions(model)
    c = input_scale(model)[:, None]  # [S, 1]
    if max_batches == 0:
        return analyse_latents(directions, cfg)
    scaling = latent_scaling(
        (x.to(c.device).float() * c for x in batches),
        lambda xs: model.encode(xs / c),
        lambda f: model.decode(f) * c,
        directions,
        source_a=cfg.source_a,
        source_b=cfg.source_b,
        max_batches=max_batches,
    )
    return analyse_latents(directions, cfg, scaling)


def live_tag_counts(model: SparseCoder, density: Tensor) -> dict[str, int]:
    """Latents per tag (``decoder_table``'s, sources 0 and 1) among the live ones (``density`` [L] > 0); the
    counts add up to the live latents."""
    live = (density > 0).tolist()
    tags = decoder_table(model).tags
    return {tag: sum(1 for t, on in zip(tags, live) if on and t == tag) for tag in TAGS}


def histogram(values: Tensor, bins: int = 20, lo: float = 0.0, hi: float = 1.0) -> list[int]:
    """Counts of finite ``values`` in ``bins`` equal bins over [lo, hi] (values outside are clipped in)."""
    v = values[torch.isfinite(values)].double().clamp(lo, hi)
    return torch.histc(v, bins=bins, min=lo, max=hi).long().tolist() if v.numel() else [0] * bins


__all__ = [
    "diff_crosscoder",
    "FLAGS",
    "SOURCE_NAMES",
    "TAGS",
    "DiffAnalysisConfig",
    "LatentDiff",
    "LatentScaling",
    "ScalingSums",
    "analyse_latents",
    "decoder_table",
    "decoder_change",
    "decoder_cosine",
    "decoder_norms",
    "histogram",
    "latent_scaling",
    "live_tag_counts",
    "relative_norm_difference",
    "scaling_flags",
    "scaling_from_sums",
    "scaling_sums",
    "tag_latents",
    "training_directions",
]


def crosscoder_size(d_in: int, latents: int | None = None, k: int | None = None) -> tuple[int, int]:
    """(latents, k) of a diff's crosscoder when not given: 8 x D latents, and k = min(32, latents / 8, D / 8).

    Why D / 8: at min(32, latents / 8) a narrow model's code was as wide as half its input (k = 32 at D = 64) and
    the crosscoder split each atom over ~2.4 latents: B-only recall 0.06-0.31 at k = 32 against 0.88-1.00 at k = 8
    (bench/cli_planted.py --diff, bench/crosscoder_diff.py; docs/results). Models of width 256 and more keep 32."""
    latents = 8 * d_in if latents is None else latents
    k = max(1, min(32, latents // 8, d_in // 8)) if k is None else k
    return latents, k
