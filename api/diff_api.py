"""Diff two models: a crosscoder over both models' activations on the same tokens, per-latent Delta tags and
Latent Scaling flags (Minder, Dumas et al. 2025)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Sequence

from typing_extensions import Unpack

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, heldout_recipe, stream_batches
from conceptdict.activations.tokens import check_same_tokenizer
from conceptdict.activations.views import pair_hookpoints
from conceptdict.naming.reports.diff_report import write_diff
from conceptdict.saes import SparseCoder, evaluate, is_crosscoder, to_flat, train, train_config
from conceptdict.saes.config import fit_to_store, heldout_batch_count, resolve_device
from conceptdict.saes.kinds import KINDS
from conceptdict.saes.diffing import (SOURCE_NAMES, TAGS, DiffAnalysisConfig, LatentDiff, crosscoder_size,
                                      diff_crosscoder)
from conceptdict.objects import StoreLike
from conceptdict.saes.flat import TrainingSettings
from conceptdict.settings import (ConfigError, coerce_settings, config_from_dict, home_of, split_settings,
                                  takes_settings, write_resolved_config)
from conceptdict.train_api import train_settings
from conceptdict.outdir import guarded


@dataclass
class DiffConfig:
    """Settings of ``conceptdict diff`` besides the training ones (which are ``conceptdict train``'s)."""

    out: Path = field(metadata={
        "help": "Output directory (stores/, crosscoder/, diff.json, latents.csv, report.html)."})
    models: list[str] = field(default_factory=list, metadata={
        "flag": "model", "help": "Two models to cache and diff: A (reference, e.g. base), then B (e.g. fine-tune)."})
    stores: list[Path] = field(default_factory=list, metadata={
        "flag": "store", "help": "Instead of --model: two activation stores of A and B cached over the same tokens."})
    hookpoint: str | None = field(default=None, metadata={
        "help": "Hookpoint to diff (required with --model; with --store: the one both stores hold)."})
    hookpoint_b: str | None = field(default=None, metadata={
        "help": "With --store: store B's name for the hookpoint when it differs from A's."})
    dataset: str = field(default="stdlib-docstrings", metadata={"help": "With --model: the dataset to cache."})
    text_column: str = field(default="text", metadata={"help": "With --model: the column holding the text."})
    context_length: int = field(default=128, metadata={"help": "With --model: tokens per context."})
    cache_tokens: int | None = field(default=200_000, metadata={
        "help": "With --model: rows (tokens) to cache per model; None: the whole dataset."})
    cache_batch_size: int = field(default=32, metadata={"help": "With --model: contexts per forward while caching."})
    cache_dtype: Literal["float32", "float16", "bfloat16"] = field(default="float32", metadata={
        "help": "With --model: stored activation dtype."})
    scaling_tokens: int = field(default=1_000_000, metadata={
        "help": "At most this many rows feed Latent Scaling (one pass, its own shuffle)."})
    b_only: float = field(default=0.9, metadata={"help": "Tag B-only when Delta is above this."})
    a_only: float = field(default=0.1, metadata={"help": "Tag A-only when Delta is below this."})
    shared_band: float = field(default=0.1, metadata={"help": "Tag shared when |Delta - 0.5| is below this."})
    nu_eps_max: float = field(default=0.2, metadata={
        "help": "Genuinely B-specific needs nu_eps below this (else: complete shrinkage)."})
    nu_r_max: float = field(default=0.5, metadata={
        "help": "Genuinely B-specific needs nu_r below this (else: latent decoupling)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an existing diff (and its cached stores)."})

    def __post_init__(self) -> None:
        if bool(self.models) == bool(self.stores):
            raise ValueError(f"give either two --model or two --store (got models={self.models}, stores="
                             f"{[str(s) for s in self.stores]})")
        given = self.models or self.stores
        if len(given) != 2:
            raise ValueError(f"conceptdict diff compares exactly two models; got {len(given)}: "
                             f"{[str(g) for g in given]}")
        if self.models and not self.hookpoint:
            raise ValueError("--model needs --hookpoint (e.g. blocks.6.hook_resid_post) to cache both models at")
        for name in ("context_length", "cache_batch_size", "scaling_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

    def analysis(self) -> DiffAnalysisConfig:
        return DiffAnalysisConfig(b_only=self.b_only, a_only=self.a_only, shared_band=self.shared_band,
                                  nu_eps_max=self.nu_eps_max, nu_r_max=self.nu_r_max)


CHANGED_SHOWN = 20
"""Latents listed as "changed" (largest relative decoder change) in diff.json, report.html and the printout (5)."""


class DiffResult(NamedTuple):
    """A diff: the crosscoder, the per-latent table, the summary written to diff.json and the files."""

    crosscoder: SparseCoder
    table: LatentDiff
    summary: dict[str, Any]
    paths: dict[str, Path]

    @property
    def counts(self) -> dict[str, int]:
        return self.summary["counts"]

    @property
    def records(self) -> list[dict]:
        return self.table.records()

    def format(self) -> str:
        s, c, ev = self.summary, self.summary["counts"], self.summary["eval"]
        lines = [f"diffed A={s['sources']['A']} vs B={s['sources']['B']} at {s['hookpoint']}: "
                 f"{s['n_latents']} latents ({s['kind']}, k={s['k']})",
                 f"  fvu per source {', '.join(f'{v:.4f}' for v in ev['per_source_fvu'])} | l0 {ev['l0']:.2f} | "
                 f"dead {100 * ev['dead_fraction']:.1f}% on {ev['n_tokens']} rows",
                 "  " + ", ".join(f"{tag} {c[tag]}" for tag in TAGS)]
        if self.table.flags:
            lines.append(f"  B-only latents: {c['model_specific']} model-specific, {c['complete_shrinkage']} complete "
                         f"shrinkage, {c['latent_decoupling']} latent decoupling")
        changed = self.summary.get("changed") or []
        if changed:
            lines.append("  most changed decoders (|d_B - d_A| / max(|d_A|, |d_B|)): " + ", ".join(
                f"latent {r['latent']} {r['change']:.2f} ({r['tag']})" for r in changed[:5]))
        return "\n".join(lines + [f"  {name:<5} {path}" for name, path in self.paths.items()])

    def to_dict(self) -> dict[str, Any]:
        """diff.json's summary (sources, counts per tag, the crosscoder's evaluation, the most changed latents) as
        plain JSON types, with the paths written; the per-latent table is :meth:`to_pandas`."""
        from conceptdict.saes.tables import plain

        return plain({**self.summary, "paths": self.paths})

    def to_pandas(self) -> Any:
        """A DataFrame with one row per latent of the crosscoder: latent, tag, norm_a, norm_b, delta, cosine, change,
        and with Latent Scaling its nu / fires columns and flags (``records``)."""
        from conceptdict.saes.tables import frame

        return frame(self.records, ["latent", "tag", "norm_a", "norm_b", "delta", "cosine"])


class DiffKeywords(TrainingSettings, total=False):
    """:func:`diff`'s keywords: :class:`DiffConfig`'s settings and the training settings (``cd.train``'s)."""

    out: str | Path
    model: str | Sequence[str] | None
    store: StoreLike | Sequence[StoreLike] | None
    hookpoint: str | None
    hookpoint_b: str | None
    dataset: str
    text_column: str
    context_length: int
    cache_tokens: int | None
    cache_batch_size: int
    cache_dtype: str
    scaling_tokens: int
    b_only: float
    a_only: float
    shared_band: float
    nu_eps_max: float
    nu_r_max: float
    overwrite: bool


@guarded("diff", own_overwrite=True)
@takes_settings(DiffConfig, train_settings())
def diff(**settings: Unpack[DiffKeywords]) -> DiffResult:
    """Diff two models (``conceptdict diff``): ``model=[A, B]`` with ``hookpoint=`` (both cached over ``dataset``), or
    ``store=[A, B]``; ``out=`` is required. Any training setting (``latents``, ``k``, ``kind``, ``tokens`` ...) is
    ``conceptdict train``'s; ``kind`` defaults to crosscoder, ``latents`` to 8 x D and ``k`` to min(32, L/8, D/8)."""
    cfg, train_settings = diff_configs(**settings)
    if (cfg.out / "diff.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"{cfg.out} already holds a diff; pass --overwrite or choose another --out")
    cfg.out.mkdir(parents=True, exist_ok=True)
    device = str(resolve_device(train_settings.get("device") or "auto"))
    paths = cache_both(cfg, device) if cfg.models else list(cfg.stores)
    stores, hookpoint, hookpoint_b = pair_hookpoints([ActivationStore(p) for p in paths], cfg.hookpoint,
                                                     cfg.hookpoint_b)
    latents, k = crosscoder_size(stores[0].d_in(hookpoint), train_settings.get("latents"), train_settings.get("k"))
    tcfg = train_config(**{**train_settings, "latents": latents, "k": k})
    tcfg = fit_to_store(tcfg, min(s.num_rows for s in stores))
    write_resolved_config({"diff": dataclasses.replace(cfg, hookpoint=hookpoint), "train": to_flat(tcfg)}, cfg.out,
                          "diff_config.json")

    def batches(start: int):
        return stream_batches(stores, hookpoint, tcfg.batch_size, seed=tcfg.seed, epochs=None, start_batch=start,
                              holdout_batches=heldout_batch_count(tcfg))

    sources = dict(zip(SOURCE_NAMES, cfg.models or [str(p) for p in paths]))
    meta = {"stores": [str(p) for p in paths], "hookpoints": [hookpoint], "sources": sources,
            "store_hookpoints": [hookpoint, hookpoint_b],
            "heldout": heldout_recipe(stores, [hookpoint], tcfg.batch_size, tcfg.seed, heldout_batch_count(tcfg),
                                      65536)}
    model = train(tcfg, batches, out=cfg.out / "crosscoder", meta=meta,
                  source=f"stores {', '.join(str(p) for p in paths)}, hookpoint {hookpoint}")
    rows = min(cfg.scaling_tokens, stores[0].num_rows)
    scaling_batch = min(tcfg.batch_size, rows)
    n_batches = max(1, rows // scaling_batch)

    def analysis_batches():
        return stream_batches(stores, hookpoint, scaling_batch, seed=tcfg.seed + 1, epochs=1)

    table = diff_crosscoder(model, analysis_batches(), cfg.analysis(), max_batches=n_batches)
    ev = evaluate(model, itertools.islice(analysis_batches(), n_batches))
    summary = {"sources": sources, "stores": [str(p) for p in paths], "hookpoint": hookpoint, "kind": model.kind,
               "n_latents": model.n_latents, "k": model.k, "d_in": model.d_in,
               "thresholds": dataclasses.asdict(cfg.analysis()), "counts": table.counts(), "eval": ev.to_dict(),
               "changed": table.changed(CHANGED_SHOWN),
               "heldout_eval": (model.training_summary or {}).get("heldout_eval")}
    return DiffResult(model, table, summary, write_diff(cfg.out, summary, table.records()))


def diff_configs(**settings: Any) -> tuple[DiffConfig, dict[str, Any]]:
    """(DiffConfig, the training settings) from keyword settings; the kind defaults to crosscoder."""
    if "store" in settings and settings["store"] is not None:
        stores = settings["store"]
        settings["store"] = [home_of(s, "store") for s in (stores if isinstance(stores, (list, tuple)) else [stores])]
    if settings.get("d_in") is not None:
        raise ConfigError("diff takes D from the stores; drop d_in")
    own, training = split_settings({k: v for k, v in settings.items() if v is not None}, DiffConfig,
                                   train_settings(), where="diff")
    cfg = config_from_dict(DiffConfig, own, "diff")
    training = {k: v for k, v in coerce_settings(train_settings(), training, "diff").items() if v is not None}
    training.setdefault("kind", "crosscoder")
    if not is_crosscoder(training["kind"]):
        crosscoders = [k for k in KINDS if is_crosscoder(k)]
        raise ConfigError(f"--kind {training['kind']} is not a crosscoder kind; use one of {crosscoders}")
    return cfg, training


def cache_both(cfg: DiffConfig, device: str) -> list[Path]:
    """Cache both models at the hookpoint over the same dataset and context length; returns the two stores."""
    check_same_tokenizer(cfg.models)
    paths = []
    for name, model in zip(SOURCE_NAMES, cfg.models):
        cache_cfg = CacheConfig(model=model, hookpoints=[cfg.hookpoint], dataset=cfg.dataset,
                                out=cfg.out / "stores" / name, text_column=cfg.text_column,
                                context_length=cfg.context_length, tokens=cfg.cache_tokens, dtype=cfg.cache_dtype,
                                batch_size=cfg.cache_batch_size, device=device, overwrite=cfg.overwrite)
        paths.append(cache_activations(cache_cfg))
    return paths
