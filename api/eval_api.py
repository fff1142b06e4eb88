"""Measure dictionaries: one on a store (``evaluate``), several side by side on the same rows (``compare``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Sequence

import torch

from conceptdict.activations.store import ActivationStore
from conceptdict.naming import dictionary_of
from conceptdict.naming.llm import LlmConfig
from conceptdict.saes import EvalResult, SparseCoder, load_dictionary_config
from conceptdict.saes import evaluate as evaluate_rows
from conceptdict.saes import format_table, threshold_line
from conceptdict.saes.evaluation import combine_layers
from conceptdict.saes.formats import transcoder_set
from conceptdict.saes.comm import is_main
from conceptdict.saes.lazy import LazyDictionary
from conceptdict.saes.lazy_compare import tag_counts
from conceptdict.settings import ConfigError, config_from_dict, given, home_of, takes_settings, to_jsonable
from conceptdict.objects import DictionaryLike, StoreLike
from conceptdict.outdir import guarded
from conceptdict import eval_ranks
from conceptdict.eval_splice import (lm_contexts, replacement_scores, set_splice_scores, splice_model,  # noqa: F401
                                     splice_scores, spliceable)
from conceptdict.naming.yardsticks import (NAMES, Inputs, MetricResults, check_named, measure, parse_metrics,
                                            write_saebench)
from conceptdict.naming.sources import Run, open_run, reads_several, rows_of, training_heldout
from conceptdict.eval_tables import (comparison_to_dict, comparison_to_pandas, evaluation_to_dict,
                                     evaluation_to_pandas, side_by_side)

if TYPE_CHECKING:
    import pandas


@dataclass
class EvalConfig:
    """Settings of ``conceptdict eval``."""

    store: Path | None = field(default=None, metadata={
        "help": "Store to evaluate on; default: the store recorded in the dictionary's config.json (a crosscoder "
                "over two stores: model A's)."})
    store_b: Path | None = field(default=None, metadata={
        "help": "A crosscoder over two stores (`conceptdict diff`'s): model B's store; default: the recorded one."})
    hookpoint: str | None = field(default=None, metadata={
        "help": "Hookpoint; default: the one the dictionary was trained on."})
    model: str | None = field(default=None, metadata={
        "help": "Language model for CE loss recovered and KL score; default: the store's model if it is a causal LM. "
                "A dictionary trained from a model (`train --model`, no store): the model run for its rows; "
                "default: the recorded one."})
    dataset: str | None = field(default=None, metadata={
        "help": "A dictionary trained from a model (`train --model`, no store): the dataset the model runs over "
                "(default: the recorded one). Over its training dataset it reads the batches training held out; "
                "over another, that dataset's first rows."})
    rows: int = field(default=65536, metadata={"help": "Evaluate on at most this many store rows."})
    rows_from: str = field(default="heldout", metadata={
        "help": "heldout: the batches training held out (else the first rows, with a warning); start: the first "
                "rows of the store."})
    batch_size: int = field(default=4096, metadata={"help": "Rows per evaluation batch."})
    contexts: int = field(default=32, metadata={
        "help": "Contexts rebuilt from the store's tokens for the spliced CE/KL evaluation; 0 skips it."})
    device: str = field(default="cpu", metadata={"help": "Device for the dictionary and the model."})
    out: Path | None = field(default=None, metadata={"help": "Where to write eval.json; default: DICT/eval.json."})
    metrics: list[str] = field(default_factory=list, metadata={
        "help": "The field's yardsticks to add, comma-separated or repeated: " + ", ".join(NAMES) + ", or all (the "
                "ones whose inputs are present; the others named with why). Default: eval's own table only."})
    format: Literal["conceptdict", "saebench"] = field(default="conceptdict", metadata={
        "help": "saebench: also one JSON per --metrics metric in SAEBench's layout, under saebench/ beside "
                "eval.json."})
    llm: LlmConfig = field(default_factory=LlmConfig, metadata={
        "help": "autointerp: the explainer and scorer's OpenAI-compatible server (--llm.url ...; answers cached in "
                "autointerp_cache.jsonl beside eval.json)."})
    autointerp_scorer: Literal["auto", "llm", "embedding"] = field(default="auto", metadata={
        "help": "autointerp: llm (the server at --llm.url), embedding (the context namer and the sentence encoder, "
                "no server; not SAEBench's numbers), auto (llm when a server answers, else embedding, said so)."})
    autointerp_latents: int = field(default=100, metadata={
        "help": "autointerp: latents explained and scored, drawn at random among the live ones (SAEBench: 1000)."})

    def __post_init__(self) -> None:
        self.metrics = [n.strip() for item in ([self.metrics] if isinstance(self.metrics, str) else self.metrics)
                        for n in str(item).split(",") if n.strip()]
        parse_metrics(self.metrics)  # an unknown name is refused here, naming the known ones
        if self.format == "saebench" and not self.metrics:
            raise ValueError("format='saebench' writes one file per metric: pass --metrics core,... (or all)")
        if isinstance(self.llm, dict):
            self.llm = LlmConfig(**self.llm)
        if self.autointerp_latents < 1:
            raise ValueError(f"autointerp_latents={self.autointerp_latents} must be at least 1")
        if self.rows_from not in ("heldout", "start"):
            raise ValueError(f"rows_from={self.rows_from!r}: choose heldout or start")
        for name in ("rows", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.contexts < 0:
            raise ValueError(f"contexts={self.contexts} must be >= 0 (0 skips the spliced evaluation)")


class Evaluation(NamedTuple):
    """A dictionary measured on store rows (what ``conceptdict eval`` prints and writes to eval.json)."""

    metrics: EvalResult
    dictionary: SparseCoder
    store: Path | list[Path]
    """The store read (a crosscoder: its stores, one per model)."""
    hookpoints: list[str]
    rows_from: str
    path: Path | None
    latent_tags: dict[str, int] | None = None
    """A two-source crosscoder's live latents per diff tag (shared, A-only, B-only, other); they add up to the live
    latents. None for other dictionaries."""
    yardsticks: MetricResults | None = None
    """The ``metrics`` asked for (``naming.yardsticks``): results, and the ones skipped with why; None when none."""

    def format(self, source: str | Path = "") -> str:
        where = ", ".join(str(p) for p in self.store) if isinstance(self.store, list) else self.store
        lines = [f"{self.metrics.kind or self.dictionary.kind} dictionary {source} on {where} [{' -> '.join(self.hookpoints)}], "
                 f"{self.metrics.n_tokens} rows ({self.rows_from}):", format_table(self.metrics)]
        if self.latent_tags is not None:
            lines.append(tags_line(self.latent_tags))
        line = threshold_line(getattr(self.dictionary, "training_summary", None) or {}, self.dictionary.k)
        more = [self.yardsticks.format()] if self.yardsticks is not None else []
        return "\n".join(lines + ([line] if line else []) + more)

    def to_dict(self, flat: bool = False) -> dict[str, Any]:
        """As plain JSON types (``eval_tables.evaluation_to_dict``); ``flat``: each metric a key of its own."""
        return evaluation_to_dict(self, flat)

    def to_pandas(self) -> pandas.DataFrame:
        """One row, this dictionary, every metric a column (``eval_tables.evaluation_to_pandas``)."""
        return evaluation_to_pandas(self)


def tags_line(tags: dict[str, int]) -> str:
    """One line of a crosscoder's live latents per tag (source 0 = A, source 1 = B)."""
    return (f"live latents by decoder norms ({sum(tags.values())}): shared {tags['shared']}, only source 0 (A-only) "
            f"{tags['A-only']}, only source 1 (B-only) {tags['B-only']}, other {tags['other']}")


@takes_settings(EvalConfig)
def evaluate(dictionary: DictionaryLike, *, store: StoreLike | None = None, store_b: StoreLike | None = None,
             hookpoint: str | None = None, model: str | None = None, dataset: str | None = None, rows: int = 65536,
             rows_from: str = "heldout", batch_size: int = 4096, contexts: int = 32, device: str = "cpu",
             out: str | Path | None = None, metrics: str | Sequence[str] | None = None,
             format: Literal["conceptdict", "saebench"] = "conceptdict", llm: LlmConfig | None = None,
             autointerp_scorer: Literal["auto", "llm", "embedding"] = "auto",
             autointerp_latents: int = 100) -> Evaluation:
    """Evaluate a dictionary (a folder, hub name or SparseCoder) on a store (``conceptdict eval``): L0, FVU,
    explained variance, cosine, dead and dense latents, and for a causal LM's token store CE loss recovered and the
    KL score. Rows: the batches training held out by default. Writes ``eval.json`` (``out``, default
    DICT/eval.json; a dictionary without a folder writes only where ``out`` says). ``metrics``: the field's
    yardsticks as well (``naming.yardsticks.NAMES``, or all), in ``.yardsticks``;
    ``format="saebench"`` writes each one's SAEBench JSON under saebench/ beside eval.json. Under torchrun each rank
    reads only its range of the latents and rank 0 writes (``eval_ranks``; the others' ``path`` is None)."""
    cfg = config_from_dict(EvalConfig, given(locals(), "dictionary"), "evaluate")
    layers = [] if isinstance(dictionary, SparseCoder) else transcoder_set(dictionary)
    comm = eval_ranks.job()  # under torchrun: every rank a latent shard, refusals first
    if comm is not None:
        eval_ranks.refuse(dictionary, layers, cfg.metrics, comm)
    if layers:  # per-layer transcoders (`train --layers`): each on its rows, then all MLPs replaced at once
        runs = [run_of(d, cfg) for d in layers]
        parts = [evaluate_rows(r.dictionary, rows_of(r, cfg.rows, cfg.batch_size, cfg.rows_from)[0]) for r in runs]
        run = runs[0]
        hookpoints = [r.hookpoints[0] for r in runs] + [r.hookpoints[1] for r in runs]
        rows_from = rows_of(run, cfg.rows, cfg.batch_size, cfg.rows_from)[1]
        result = set_splice_scores(combine_layers(parts, f"{run.dictionary.kind} x {len(layers)} layers"),
                                   [r.dictionary for r in runs], run.source, hookpoints, cfg)
        home = Path(dictionary)
    else:
        run = run_of(dictionary, cfg, lazy=None if comm is None else True)  # lazily if it does not fit
        if comm is not None:  # this rank's range of latents alone
            eval_ranks.refuse_run(run, spliceable(run.dictionary) and splice_model(run.source, cfg) is not None)
            run.dictionary.over(comm)
        if cfg.metrics and isinstance(run.dictionary, LazyDictionary) and set(cfg.metrics) - {"core"}:
            raise ConfigError(f"--metrics {','.join(cfg.metrics)}: {run.where} is read a block of latents at a time "
                              f"(it does not fit in memory, or CONCEPTDICT_LAZY=1) and only core is measured so; the "
                              f"others need the whole dictionary: pass --metrics core, or CONCEPTDICT_LAZY=0 where it fits")
        if cfg.metrics and "all" not in cfg.metrics:  # a metric asked for by name and missing an input: say so first
            check_named(parse_metrics(cfg.metrics), run.dictionary,
                        run.source if isinstance(run.source, ActivationStore) else None)
        batches, rows_from = rows_of(run, cfg.rows, cfg.batch_size, cfg.rows_from)
        result = splice_scores(evaluate_rows(run.dictionary, batches), run.dictionary, run.source, run.hookpoints,
                               cfg)
        hookpoints, home = run.hookpoints, run.home
    sae = run.dictionary
    tags = tag_counts(sae, torch.tensor(result.density)) if sae.n_sources == 2 and \
        sae.spec.sources == "several" else None
    where = run.store_paths() if isinstance(run.source, list) else run.source.path
    if comm is not None and not is_main(comm):  # rank 0 writes
        return Evaluation(result, sae, where, hookpoints, rows_from, None, tags)
    if cfg.out is None and (home is None or str(home).startswith("hf:")):
        raise ConfigError(f"{run.where} has no folder of its own to write eval.json into; pass --out FILE (out= in "
                          f"Python)")
    out = cfg.out or Path(str(home)) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"sae_dir": str(home), "store": str(where) if not isinstance(where, list) else [str(p) for p in where],
              "hookpoint": " -> ".join(hookpoints), "latent_tags": tags,
              "hookpoints": hookpoints, "rows_from": rows_from, "config": to_jsonable(cfg),
              "metrics": result.to_dict(with_density=True),
              "threshold": (getattr(sae, "training_summary", None) or {}).get("threshold")}
    sticks = None
    if cfg.metrics:
        if layers:
            raise ConfigError(f"--metrics measures one dictionary; {dictionary} is a set of {len(layers)} per-layer "
                              f"transcoders: evaluate each layer's folder")
        options = {"autointerp": {"llm": cfg.llm, "scorer": cfg.autointerp_scorer, "latents": cfg.autointerp_latents,
                                  "cache": out.parent / "autointerp_cache.jsonl"}}
        sticks = measure(parse_metrics(cfg.metrics), Inputs(sae, result, run.source if isinstance(
            run.source, ActivationStore) else None, hookpoints[0], cfg.rows, device=cfg.device, options=options),
            strict="all" not in cfg.metrics)
        record["yardsticks"] = sticks.to_dict()
        if cfg.format == "saebench":
            record["saebench"] = [str(p) for p in write_saebench(sticks, out.parent / "saebench", sae, Path(
                str(home)).name if home else "dictionary", hookpoints[-1], record["config"])]
    out.write_text(json.dumps(record, indent=2) + "\n")
    return Evaluation(result, sae, where, hookpoints, rows_from, out, tags, sticks)


def run_of(dictionary: DictionaryLike, cfg: EvalConfig | CompareConfig, lazy: bool | None = False) -> Run:
    """``sources.open_run`` with an evaluation's settings; refuses a transcoder whose input is not recorded.
    ``lazy``: as ``open_run``'s (None: read a block of latents at a time where it does not fit in memory)."""
    run = open_run(dictionary, store=cfg.store, store_b=cfg.store_b, hookpoint=getattr(cfg, "hookpoint", None),
                   model=cfg.model, dataset=getattr(cfg, "dataset", None), device=cfg.device, lazy=lazy)
    if run.config.get("transcoder") and not run.dictionary.spec.transcodes:
        raise ConfigError(f"{run.where} is a transcoder whose input hookpoint is not recorded: its decoder predicts "
                          f"another hookpoint's output, so reconstruction metrics against its input would be wrong; "
                          f"name it or use it in a cbm")
    return run


# --------------------------------------------------------------------------- compare


@dataclass
class CompareConfig:
    """Settings of ``conceptdict compare``."""

    store: Path | None = field(default=None, metadata={
        "help": "Store whose rows every dictionary reads instead of its recorded one (the same model's activations; "
                "a crosscoder over two stores reads it as model A's); default: each dictionary its own recorded "
                "store, dictionaries trained on the same store on the same rows."})
    store_b: Path | None = field(default=None, metadata={
        "help": "Model B's store for crosscoders over two stores; default: each one's recorded store."})
    out: Path | None = field(default=None, metadata={"help": "Output directory: compare.json and index.html."})
    model: str | None = field(default=None, metadata={
        "help": "Causal language model for CE loss recovered / KL score (each dictionary spliced in)."})
    rows: int = field(default=16384, metadata={"help": "Compare on at most this many rows."})
    batch_size: int = field(default=4096, metadata={"help": "Rows per batch when reading the first rows."})
    contexts: int = field(default=32, metadata={"help": "Contexts for the spliced CE/KL evaluation; 0 skips it."})
    match_threshold: float = field(default=0.7, metadata={
        "help": "Decoder cosine at which latents of two dictionaries count as the same direction."})
    device: str = field(default="cpu", metadata={"help": "Device for the dictionaries and the model."})
    metrics: list[str] = field(default_factory=list, metadata={
        "help": "The field's yardsticks to put side by side as well (as `eval --metrics`: " + ", ".join(NAMES) +
                ", or all)."})

    def __post_init__(self) -> None:
        self.metrics = EvalConfig(metrics=self.metrics).metrics  # split at commas and checked as eval's


class Comparison(NamedTuple):
    """Dictionaries side by side (compare.json's content), where their rows came from, and the files written."""

    result: dict[str, Any]
    rows_from: str
    paths: dict[str, Path]

    def format(self) -> str:
        from conceptdict.naming.reports.compare import comparison_table

        stores = list(dict.fromkeys(", ".join(row.get("store") or []) for row in self.result["dictionaries"]))
        where = f"{self.result['n_rows']} rows of {stores[0]}" if len(stores) == 1 else "each one's own store"
        lines = [f"{len(self.result['dictionaries'])} dictionaries on {where} ({self.rows_from}):",
                 comparison_table(self.result)]
        for row in self.result["dictionaries"]:
            m = row["metrics"]
            if m.get("per_layer_l0"):  # a replacement model: a CLT, or a set of per-layer transcoders
                lines.append(f"{row['name']}: per layer " + "; ".join(
                    f"{l}: FVU {f:.4g}, L0 {z:.4g}, dead {d:.3g}"
                    for l, (f, z, d) in enumerate(zip(m["per_source_fvu"], m["per_layer_l0"], m["per_layer_dead"]))))
            elif len(m["per_source_fvu"]) > 1:
                lines.append(f"{row['name']}: FVU per source "
                             + ", ".join(f"{v:.4g}" for v in row["metrics"]["per_source_fvu"]))
            if row.get("latent_tags"):
                lines.append(f"{row['name']}: {tags_line(row['latent_tags'])}")
            if row.get("unique_names"):
                lines.append(f"names only {row['name']} found ({row['unique_names']['count']}): "
                             + ", ".join(row["unique_names"]["examples"][:10]))
        sticks = [row.get("yardsticks") for row in self.result["dictionaries"]]
        if any(sticks):
            lines.append(side_by_side([row["name"] for row in self.result["dictionaries"]],
                                      [MetricResults(**s) if s else MetricResults() for s in sticks]))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """compare.json's content as plain JSON types (``eval_tables.comparison_to_dict``)."""
        return comparison_to_dict(self)

    def to_pandas(self) -> pandas.DataFrame:
        """One row per dictionary (``eval_tables.comparison_to_pandas``)."""
        return comparison_to_pandas(self)


@guarded("compare")
@takes_settings(CompareConfig, extra=("overwrite",))
def compare(dictionaries: Sequence[DictionaryLike], *, store: StoreLike | None = None,
            store_b: StoreLike | None = None, out: str | Path | None = None, model: str | None = None,
            rows: int = 16384, batch_size: int = 4096, contexts: int = 32, match_threshold: float = 0.7,
            device: str = "cpu", overwrite: bool = False, metrics: str | Sequence[str] | None = None) -> Comparison:
    """Several dictionaries (or concept dictionaries, whose names then count) on the same rows (``conceptdict
    compare``): L0, FVU, CE/KL with ``model``, dead/dense, weight metrics, latents matched across dictionaries, the
    FVU-L0 frontier; ``metrics``: the field's yardsticks too, each dictionary's side by side (``eval``'s). Writes
    compare.json and index.html to ``out``."""
    settings = given(locals(), "dictionaries", "overwrite")  # first: before any local name
    from conceptdict.naming.reports.compare import write_comparison
    from conceptdict.saes.compare import Entry
    from conceptdict.saes.compare import compare as compare_entries

    cfg = config_from_dict(CompareConfig, settings, "compare")
    if cfg.out is None:
        raise ConfigError("conceptdict compare needs --out DIR")
    one = isinstance(dictionaries, (str, Path)) or not isinstance(dictionaries, Sequence)
    paths = [Path(home_of(p, "dictionaries")) for p in ([dictionaries] if one else dictionaries)]
    if len(paths) < 2:
        raise ConfigError(f"conceptdict compare puts dictionaries side by side; got {len(paths)} "
                          f"({', '.join(map(str, paths)) or 'none'}). Pass two or more, or use `conceptdict eval` for one")
    entries, opened, recipes = [], [], {}  # store folders -> (held-out recipe, where the rows come from)
    for path, label in zip(paths, _labels(paths)):
        layers = transcoder_set(path)  # per-layer transcoders (`train --layers`): one entry, its layers' rows each
        ref = dictionary_of(layers[0] if layers else path)
        several = reads_several(load_dictionary_config(ref.path))
        ecfg = EvalConfig(store=cfg.store, store_b=cfg.store_b if several else None, model=cfg.model, rows=cfg.rows,
                          batch_size=cfg.batch_size, contexts=cfg.contexts if cfg.model else 0, device=cfg.device)
        runs = [run_of(d, ecfg, lazy=False if layers or cfg.metrics else None) for d in layers or [ref.path]]
        run = runs[0]  # one dictionary is read a block of latents at a time if it does not fit (not for --metrics)
        key = tuple(map(str, run.store_paths()))
        if key not in recipes:  # every dictionary on these stores reads the rows the first one's training held out
            recipe = training_heldout(run)
            recipes[key] = recipe, (f"the batches `conceptdict train` held out for {ref.path}" if recipe else
                                    "the first rows of the store")
        recipe = recipes[key][0]
        read = [list(rows_of(run, cfg.rows, cfg.batch_size, "heldout" if recipe else "start", recipe, r.source,
                             r.hookpoints)[0]) for r in runs]
        hookpoints = [r.hookpoints[0] for r in runs] + [r.hookpoints[1] for r in runs] if layers else run.hookpoints
        entries.append(Entry(label, run.dictionary, read[0], hookpoints[-1], None if layers else ref.names,
                             {"path": str(path), "hookpoints": hookpoints,
                              "store": [str(p) for p in run.store_paths()]},
                             [Entry(f"{label}/{i}", r.dictionary, b, r.hookpoints[-1])
                              for i, (r, b) in enumerate(zip(runs, read))] if layers else []))
        opened.append((ecfg, run.source))
    result = compare_entries(entries, cfg.match_threshold)
    for row, entry, (ecfg, source) in zip(result["dictionaries"], entries, opened):
        if cfg.model and cfg.contexts:
            metrics = EvalResult(**row["metrics"])
            row["metrics"] = (set_splice_scores(metrics, [sub.model for sub in entry.layers], source,
                                                row["hookpoints"], ecfg)
                              if entry.layers else
                              splice_scores(metrics, entry.model, source, row["hookpoints"], ecfg)).to_dict()
        if cfg.metrics:
            if entry.layers:
                raise ConfigError(f"--metrics measures one dictionary; {row['name']} is a set of per-layer "
                                  f"transcoders: compare each layer's folders")
            store = source if isinstance(source, ActivationStore) else None
            m = row["metrics"]  # compare.json keeps no per-latent density: the rows measured again, splice kept
            base = dataclasses.replace(evaluate_rows(entry.model, entry.batches), ce_loss_recovered=m[
                "ce_loss_recovered"], kl_score=m["kl_score"], splice=m["splice"])
            row["yardsticks"] = measure(parse_metrics(cfg.metrics), Inputs(entry.model, base, store, row[
                "hookpoints"][0], cfg.rows, device=cfg.device), strict="all" not in cfg.metrics).to_dict()
    rows_from = "; ".join(f"{', '.join(key)}: {why}" if len(recipes) > 1 else why
                          for key, (_, why) in recipes.items())
    result["rows_from"] = rows_from
    result["config"] = to_jsonable(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    page = write_comparison(result, cfg.out)
    return Comparison(result, rows_from, {"json": cfg.out / "compare.json", "html": page})


def _labels(paths: list[Path]) -> list[str]:
    """Short distinct names: the folder names, with their parent's where two are alike."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
