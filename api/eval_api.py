"""Measure dictionaries: one on a store (``evaluate``), several side by side on the same rows (``compare``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from conceptdict.activations import ActivationStore, first_batches, heldout_batches, load_model, spliced_losses
from conceptdict.activations.live import LiveSource
from conceptdict.activations.provenance import check_replacement
from conceptdict.activations.replacement import replacement_losses
from conceptdict.activations.tokens import causal_lm_source, rebuild_contexts, separator_id
from conceptdict.activations.views import pair_hookpoints
from conceptdict.naming import dictionary_of
from conceptdict.saes import EvalResult, SparseCoder, load_dictionary, load_dictionary_config, match_hookpoint
from conceptdict.saes import evaluate as evaluate_rows
from conceptdict.saes import config_file, format_table, kind_spec, threshold_line, with_splice_scores
from conceptdict.saes.diffing import live_tag_counts
from conceptdict.saes.evaluation import combine_layers
from conceptdict.saes.formats import transcoder_set
from conceptdict.saes.replacement import clt_replacement, transcoder_replacement
from conceptdict.settings import ConfigError, config_from_dict, to_jsonable
from conceptdict.outdir import guarded
from conceptdict.eval_rows import live_rows, open_live, training_heldout
from conceptdict.eval_tables import comparison_to_dict, comparison_to_pandas, evaluation_to_dict, evaluation_to_pandas

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
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

    def format(self, source: str | Path = "") -> str:
        where = ", ".join(str(p) for p in self.store) if isinstance(self.store, list) else self.store
        lines = [f"{self.metrics.kind or self.dictionary.kind} dictionary {source} on {where} [{' -> '.join(self.hookpoints)}], "
                 f"{self.metrics.n_tokens} rows ({self.rows_from}):", format_table(self.metrics)]
        if self.latent_tags is not None:
            lines.append(tags_line(self.latent_tags))
        line = threshold_line(getattr(self.dictionary, "training_summary", None) or {}, self.dictionary.k)
        return "\n".join(lines + ([line] if line else []))

    to_dict, to_pandas = evaluation_to_dict, evaluation_to_pandas  # (eval_tables.py)


def tags_line(tags: dict[str, int]) -> str:
    """One line of a crosscoder's live latents per tag (source 0 = A, source 1 = B)."""
    return (f"live latents by decoder norms ({sum(tags.values())}): shared {tags['shared']}, only source 0 (A-only) "
            f"{tags['A-only']}, only source 1 (B-only) {tags['B-only']}, other {tags['other']}")


def evaluate(dictionary: str | Path, **settings: Any) -> Evaluation:
    """Evaluate a dictionary on a store (``conceptdict eval``): L0, FVU, explained variance, cosine, dead and dense
    latents, and for a causal LM's token store CE loss recovered and the KL score. Rows: the batches training held
    out by default. Settings are :class:`EvalConfig`'s. Writes ``eval.json`` (``out=``, default DICT/eval.json)."""
    cfg = config_from_dict(EvalConfig, settings, "evaluate")
    sae_dir = Path(dictionary) if not str(dictionary).startswith("hf:") else dictionary
    layers = transcoder_set(sae_dir)
    if layers:  # per-layer transcoders (`train --layers`): each on its rows, then all MLPs replaced at once
        opened = [open_on_store(d, cfg) for d in layers]
        parts = [evaluate_rows(m, rows_for(d, s, h, cfg)[0]) for d, (m, s, h) in zip(layers, opened)]
        model, store = opened[0][0], opened[0][1]
        hookpoints = [h[0] for _, _, h in opened] + [h[1] for _, _, h in opened]
        rows_from = rows_for(layers[0], store, opened[0][2], cfg)[1]
        result = set_splice_scores(combine_layers(parts, f"{model.kind} x {len(layers)} layers"),
                                   [m for m, _, _ in opened], store, hookpoints, cfg)
    else:
        model, store, hookpoints = open_on_store(sae_dir, cfg)
        batches, rows_from = rows_for(sae_dir, store, hookpoints, cfg)
        result = evaluate_rows(model, batches)
        result = splice_scores(result, model, store, hookpoints, cfg)
    tags = live_tag_counts(model, torch.tensor(result.density)) if model.n_sources == 2 and \
        model.spec.sources == "several" else None
    if cfg.out is None and str(sae_dir).startswith("hf:"):
        raise ValueError(f"{sae_dir} is a hub name; pass --out FILE for eval.json (it is not written into the cache)")
    out = cfg.out or Path(sae_dir) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    where = store_paths(store) if isinstance(store, list) else store.path
    record = {"sae_dir": str(sae_dir), "store": str(where) if not isinstance(where, list) else [str(p) for p in where],
              "hookpoint": " -> ".join(hookpoints), "latent_tags": tags,
              "hookpoints": hookpoints, "rows_from": rows_from, "config": to_jsonable(cfg),
              "metrics": result.to_dict(with_density=True),
              "threshold": (getattr(model, "training_summary", None) or {}).get("threshold")}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return Evaluation(result, model, where, hookpoints, rows_from, out, tags)


def set_splice_scores(result: EvalResult, models: list[SparseCoder], store, hookpoints: list[str],
                      cfg: EvalConfig) -> EvalResult:
    """:func:`splice_scores` of per-layer transcoders: every MLP replaced at once by its layer's transcoder."""
    lm_ids = _lm_contexts(store, cfg)
    if lm_ids is None:
        return result
    S = len(models)
    return replacement_scores(result, *lm_ids[:1], transcoder_replacement(models),
                              list(zip(hookpoints[:S], hookpoints[S:])), *lm_ids[1:])


def _lm_contexts(store, cfg: EvalConfig):
    """(causal LM, token ids, mask) for the spliced losses, or None when there is no causal LM or no contexts."""
    if isinstance(store, LiveSource):
        ids = store.contexts(cfg.contexts) if cfg.contexts else None
        return None if ids is None else (store.model, *ids)
    name = cfg.model or causal_lm_source(store)
    if name is None or cfg.contexts == 0 or store.level != "token":
        return None
    lm = load_model(name, device=cfg.device)
    bos, pad = lm.bos_pad_ids()  # from the config when the model was saved without a tokenizer
    return (lm, *rebuild_contexts(store, cfg.contexts, bos, pad, separator_id(lm)))


def open_on_store(sae_dir: str | Path, cfg: EvalConfig):
    """(dictionary, store, hookpoints) with the widths checked: the store is ``cfg.store`` or the recorded one; the
    hookpoints are ``cfg.hookpoint`` or the recorded one ([input, output] for a transcoder). A crosscoder gets the
    list of its stores (:func:`crosscoder_sources`)."""
    config = load_dictionary_config(sae_dir)
    model = load_dictionary(sae_dir, device=cfg.device)
    if cfg.store is None and not config.get("stores") and (config.get("live") or cfg.dataset):
        return open_live(sae_dir, config, model, cfg)  # trained from a model's forward: run it again
    if cfg.dataset is not None:
        raise ValueError(f"--dataset {cfg.dataset}: {sae_dir} reads a store; drop --dataset")
    if model.n_sources != 1 and not model.spec.transcodes:
        return (model, *crosscoder_sources(sae_dir, config, model, cfg))
    if cfg.store_b is not None:
        raise ValueError(f"--store-b {cfg.store_b}: {sae_dir} reads one source; drop --store-b")
    recorded = (config.get("stores") or [None])[0]
    check_replacement(sae_dir, recorded, cfg.store)
    store_path = cfg.store or recorded
    if store_path is None:
        raise ValueError(f"{config_file(sae_dir)} records no store; pass --store STORE_DIR (the store of the "
                         "activations the dictionary reads)")
    store = ActivationStore(store_path)
    if model.spec.transcodes:
        return model, store, _transcoder_hookpoints(sae_dir, config, store, cfg)
    if config.get("transcoder"):
        raise ValueError(f"{sae_dir} is a transcoder whose input hookpoint is not recorded: its decoder predicts "
                         f"another hookpoint's output, so reconstruction metrics against its input would be wrong; "
                         f"name it or use it in a cbm")
    hookpoint = cfg.hookpoint or (config.get("hookpoints") or [None])[0]
    hookpoint = match_hookpoint(hookpoint, store.hookpoints) or hookpoint if hookpoint else None
    if hookpoint is None or hookpoint not in store.hookpoints:
        raise ValueError(f"hookpoint {hookpoint!r} is not in store {store_path} (it holds {store.hookpoints}); "
                         f"pass --hookpoint")
    if store.d_in(hookpoint) != model.d_in:
        raise ValueError(f"SAE d_in={model.d_in} but the store at {store_path} has d={store.d_in(hookpoint)} for "
                         f"hookpoint {hookpoint}; pass the store the dictionary was trained on")
    return model, store, [hookpoint]


def crosscoder_sources(sae_dir, config: dict, model: SparseCoder, cfg: EvalConfig) -> tuple[list, list[str]]:
    """(stores, hookpoints) of a crosscoder, its sources being every (store, hookpoint) pair, stores outermost: the
    recorded stores with ``cfg.store`` replacing the first and ``cfg.store_b`` the second, the recorded hookpoints
    (or ``cfg.hookpoint`` for one), store B read under its own hookpoint name as ``conceptdict diff`` recorded it."""
    paths = [Path(p) for p in config.get("stores") or []]
    for i, (flag, given) in enumerate((("--store", cfg.store), ("--store-b", cfg.store_b))):
        check_replacement(sae_dir, paths[i] if i < len(paths) else None, given, flag)
    if cfg.store is not None:
        paths[:1] = [cfg.store]
    if cfg.store_b is not None:
        if len(paths) != 2:
            raise ValueError(f"--store-b {cfg.store_b}: {sae_dir} reads {len(paths)} store(s), not two; drop --store-b")
        paths[1] = cfg.store_b
    if not paths:
        raise ValueError(f"{config_file(sae_dir)} records no store; pass --store STORE_DIR (and --store-b for "
                         f"model B's)")
    hookpoints = list(config.get("hookpoints") or [])
    if cfg.hookpoint is not None:
        if len(hookpoints) > 1:
            raise ValueError(f"--hookpoint {cfg.hookpoint}: {sae_dir} is a crosscoder over the hookpoints "
                             f"{hookpoints}; drop --hookpoint")
        hookpoints = [cfg.hookpoint]
    stores = [ActivationStore(p) for p in paths]
    if len(stores) == 2 and len(hookpoints) <= 1:
        hookpoint_b = None if cfg.hookpoint else (config.get("store_hookpoints") or [None, None])[1]
        stores, hookpoint, _ = pair_hookpoints(stores, hookpoints[0] if hookpoints else None, hookpoint_b)
        hookpoints = [hookpoint]
    if len(stores) * len(hookpoints) != model.n_sources:
        raise ValueError(f"{sae_dir} is a crosscoder over {model.n_sources} sources but stores {[str(p) for p in paths]}"
                         f" x hookpoints {hookpoints} give {len(stores) * len(hookpoints)}; pass its stores")
    for store in stores:
        for h in hookpoints:
            if h not in store.hookpoints or store.d_in(h) != model.d_in:
                raise ValueError(f"crosscoder {sae_dir} reads hookpoint {h!r} of width {model.d_in}; store "
                                 f"{store.path} holds {store.hookpoints}: pass the stores it was trained on")
    return stores, hookpoints


def _transcoder_hookpoints(sae_dir, config: dict, store, cfg: EvalConfig) -> list[str]:
    """[input, output] hookpoints of a transcoder, both in the store (``hookpoint`` names the output); a cross-layer
    transcoder's S inputs then S outputs."""
    pair = list(config.get("hookpoints") or [])
    n = 2 * int(config.get("n_sources") or 1)
    if len(pair) != n:
        raise ValueError(f"{sae_dir}/config.json records hookpoints {pair}; a {config.get('kind')} needs "
                         f"{'[input, output]' if n == 2 else f'{n // 2} MLP inputs then their {n // 2} outputs'}")
    if cfg.hookpoint and (n > 2 or cfg.hookpoint != pair[1]):
        raise ValueError(f"--hookpoint {cfg.hookpoint}: {sae_dir} is a transcoder from {pair[0]} to {pair[1]}; "
                         f"drop --hookpoint")
    missing = [h for h in pair if h not in store.hookpoints]
    if missing:
        raise ValueError(f"a transcoder evaluates on both its hookpoints {pair}; store {store.path} lacks {missing} "
                         f"(it holds {store.hookpoints}): cache both in one store")
    return pair


def rows_for(sae_dir, store, hookpoints: list[str], cfg: EvalConfig, recipe: dict | None = None):
    """(batches, where they come from): training's held-out batches (``recipe``, default: ``sae_dir``'s) when
    ``cfg.rows_from`` is heldout and they were recorded for this store and hookpoints, else the first rows. A
    model's forward (:class:`LiveSource`): ``eval_rows.live_rows``."""
    if isinstance(store, LiveSource):
        return live_rows(sae_dir, store, hookpoints, cfg.rows, cfg.batch_size, cfg.rows_from,
                         load_dictionary_config(sae_dir))
    if cfg.rows_from == "heldout":
        recipe = recipe or training_heldout(sae_dir, hookpoints)
        batches = heldout_batches(recipe, store, hookpoints, cfg.rows)
        if batches is not None:
            return batches, "training's held-out batches"
        log.warning("%s records no held-out batches for %s [%s]: evaluating on the first %d rows of the store, "
                    "which training may have seen", sae_dir, ", ".join(map(str, store_paths(store))),
                    " -> ".join(hookpoints), cfg.rows)
    return first_batches(store, hookpoints, cfg.rows, cfg.batch_size), "the first rows of the store"


def store_paths(store) -> list[Path]:
    """The folders of an opened store, or of a crosscoder's list of them."""
    return [s.path for s in store] if isinstance(store, list) else [store.path]


def splice_scores(result: EvalResult, sae: SparseCoder, store, hookpoints: list[str], cfg: EvalConfig) -> EvalResult:
    """``result`` with CE loss recovered / KL score when a causal LM is at hand: the last hookpoint is replaced by
    the dictionary's output on the first (the same one for an SAE; a transcoder's input, then output)."""
    if sae.n_sources > 1 and not sae.spec.layered:  # a crosscoder spans several models or layers: no one splice
        return result
    lm_ids = _lm_contexts(store, cfg)
    if lm_ids is None:
        return result
    lm, ids, mask = lm_ids
    if sae.spec.layered:  # a cross-layer transcoder replaces every MLP it covers at once
        S = sae.n_sources
        return replacement_scores(result, lm, clt_replacement(sae), list(zip(hookpoints[:S], hookpoints[S:])), ids,
                                  mask)

    def swap(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return sae(x.to(sae.W_enc.device)).to(x.device)

    losses = spliced_losses(lm, hookpoints[-1], ids, swap, attention_mask=mask,
                            source=hookpoints[0] if len(hookpoints) > 1 else None)
    return with_splice_scores(result, losses.ce_clean, losses.ce_zero, losses.ce_replaced, losses.kl_zero,
                              losses.kl_replaced)


def replacement_scores(result: EvalResult, lm, replacement, layers: list[tuple[str, str]], ids, mask) -> EvalResult:
    """``result`` with the replacement model's CE loss recovered / KL score (every MLP in ``layers`` replaced at once,
    errors not kept) and, in ``splice``, the error-kept forward's CE, KL and largest logit difference from clean."""
    losses = replacement_losses(lm, layers, ids, replacement.encode, replacement.decode, attention_mask=mask)
    return with_splice_scores(result, losses.ce_clean, losses.ce_zero, losses.ce_replaced, losses.kl_zero,
                              losses.kl_replaced, ce_with_errors=losses.ce_with_errors,
                              kl_with_errors=losses.kl_with_errors,
                              max_logit_diff_with_errors=losses.max_logit_diff_with_errors)


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
        return "\n".join(lines)

    to_dict, to_pandas = comparison_to_dict, comparison_to_pandas  # (eval_tables.py)


@guarded("compare")
def compare(dictionaries: list[str | Path], **settings: Any) -> Comparison:
    """Several dictionaries (or concept dictionaries, whose names then count) on the same rows (``conceptdict
    compare``): L0, FVU, CE/KL with ``model=``, dead/dense, weight metrics, latents matched across dictionaries,
    the FVU-L0 frontier. Settings are :class:`CompareConfig`'s; writes compare.json and index.html to ``out``."""
    from conceptdict.naming.reports.compare import write_comparison
    from conceptdict.saes.compare import Entry
    from conceptdict.saes.compare import compare as compare_entries

    cfg = config_from_dict(CompareConfig, settings, "compare")
    if cfg.out is None:
        raise ConfigError("conceptdict compare needs --out DIR")
    paths = [Path(p) for p in ([dictionaries] if isinstance(dictionaries, (str, Path)) else dictionaries)]
    if len(paths) < 2:
        raise ConfigError(f"conceptdict compare puts dictionaries side by side; got {len(paths)} "
                          f"({', '.join(map(str, paths)) or 'none'}). Pass two or more, or use `conceptdict eval` for one")
    entries, opened, recipes = [], [], {}  # store folders -> (held-out recipe, where the rows come from)
    for path, label in zip(paths, _labels(paths)):
        layers = transcoder_set(path)  # per-layer transcoders (`train --layers`): one entry, its layers' rows each
        ref = dictionary_of(layers[0] if layers else path)
        ecfg = EvalConfig(store=cfg.store, store_b=cfg.store_b if _reads_several(ref.path) else None,
                          model=cfg.model, rows=cfg.rows, batch_size=cfg.batch_size,
                          contexts=cfg.contexts if cfg.model else 0, device=cfg.device)
        parts = [open_on_store(d, ecfg) for d in layers or [ref.path]]
        model, store, hookpoints = parts[0]
        key = tuple(map(str, store_paths(store)))
        if key not in recipes:  # every dictionary on these stores reads the rows the first one's training held out
            recipe = training_heldout(ref.path, hookpoints)
            recipes[key] = recipe, (f"the batches `conceptdict train` held out for {ref.path}" if recipe else
                                    "the first rows of the store")
        recipe = recipes[key][0]
        read = [list(rows_for(ref.path, s, h, replace(ecfg, rows_from="heldout" if recipe else "start"), recipe)[0])
                for _, s, h in parts]
        hookpoints = [h[0] for *_, h in parts] + [h[1] for *_, h in parts] if layers else hookpoints
        entries.append(Entry(label, model, read[0], hookpoints[-1], None if layers else ref.names,
                             {"path": str(path), "hookpoints": hookpoints,
                              "store": [str(p) for p in store_paths(store)]},
                             [Entry(f"{label}/{l}", m, b, h[-1]) for l, ((m, _, h), b) in enumerate(zip(parts, read))]
                             if layers else []))
        opened.append((ecfg, store))
    result = compare_entries(entries, cfg.match_threshold)
    for row, entry, (ecfg, store) in zip(result["dictionaries"], entries, opened):
        if cfg.model and cfg.contexts:
            metrics = EvalResult(**row["metrics"])
            row["metrics"] = (set_splice_scores(metrics, [sub.model for sub in entry.layers], store, row["hookpoints"],
                                                ecfg)
                              if entry.layers else
                              splice_scores(metrics, entry.model, store, row["hookpoints"], ecfg)).to_dict()
    rows_from = "; ".join(f"{', '.join(key)}: {why}" if len(recipes) > 1 else why
                          for key, (_, why) in recipes.items())
    result["rows_from"] = rows_from
    result["config"] = to_jsonable(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    page = write_comparison(result, cfg.out)
    return Comparison(result, rows_from, {"json": cfg.out / "compare.json", "html": page})


def _reads_several(path) -> bool:
    """Whether the dictionary at ``path`` is a crosscoder (config.json's n_sources above 1, not a cross-layer
    transcoder's layers)."""
    config = load_dictionary_config(path)
    return int(config.get("n_sources") or 1) > 1 and not kind_spec(config.get("kind", "topk")).transcodes


def _labels(paths: list[Path]) -> list[str]:
    """Short distinct names: the folder names, with their parent's where two are alike."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
