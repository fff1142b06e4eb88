"""``conceptdict diff``: train a crosscoder on two models' activations over the same tokens and report which
latents belong to one model only (decoder-norm Delta, Latent Scaling flags).

    conceptdict diff --model A --model B --hookpoint H [--dataset D] [train flags] --out DIFF_DIR
    conceptdict diff --store A --store B [--hookpoint H] [train flags] --out DIFF_DIR

DIFF_DIR holds ``stores/A``, ``stores/B`` (when models are given), ``crosscoder/`` (the dictionary artifact),
``diff.json`` (summary + one record per latent), ``latents.csv``, ``report.html`` and ``diff_config.json``.
Latent Scaling (and its flags) concerns the B-only latents, as in Minder, Dumas et al.; swap the two models to
analyse the A-only ones the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from conceptdict.cli.args import (ConfigError, add_dataclass_args, build_config, to_jsonable, train_config_from_flags,
                                  train_flags, write_resolved_config)

HELP = "diff two models: crosscoder over both models' activations, per-latent Delta tags and Latent Scaling flags"
DIFF_FORMAT = "conceptdict-diff"
DIFF_VERSION = 1
TRAIN_SKIP = ("d_in",)

log = logging.getLogger(__name__)


@dataclass
class DiffConfig:
    """Flags of ``conceptdict diff`` besides the training flags (which are ``conceptdict train``'s)."""

    out: Path
    """Output directory (stores/, crosscoder/, diff.json, latents.csv, report.html)."""
    models: list[str] = field(default_factory=list, metadata={"flag": "model"})
    """Two models to cache and diff, A (reference, e.g. base) then B (e.g. fine-tune): hub names or directories."""
    stores: list[Path] = field(default_factory=list, metadata={"flag": "store"})
    """Instead of --model: two activation stores of A and B cached over the same tokens."""
    hookpoint: str | None = None
    """Hookpoint to diff (required with --model; with --store, default: the one hookpoint both stores hold, or
    each store's only hookpoint when their names differ)."""
    hookpoint_b: str | None = None
    """With --store: store B's name for the hookpoint when it differs from A's (--hookpoint names A's)."""
    dataset: str = "stdlib-docstrings"
    """With --model: dataset to cache (stdlib-docstrings, a local .txt/.jsonl/.csv/.parquet file, a hub name)."""
    text_column: str = "text"
    """With --model: column holding the text."""
    context_length: int = 128
    """With --model: tokens per context."""
    cache_tokens: int | None = 200_000
    """With --model: rows (tokens) to cache per model; None: the whole dataset."""
    cache_batch_size: int = 32
    """With --model: contexts per forward pass while caching."""
    cache_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """With --model: stored activation dtype."""
    scaling_tokens: int = 1_000_000
    """At most this many rows feed Latent Scaling (one pass, its own shuffle)."""
    b_only: float = 0.9
    """Tag B-only when Delta is above this."""
    a_only: float = 0.1
    """Tag A-only when Delta is below this."""
    shared_band: float = 0.1
    """Tag shared when |Delta - 0.5| is below this."""
    nu_eps_max: float = 0.2
    """Genuinely B-specific needs nu_eps = beta_eps_A / beta_eps_B below this (else: complete shrinkage)."""
    nu_r_max: float = 0.5
    """Genuinely B-specific needs nu_r = beta_r_A / beta_r_B below this (else: latent decoupling)."""
    overwrite: bool = False
    """Replace an existing diff (and cached stores of a different configuration) at --out."""

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

    def analysis(self):
        from conceptdict.saes.diffing import DiffAnalysisConfig

        return DiffAnalysisConfig(b_only=self.b_only, a_only=self.a_only, shared_band=self.shared_band,
                                  nu_eps_max=self.nu_eps_max, nu_r_max=self.nu_r_max)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, DiffConfig)
    group = parser.add_argument_group("training (as `conceptdict train`; default --kind crosscoder)")
    add_dataclass_args(group, train_flags(), skip=TRAIN_SKIP)


# --------------------------------------------------------------------------- inputs


def cache_both(cfg: DiffConfig, device: str) -> list[Path]:
    """Cache both models at the hookpoint over the same dataset and context length; returns the two stores."""
    from conceptdict.activations import CacheConfig, cache_activations
    from conceptdict.activations.tokens import check_same_tokenizer
    from conceptdict.saes.diffing import SOURCE_NAMES

    check_same_tokenizer(cfg.models)
    paths = []
    for name, model in zip(SOURCE_NAMES, cfg.models):
        cache_cfg = CacheConfig(model=model, hookpoints=[cfg.hookpoint], dataset=cfg.dataset,
                                out=cfg.out / "stores" / name, text_column=cfg.text_column,
                                context_length=cfg.context_length, tokens=cfg.cache_tokens, dtype=cfg.cache_dtype,
                                batch_size=cfg.cache_batch_size, device=device, overwrite=cfg.overwrite)
        paths.append(cache_activations(cache_cfg))
    return paths


def pick_hookpoint(stores, wanted: str | None) -> str:
    """The hookpoint to diff: ``wanted`` when both stores hold it, else the single one they share."""
    common = [h for h in stores[0].hookpoints if all(h in s.hookpoints for s in stores[1:])]
    if wanted is not None:
        if wanted not in common:
            raise ValueError(f"hookpoint {wanted!r} is not in both stores (common hookpoints: {common}); "
                             f"pick one of those with --hookpoint, or name store B's with --hookpoint-b "
                             f"(B has {stores[1].hookpoints})")
        return wanted
    if len(common) != 1:
        raise ValueError(f"the stores share hookpoints {common}; choose one with --hookpoint")
    return common[0]


def pair_hookpoints(stores, wanted: str | None, wanted_b: str | None):
    """(stores, A's hookpoint, B's hookpoint): store B read under A's hookpoint name when the two name it
    differently (given with --hookpoint-b, or each store's only hookpoint), else :func:`pick_hookpoint`."""
    from conceptdict.activations.views import RenamedHookpoint

    a, b = stores
    if wanted_b is None and wanted is None and len(a.hookpoints) == len(b.hookpoints) == 1 \
            and a.hookpoints != b.hookpoints:
        wanted, wanted_b = a.hookpoints[0], b.hookpoints[0]
        log.info("pairing hookpoint %r of %s with %r of %s", wanted, a.path, wanted_b, b.path)
    if wanted_b is None or wanted_b == wanted:
        hookpoint = pick_hookpoint(stores, wanted)
        return stores, hookpoint, hookpoint
    if wanted is None or wanted not in a.hookpoints:
        raise ValueError(f"--hookpoint-b needs --hookpoint naming store A's hookpoint; {a.path} has {a.hookpoints}")
    return [a, RenamedHookpoint(b, wanted_b, wanted)], wanted, wanted_b


# --------------------------------------------------------------------------- outputs


def write_outputs(out: Path, summary: dict, records: list[dict]) -> dict[str, Path]:
    """diff.json (summary + per-latent records), latents.csv, report.html."""
    from conceptdict.naming.diff_report import render_diff_report, write_csv

    paths = {"json": out / "diff.json", "csv": out / "latents.csv", "html": out / "report.html"}
    doc = {"format": DIFF_FORMAT, "format_version": DIFF_VERSION, **summary, "latents": records}
    paths["json"].write_text(json.dumps(to_jsonable(doc), indent=1, allow_nan=False) + "\n")
    write_csv(records, paths["csv"])
    paths["html"].write_text(render_diff_report(summary, records))
    return paths


# --------------------------------------------------------------------------- the command


def _diff_config(args: argparse.Namespace) -> DiffConfig:
    """DiffConfig from the flags; also defaults --kind to crosscoder and refuses non-crosscoder kinds."""
    from conceptdict.saes import KINDS, is_crosscoder

    try:
        cfg = build_config(DiffConfig, args)
    except TypeError as e:
        raise ConfigError(f"{e}; `conceptdict diff` needs --out and two --model (with --hookpoint) or two --store")
    if args.kind is None:
        args.kind = "crosscoder"
    if args.kind not in KINDS or not is_crosscoder(args.kind):
        raise ConfigError(f"--kind {args.kind} is not a crosscoder kind; use one of "
                          f"{[k for k in KINDS if is_crosscoder(k)]}")
    return cfg


def _train_config(args: argparse.Namespace, d_in: int):
    """TrainConfig from the flags; --latents defaults to 8 x D and --k to min(32, latents / 8, D / 8).

    Why D / 8: the former min(32, latents / 8) is min(32, D) at the default width, so a narrow model's code was
    as wide as half its input (k = 32 at D = 64) and the crosscoder split each atom over ~2.4 latents (median best
    cosine 0.76): on bench/cli_planted.py --diff (256 atoms in D = 64, ~6 per row, 400k rows) B-only recall was
    0.06 / 0.12 at k = 32 and 0.88 / 0.97 at k = 8 (775 steps, seeds 0 / 1), and on bench/crosscoder_diff.py 0.31 /
    0.28 at k = 32 and 1.00 / 1.00 at k = 8 (docs/batchtopk.md, "Crosscoders through conceptdict diff"). Models of
    width 256 and more keep k = 32."""
    if args.latents is None:
        args.latents = 8 * d_in
    if args.k is None:
        args.k = max(1, min(32, args.latents // 8, d_in // 8))
    return train_config_from_flags(args)


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import ActivationStore, stream_batches
    from conceptdict.saes import evaluate, to_flat, train
    from conceptdict.saes.diffing import SOURCE_NAMES, diff_crosscoder
    from conceptdict.saes.config import fit_to_store, heldout_batch_count
    from conceptdict.saes.training import resolve_device

    cfg = _diff_config(args)
    if (cfg.out / "diff.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"{cfg.out} already holds a diff; pass --overwrite or choose another --out")
    cfg.out.mkdir(parents=True, exist_ok=True)
    device = str(resolve_device(args.device or "auto"))
    paths = cache_both(cfg, device) if cfg.models else list(cfg.stores)
    stores = [ActivationStore(p) for p in paths]
    stores, hookpoint, hookpoint_b = pair_hookpoints(stores, cfg.hookpoint, cfg.hookpoint_b)
    tcfg = fit_to_store(_train_config(args, stores[0].d_in(hookpoint)), min(s.num_rows for s in stores))
    write_resolved_config({"diff": dataclasses.replace(cfg, hookpoint=hookpoint), "train": to_flat(tcfg)}, cfg.out,
                          "diff_config.json")
    def batches(start: int):
        return stream_batches(stores, hookpoint, tcfg.batch_size, seed=tcfg.seed, epochs=None, start_batch=start,
                              holdout_batches=heldout_batch_count(tcfg))

    sources = dict(zip(SOURCE_NAMES, cfg.models or [str(p) for p in paths]))
    meta = {"stores": [str(p) for p in paths], "hookpoints": [hookpoint], "sources": sources,
            "store_hookpoints": [hookpoint, hookpoint_b]}
    model = train(tcfg, batches, out=cfg.out / "crosscoder",
                  meta=meta, source=f"stores {', '.join(str(p) for p in paths)}, hookpoint {hookpoint}")
    rows = min(cfg.scaling_tokens, stores[0].num_rows)
    scaling_batch = min(tcfg.batch_size, rows)

    def analysis_batches():
        return stream_batches(stores, hookpoint, scaling_batch, seed=tcfg.seed + 1, epochs=1)

    n_batches = max(1, rows // scaling_batch)
    table = diff_crosscoder(model, analysis_batches(), cfg.analysis(), max_batches=n_batches)
    ev = evaluate(model, itertools.islice(analysis_batches(), n_batches))
    summary = {"sources": sources, "stores": [str(p) for p in paths], "hookpoint": hookpoint, "kind": model.kind,
               "n_latents": model.n_latents, "k": model.k, "d_in": model.d_in,
               "thresholds": dataclasses.asdict(cfg.analysis()), "counts": table.counts(), "eval": ev.to_dict(),
               "heldout_eval": (model.training_summary or {}).get("heldout_eval")}
    written = write_outputs(cfg.out, summary, table.records())
    _print_summary(summary, table, written)
    return 0


def _print_summary(summary: dict, table, written: dict[str, Path]) -> None:
    from conceptdict.saes.diffing import TAGS

    c = summary["counts"]
    print(f"diffed A={summary['sources']['A']} vs B={summary['sources']['B']} at {summary['hookpoint']}: "
          f"{summary['n_latents']} latents ({summary['kind']}, k={summary['k']})")
    ev = summary["eval"]
    print(f"  fvu per source {', '.join(f'{v:.4f}' for v in ev['per_source_fvu'])} | l0 {ev['l0']:.2f} | "
          f"dead {100 * ev['dead_fraction']:.1f}% on {ev['n_tokens']} rows")
    print("  " + ", ".join(f"{tag} {c[tag]}" for tag in TAGS))
    if table.flags:
        print(f"  B-only latents: {c['model_specific']} model-specific, {c['complete_shrinkage']} complete shrinkage, "
              f"{c['latent_decoupling']} latent decoupling")
    for name, path in written.items():
        print(f"  {name:<5} {path}")
