"""Evaluation of a dictionary: reconstruction, sparsity and (for language models) spliced-loss scores.

Formulas follow SAEBench / SAELens (see REFERENCES.md "Evaluation formulas"). Everything is accumulated in
float64 over a stream of batches, so the numbers do not depend on how the rows are batched (except where a
formula is defined per batch, which none here are).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import Tensor

from .comm import LOCAL, Comm
from .latents import interleave, latent_groups
from .lazy import LazyDictionary
from .model import SparseCoder

if TYPE_CHECKING:
    import pandas

DENSE_FRACTION = 0.1
"""A latent firing on more than this fraction of tokens is "dense" (SAEBench)."""

HIST_EDGES = tuple(float(e) for e in range(-8, 1))
"""log10 firing-frequency bin edges of the histogram: [-inf, -8), [-8, -7), ..., [-1, 0]."""


@dataclass(frozen=True)
class EvalResult:
    """Reconstruction and sparsity metrics of a dictionary on a set of rows."""

    n_tokens: int
    """Rows evaluated."""
    l0: float
    """Mean number of non-zero latents per row, under the inference rule (BatchTopK: JumpReLU(theta))."""
    mse: float
    """Mean squared error per element: sum ||x - x_hat||^2 / (N * S * D)."""
    fvu: float
    """Fraction of variance unexplained (textbook): sum ||x - x_hat||^2 / sum ||x - mean(x)||^2."""
    explained_variance: float
    """1 - fvu (textbook)."""
    explained_variance_saebench: float
    """SAEBench/SAELens "explained_variance": 1 - E||x - x_hat||^2 / (E||x||^2 - (mean of x^2 over all
    elements)^2). Not the textbook value: it subtracts the squared mean of x^2, not ||mean(x)||^2."""
    cos_sim: float
    """Mean over rows of cos(x, x_hat)."""
    l2_ratio: float
    """Mean over rows of ||x_hat|| / ||x||."""
    rel_recon_bias: float
    """E||x_hat||^2 / E<x, x_hat> (1 = no shrinkage; Wright & Sharkey, eq. 10)."""
    dead_fraction: float
    """Fraction of latents that never fire on these rows."""
    dense_fraction: float
    """Fraction of latents firing on more than 10% of rows."""
    per_source_fvu: tuple[float, ...]
    """FVU of each source (crosscoders; one entry for an SAE)."""
    density_histogram: tuple[int, ...]
    """Latents per log10 firing-frequency bin; bin 0 = never fires, then [-inf,-8), [-8,-7), ..., [-1, 0]."""
    kind: str = ""
    """Dictionary kind."""
    k: int = 0
    """The dictionary's k (compare with l0 for BatchTopK)."""
    n_latents: int = 0
    """L."""
    density: tuple[float, ...] = field(default=(), repr=False)
    """Firing frequency of each latent [L] (not shown in tables)."""
    ce_loss_recovered: float | None = None
    """(CE_zero - CE_sae) / (CE_zero - CE_clean) when spliced into a language model, else None."""
    kl_score: float | None = None
    """(KL_zero - KL_sae) / KL_zero when spliced into a language model, else None."""
    splice: dict[str, float] | None = None
    """The raw spliced losses (ce_clean, ce_zero, ce_replaced, kl_zero, kl_replaced) when measured; a replacement
    model's (every MLP replaced at once) also ce_with_errors, kl_with_errors, max_logit_diff_with_errors."""
    per_layer_l0: tuple[float, ...] = ()
    """A cross-layer transcoder's mean L0 of each layer's latents (empty for other kinds)."""
    per_layer_dead: tuple[float, ...] = ()
    """A cross-layer transcoder's fraction of dead latents in each layer (empty for other kinds)."""
    l1: float | None = None
    """Mean over rows of the sum of the latents' activations (SAEBench core's "l1"; None where not measured)."""

    def to_dict(self, with_density: bool = False) -> dict[str, Any]:
        """JSON-able dict; per-latent density only when asked."""
        out = asdict(self)
        out["per_source_fvu"] = list(self.per_source_fvu)
        out["density_histogram"] = list(self.density_histogram)
        out["per_layer_l0"], out["per_layer_dead"] = list(self.per_layer_l0), list(self.per_layer_dead)
        if with_density:
            out["density"] = list(self.density)
        else:
            out.pop("density")
        return out

    def to_pandas(self) -> pandas.DataFrame:
        """One row: every metric as a column (per_source_fvu, density_histogram, ... as list cells; the raw spliced
        losses as splice.ce_clean, ...)."""
        from .tables import frame

        return frame([self.to_dict()])


class _Sums:
    """Running float64 sums over rows (N rows of F = S*D features, S sources)."""

    def __init__(self, n_sources: int, d_in: int, n_latents: int, device: torch.device) -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self.S, self.D = n_sources, d_in
        self.n = 0
        self.sum_x = torch.zeros(n_sources * d_in, **f64)  # [F]
        self.sq_x = torch.zeros(n_sources, **f64)  # [S] sum ||x_s||^2
        self.sq_err = torch.zeros(n_sources, **f64)  # [S] sum ||x_s - x_hat_s||^2
        self.sq_xhat = torch.zeros((), **f64)
        self.dot = torch.zeros((), **f64)
        self.cos = torch.zeros((), **f64)
        self.ratio = torch.zeros((), **f64)
        self.l0 = torch.zeros((), **f64)
        self.l1 = torch.zeros((), **f64)
        self.fires = torch.zeros(n_latents, **f64)

    def add_codes(self, f: Tensor, first: int = 0) -> None:
        """Codes f [B, L_b] of latents [first, first + L_b) (a block of them, or all)."""
        self.l0 += torch.count_nonzero(f)  # counted without [B, L_b] bool and int64 temporaries
        self.l1 += f.double().sum()
        self.fires[first: first + f.shape[1]] += torch.count_nonzero(f, dim=0)

    def add_packed(self, values: Tensor, indices: Tensor) -> None:
        """A packed code (:func:`packed_code`): values [B, K] of latents indices [B, K], zero where padded."""
        kept = values != 0
        self.l0 += kept.sum()
        self.l1 += values.double().sum()
        self.fires += torch.bincount(indices[kept], minlength=self.fires.shape[0])

    def add_rows(self, x: Tensor, x_hat: Tensor) -> None:
        """x, x_hat [B, S*D]."""
        x, x_hat = x.double(), x_hat.double()
        B = x.shape[0]
        self.n += B
        self.sum_x += x.sum(dim=0)
        self.sq_x += x.view(B, self.S, self.D).pow(2).sum(dim=(0, 2))
        self.sq_err += (x - x_hat).view(B, self.S, self.D).pow(2).sum(dim=(0, 2))
        self.sq_xhat += x_hat.pow(2).sum()
        self.dot += (x * x_hat).sum()
        nx, nh = x.norm(dim=1), x_hat.norm(dim=1)
        self.cos += ((x * x_hat).sum(dim=1) / (nx * nh).clamp_min(1e-30)).sum()
        self.ratio += (nh / nx.clamp_min(1e-30)).sum()


def packed_code(f: Tensor) -> tuple[Tensor, Tensor]:
    """Dense codes f [B, L] -> (values, indices) [B, K]: each row's non-zero entries in latent order, padded with
    (0, latent 0) to the longest row's count K (the form ``SparseCoder.reconstruct`` decodes sparsely)."""
    rows, cols = f.nonzero(as_tuple=True)  # row by row, columns increasing
    count = torch.bincount(rows, minlength=f.shape[0])  # (not a sum over [B, L]: 5x the nonzero's time)
    pos = torch.arange(rows.shape[0], device=f.device) - (count.cumsum(dim=0) - count)[rows]
    width = int(count.max()) if f.shape[0] else 0
    values = f.new_zeros(f.shape[0], width)
    indices = torch.zeros(f.shape[0], width, dtype=torch.long, device=f.device)
    values[rows, pos], indices[rows, pos] = f[rows, cols], cols
    return values, indices


def _variance_per_source(s: _Sums) -> Tensor:
    """sum over rows of ||x_s - mean(x_s)||^2 = sum ||x_s||^2 - N ||mean(x_s)||^2, per source [S]."""
    mean = (s.sum_x / s.n).view(s.S, s.D)
    return s.sq_x - s.n * mean.pow(2).sum(dim=1)


def _ratio(num: float, den: float) -> float:
    return num / den if den != 0 else math.nan


def density_histogram(density: Tensor) -> tuple[int, ...]:
    """Latents per bin: never fires, then log10-frequency bins [-inf,-8), [-8,-7), ..., [-1, 0]."""
    dead = int((density == 0).sum())
    logf = torch.log10(density[density > 0])
    edges = torch.tensor(HIST_EDGES, dtype=logf.dtype)
    bins = torch.bucketize(logf, edges, right=True)  # 0: below -8, ..., len(edges): == 0 (always fires)
    counts = torch.bincount(bins, minlength=len(edges) + 1).tolist()
    always = counts.pop()
    counts[-1] += always  # frequency exactly 1 belongs to the last bin [-1, 0]
    return (dead, *counts)


def _result(model: SparseCoder, s: _Sums, n_latents: int | None = None) -> EvalResult:
    var_s = _variance_per_source(s)
    err, var = float(s.sq_err.sum()), float(var_s.sum())
    mean_sq_tok = float(s.sq_x.sum()) / s.n  # E||x||^2
    mean_sq_elem = mean_sq_tok / (s.S * s.D)  # mean of x^2 over every element
    density = (s.fires / s.n).float()
    fvu = _ratio(err, var)
    layers = density.view(s.S, -1) if model.spec.layered else density[:0].view(0, 1)  # [S, L/S]: each layer's
    return EvalResult(
        n_tokens=s.n,
        l0=float(s.l0) / s.n,
        mse=err / (s.n * s.S * s.D),
        fvu=fvu,
        explained_variance=1.0 - fvu,
        explained_variance_saebench=1.0 - _ratio(err / s.n, mean_sq_tok - mean_sq_elem**2),
        cos_sim=float(s.cos) / s.n,
        l2_ratio=float(s.ratio) / s.n,
        rel_recon_bias=_ratio(float(s.sq_xhat), float(s.dot)),
        dead_fraction=float((density == 0).float().mean()),
        dense_fraction=float((density > DENSE_FRACTION).float().mean()),
        per_source_fvu=tuple(_ratio(float(e), float(v)) for e, v in zip(s.sq_err, var_s)),
        density_histogram=density_histogram(density),
        kind=model.kind,
        k=model.k,
        n_latents=n_latents or model.n_latents,
        density=tuple(density.tolist()),
        per_layer_l0=tuple(layers.sum(1).tolist()),
        per_layer_dead=tuple((layers == 0).float().mean(1).tolist()),
        l1=float(s.l1) / s.n,
    )


@torch.no_grad()
def evaluate(model: SparseCoder | LazyDictionary, batches: Iterable[Tensor], max_rows: int | None = None,
             comm: Comm = LOCAL) -> EvalResult:
    """Metrics of ``model`` (raw activation units) on batches [B, D] or [B, S, D], up to ``max_rows`` rows; a
    transcoder's batches are (input, output) pairs [B, 2, D] and its metrics are against the output.

    ``comm``: with latent shards (``comm.shards``, saes.comm), ``model`` is this shard's latents and every shard
    passes the same batches: each codes its latents (:meth:`SparseCoder.codes`), the reconstruction is the sum of
    the shards' parts, and the per-latent counts are joined, so every shard gets the whole dictionary's result
    without any of them holding it. A :class:`~saes.lazy.LazyDictionary` (a dictionary read a block of latents at a
    time) is measured block by block the same way, in one process; split over ranks (``open_lazy(comm=)``, its own
    seam: ``comm`` stays LOCAL) each rank counts its latents' firings and the counts are summed over the ranks."""
    shards = comm.shards
    lazy = isinstance(model, LazyDictionary)
    if lazy and shards.size > 1:
        raise ValueError("evaluate(): a LazyDictionary is split over ranks by its own seam (open_lazy(DIR, comm=...)); "
                         "leave comm at its default")
    device = model.device
    s = _Sums(model.n_sources, model.d_in, model.n_latents, device)
    for x in batches:
        xf, target = model.split(model.flatten_batch(x.to(device=device, dtype=model.dtype)))
        if max_rows is not None:
            xf, target = xf[: max_rows - s.n], target[: max_rows - s.n]
        if xf.shape[0] == 0:
            break
        if lazy:
            s.add_rows(target, model.codes_and_reconstruction(xf, s.add_codes))
        else:  # decoded sparsely: the kernels' sparse decode, not one more [B, L] @ [L, S*D] matmul
            code = packed_code(model.codes(xf, comm))
            s.add_rows(target, model.reconstruct(xf, code, comm))
            s.add_packed(*code)
        if max_rows is not None and s.n >= max_rows:
            break
    if s.n == 0:
        raise ValueError("evaluate() got no rows: pass at least one non-empty batch")
    if lazy and model.comm.shards.size > 1:  # each rank counted its latents' firings (the others' are 0): summed
        s.l0, s.l1, s.fires = (model.comm.shards.all_sum(t) for t in (s.l0, s.l1, s.fires))
    if shards.size > 1:  # each shard counted its latents' firings: the L0 is their sum, the densities joined
        s.l0 = shards.all_sum(s.l0)
        s.l1 = shards.all_sum(s.l1)
        s.fires = interleave(shards.gather_rows(s.fires), shards.size, latent_groups(model, "b_enc"))
    return _result(model, s, model.n_latents * shards.size)


def combine_layers(results: list[EvalResult], kind: str) -> EvalResult:
    """One result for a set of per-layer transcoders measured layer by layer (a replacement model's): FVU, MSE and
    dead / dense fractions over every layer's outputs and latents together, L0 the sum of the layers' (the latents a
    token uses in the whole model), per-layer FVU / L0 / dead; cos_sim, l2_ratio, rel_recon_bias and the SAEBench
    explained variance are means over the layers."""
    n = min(r.n_tokens for r in results)
    err = [r.mse * r.n_tokens for r in results]  # sum ||y - y_hat||^2 / D per layer (every layer has the same D)
    var = [e / r.fvu if r.fvu else 0.0 for e, r in zip(err, results)]
    lat = [r.n_latents for r in results]
    mean = lambda key: sum(getattr(r, key) for r in results) / len(results)  # noqa: E731
    fvu = _ratio(sum(err), sum(var))
    return EvalResult(
        n_tokens=n, l0=sum(r.l0 for r in results), mse=sum(r.mse for r in results) / len(results), fvu=fvu,
        explained_variance=1.0 - fvu, explained_variance_saebench=mean("explained_variance_saebench"),
        cos_sim=mean("cos_sim"), l2_ratio=mean("l2_ratio"), rel_recon_bias=mean("rel_recon_bias"),
        dead_fraction=sum(r.dead_fraction * m for r, m in zip(results, lat)) / sum(lat),
        dense_fraction=sum(r.dense_fraction * m for r, m in zip(results, lat)) / sum(lat),
        per_source_fvu=tuple(r.fvu for r in results),
        density_histogram=tuple(map(sum, zip(*(r.density_histogram for r in results)))),
        kind=kind, k=sum(r.k for r in results), n_latents=sum(lat),
        density=tuple(d for r in results for d in r.density),
        per_layer_l0=tuple(r.l0 for r in results), per_layer_dead=tuple(r.dead_fraction for r in results),
        l1=None if any(r.l1 is None for r in results) else sum(r.l1 for r in results))


def ce_loss_recovered(ce_clean: float, ce_zero: float, ce_sae: float) -> float:
    """(CE_zero - CE_sae) / (CE_zero - CE_clean): 1 = the SAE loses nothing, 0 = as bad as zero-ablation."""
    return _ratio(ce_zero - ce_sae, ce_zero - ce_clean)


def kl_score(kl_zero: float, kl_sae: float) -> float:
    """(KL_zero - KL_sae) / KL_zero, KL measured against the clean model's next-token distribution."""
    return _ratio(kl_zero - kl_sae, kl_zero)


def with_splice_scores(result: EvalResult, ce_clean: float, ce_zero: float, ce_replaced: float,
                       kl_zero: float, kl_replaced: float, **more: float) -> EvalResult:
    """``result`` with CE-loss-recovered and KL score filled from spliced losses (a SpliceLosses' numbers; ``more``:
    further raw numbers kept in ``splice``, e.g. a replacement model's error-kept losses)."""
    import dataclasses

    raw = {"ce_clean": ce_clean, "ce_zero": ce_zero, "ce_replaced": ce_replaced,
           "kl_zero": kl_zero, "kl_replaced": kl_replaced, **more}
    return dataclasses.replace(result, ce_loss_recovered=ce_loss_recovered(ce_clean, ce_zero, ce_replaced),
                               kl_score=kl_score(kl_zero, kl_replaced), splice=raw)


TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("n_tokens", "rows evaluated"),
    ("l0", "L0 (inference)"),
    ("k", "k"),
    ("mse", "MSE per element"),
    ("fvu", "FVU (textbook)"),
    ("explained_variance", "explained variance (1 - FVU)"),
    ("explained_variance_saebench", "explained variance (SAEBench formula)"),
    ("cos_sim", "cos(x, x_hat)"),
    ("l2_ratio", "||x_hat|| / ||x||"),
    ("rel_recon_bias", "relative reconstruction bias"),
    ("dead_fraction", "dead latents (fraction)"),
    ("dense_fraction", "dense latents (> 10% of rows)"),
    ("ce_loss_recovered", "CE loss recovered"),
    ("kl_score", "KL score"),
)


def format_table(result: EvalResult) -> str:
    """A two-column text table of the headline metrics (per-source FVU added for crosscoders)."""
    rows = []
    for key, label in TABLE_ROWS:
        value = getattr(result, key)
        if value is None:
            continue
        rows.append((label, f"{value:.6g}" if isinstance(value, float) else str(value)))
    if result.per_layer_l0:  # a cross-layer transcoder: its sources are layers
        rows += [(f"layer {i}", f"FVU {v:.6g} | L0 {l0:.4g} | dead {d:.4g}") for i, (v, l0, d) in
                 enumerate(zip(result.per_source_fvu, result.per_layer_l0, result.per_layer_dead))]
    elif len(result.per_source_fvu) > 1:
        rows += [(f"FVU source {i}", f"{v:.6g}") for i, v in enumerate(result.per_source_fvu)]
    if (result.splice or {}).get("max_logit_diff_with_errors") is not None:
        sp = result.splice
        rows.append(("replacement with error nodes", f"CE {sp['ce_with_errors']:.6g} (clean {sp['ce_clean']:.6g}), "
                     f"KL {sp['kl_with_errors']:.3g}, max |logit - clean| {sp['max_logit_diff_with_errors']:.3g}"))
    rows.append(("density histogram", " ".join(map(str, result.density_histogram))))
    width = max(len(label) for label, _ in rows)
    note = ce_recovered_caveat(result)
    return "\n".join([*(f"{label:<{width}}  {value}" for label, value in rows), *([f"note: {note}"] if note else [])])


CE_GAP_MIN = 0.1
"""Nats: when zero-ablating the hookpoint moves the LM's loss by less, CE loss recovered divides by almost nothing."""


def ce_recovered_caveat(result: EvalResult) -> str | None:
    """Why ``result``'s CE loss recovered should not be read (None when it can): zero-ablation barely changes the
    loss (|CE_zero - CE_clean| < :data:`CE_GAP_MIN`), or the ratio leaves [0, 1]."""
    r, s = result.ce_loss_recovered, result.splice or {}
    if r is None or "ce_zero" not in s:
        return None
    gap = s["ce_zero"] - s["ce_clean"]
    if abs(gap) >= CE_GAP_MIN and 0 <= r <= 1:
        return None
    if abs(gap) < CE_GAP_MIN:
        why = f"zero-ablating the hookpoint changes the LM's loss by only {gap:+.3g} nats, so the ratio divides by " \
              f"almost nothing"
    elif r > 1:
        why = "the spliced model's loss is below the clean model's"
    else:
        why = "the spliced model's loss is above the zero-ablated model's"
    kl = f" ({result.kl_score:.3g})" if result.kl_score is not None else ""
    return (f"CE loss recovered {r:.3g} is ill-conditioned here: {why} (CE clean {s['ce_clean']:.4g}, zero-ablated "
            f"{s['ce_zero']:.4g}, spliced {s['ce_replaced']:.4g}); read the KL score{kl}")


def threshold_line(summary: dict, k: int) -> str | None:
    """How a thresholded dictionary's inference threshold was set (``training.threshold`` in config.json)."""
    info = (summary or {}).get("threshold")
    if not info:
        return None
    if info["rule"].startswith("learned per latent"):
        how = (f"scaled by one factor {info['factor']:.4g} for mean L0 = k = {k} on {info['calibrated_on_rows']} rows "
               "never trained on" if info.get("calibrated_on_rows") else "as trained (not calibrated)")
        return f"inference thresholds learned per latent (mean {info['mean']:.6g}), {how}"
    if info.get("calibrated_on_rows"):
        return (f"inference threshold {info['value']:.6g}: calibrated for mean L0 = k = {k} on "
                f"{info['calibrated_on_rows']} rows never trained on (running estimate {info['running_estimate']:.6g})")
    return f"inference threshold {info['value']:.6g}: running estimate from training batches (not calibrated)"


def describe_dictionary(model) -> list[str]:
    """Lines for people: what was trained and its held-out evaluation table."""
    summary = model.training_summary or {}
    latents = (summary.get("config") or {}).get("latents") or model.n_latents  # the whole dictionary's, on a shard too
    lines = [f"trained {model.kind} dictionary: D={model.d_in}, L={latents}, k={model.k}, "
             f"sources={model.n_sources}, {summary.get('steps')} steps, {summary.get('rows')} rows"]
    held = summary.get("heldout_eval")
    if held:
        lines += ["held-out evaluation:", format_table(EvalResult(**held))]
    line = threshold_line(summary, model.k)
    return lines + ([line] if line else [])
