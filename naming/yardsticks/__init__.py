"""The field's yardsticks (``conceptdict eval DICT --metrics core,sparse-probing,absorption,...|all``: REGISTRY).

Each metric is one module of this package with ``compute(inputs) -> dict`` (``{"summary": {name: number},
"details": {...}}``) and ``saebench(result, about) -> dict`` (SAEBench's JSON layout); its registry line below names
the module and the inputs it needs. A metric whose inputs are missing is refused with one line that says what is
missing and how to get it (``--metrics all`` skips it and says why).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pandas
    from conceptdict.activations.store import ActivationStore
    from conceptdict.saes.evaluation import EvalResult
    from conceptdict.saes.model import SparseCoder


class Yardstick(NamedTuple):
    """One registry line: the metric's name, its module in this package, the inputs it needs, what it measures."""

    name: str
    module: str
    needs: tuple[str, ...]
    about: str


REGISTRY: tuple[Yardstick, ...] = (
    Yardstick("core", "core", ("rows",), "SAEBench core: explained variance, MSE, cosine, L2 ratio, CE/KL score, "
              "L0/L1, dead/dense latents, density histogram"),
    Yardstick("sparse-probing", "sparse_probing", ("rows", "one_space", "labels"), "top-k latents by mean "
              "difference, logistic probe test accuracy beside the same probe on the raw activations"),
    Yardstick("ground-truth", "ground_truth", ("rows", "one_space", "true_features"), "sae_lens.synthetic: MCC "
              "(Hungarian), uniqueness, precision / recall / F1 of each latent as a detector of its matched true "
              "feature"),
    Yardstick("autointerp", "autointerp", ("rows", "one_space", "texts"), "SAEBench's detection protocol: an LLM "
              "explains each latent from its examples and labels a scoring set; accuracy (embedding scorer without a "
              "server)"),
    Yardstick("tpp", "tpp", ("rows", "one_space", "labels"), "targeted probe perturbation: ablating a class's "
              "latents hurts its probe, not the others' (the 2026 audit found it unreliable)"),
    Yardstick("scr", "scr", ("rows", "one_space", "two_labels"), "spurious correlation removal: ablating one label "
              "column's latents frees a biased probe to read the other (the 2026 audit found it unreliable)"),
    Yardstick("absorption", "absorption", ("one_space", "causal_lm"), "first-letter feature absorption: how much "
              "of a letter probe's direction other latents carry where the letter's main latents are silent"),
)
NAMES = tuple(y.name for y in REGISTRY)


class TooThin(ValueError):
    """A metric's inputs are present but too thin to measure it (e.g. too few letters a probe can read, too few
    rows in a class): ``--metrics all`` lists the metric as skipped with this message; asked for by name, it is
    the error. Any other exception of a metric is a failure, never a skip."""
DEFAULT: tuple[str, ...] = ()
"""No metrics asked: ``eval`` reports what it always has (the core numbers under its own names)."""


@dataclass
class Inputs:
    """What the metrics read: the dictionary, the evaluation rows' base result, the store and its hookpoint."""

    dictionary: SparseCoder
    evaluation: EvalResult
    store: ActivationStore | None
    """The store the dictionary is evaluated on (None: rows came from a model's forward)."""
    hookpoint: str
    rows: int = 65536
    """At most this many store rows are read by metrics that read rows of their own (labels, true codes)."""
    seed: int = 0
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)
    """Settings of one metric by its name, e.g. ``{"autointerp": {"llm": LlmConfig, "scorer": "auto", ...}}``."""


def _texts_missing(inputs: Inputs) -> str | None:
    s = inputs.store
    if s is None:
        return "needs a store's token or text records; the rows came from a model's forward: pass --store STORE"
    imported = (s.manifest.get("dataset") or {}).get("kind") == "import"
    if imported or getattr(s, "is_image_store", False) or (s.level == "token" and getattr(s, "tokenizer", "") is None):
        return (f"needs example texts (a store cached from a text model: its tokens and tokenizer, or its inputs' "
                f"texts); {s.path} has none: cache one with `conceptdict cache --model M --dataset D`")
    return None


def _labels_missing(inputs: Inputs) -> str | None:
    if inputs.store is None:
        return "needs a labelled store; the rows came from a model's forward: pass --store STORE with label columns"
    if not inputs.store.manifest.get("label_keys"):
        return (f"needs a labelled store (per-row label columns); {inputs.store.path} has none: cache it with "
                f"--label-column COL, or `store import` an .npz holding a 1-D integer array beside the activations")
    return None


def _true_features_missing(inputs: Inputs) -> str | None:
    if inputs.store is None or not inputs.store.manifest.get("true_features"):
        where = inputs.store.path if inputs.store is not None else "a model's forward"
        return (f"needs a store that records its true features; {where} does not: `conceptdict store import ARRAY "
                f"--true-features F.npy [--true-codes C.npy]`")
    return None


def _two_labels_missing(inputs: Inputs) -> str | None:
    why = _labels_missing(inputs)
    if why or len(inputs.store.manifest["label_keys"]) >= 2:
        return why and why.replace("per-row label columns", "two per-row label columns")
    return (f"needs a store with two label columns (one for the concept, one for the spurious one); "
            f"{inputs.store.path} has one ({inputs.store.manifest['label_keys'][0]}): cache it with --label-column "
            f"twice, or `store import` an .npz holding two 1-D integer arrays beside the activations")


def _causal_lm_missing(inputs: Inputs) -> str | None:
    from conceptdict.activations.tokens import causal_lm_source

    if inputs.store is not None and causal_lm_source(inputs.store) is not None:
        return None
    if inputs.store is None:
        return ("needs a token-level hookpoint of a causal LM read from a store; these rows came from a model's "
                "forward: pass --store STORE cached from that model")
    model = (inputs.store.manifest.get("model") or {}).get("id") or "no recorded model (imported rows)"
    what = "token activations" if inputs.store.level == "token" else "sentence embeddings"
    return (f"needs a token-level hookpoint of a causal LM (its vocabulary is the task); this dictionary was "
            f"trained on {what} of {model} ({inputs.store.path}): use a dictionary of a causal LM's "
            f"token store")


def _one_space_missing(inputs: Inputs) -> str | None:
    sae = inputs.dictionary
    if sae.n_sources != 1 or sae.spec.transcodes:
        return (f"reads one space's rows and decoder; this {sae.kind} dictionary spans {sae.n_sources} sources"
                f"{' and predicts another hookpoint' if sae.spec.transcodes else ''}: use an SAE of one hookpoint")
    return None


CHECKS = {"rows": lambda inputs: None, "one_space": _one_space_missing, "labels": _labels_missing,
          "true_features": _true_features_missing,
          "two_labels": _two_labels_missing, "causal_lm": _causal_lm_missing}
"""Input name -> (inputs -> None when present, else the one-line refusal)."""

CHECKS["texts"] = _texts_missing  # autointerp's examples


def parse_metrics(metrics: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """``core,sparse-probing`` or a list of names (each may hold commas) -> known names in order; ``all`` = every
    registered metric. Refuses an unknown name, naming the known ones."""
    if metrics is None:
        return list(DEFAULT)
    items = [metrics] if isinstance(metrics, str) else list(metrics)
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        wanted = list(NAMES) if n == "all" else [n.replace("_", "-")]
        for w in wanted:
            if w not in NAMES:
                raise ValueError(f"metrics: unknown metric {n!r}; known: {', '.join(NAMES)} or all")
            if w not in out:
                out.append(w)
    return out


def refusal(y: Yardstick, inputs: Inputs) -> str | None:
    """Why ``y`` cannot run on ``inputs`` (the first missing input's line), or None."""
    for need in y.needs:
        why = CHECKS[need](inputs)
        if why:
            return f"{y.name}: {why}"
    return None


def check_named(names: list[str], dictionary: SparseCoder, store: ActivationStore | None) -> None:
    """Refuse, before any work, the first of ``names`` (metrics asked for by name) whose inputs are missing."""
    inputs = Inputs(dictionary, None, store, "")  # type: ignore[arg-type]  # the checks read no evaluation
    for y in REGISTRY:
        why = refusal(y, inputs) if y.name in names else None
        if why:
            raise ValueError(why)


@dataclass
class MetricResults:
    """The requested metrics of one dictionary: ``results[name]`` = {"summary": {...}, "details": {...}}, and
    ``skipped[name]`` = why a metric asked for by ``all`` did not run."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: {"results": ..., "skipped": ...}."""
        return {"results": self.results, "skipped": self.skipped}

    def flat(self) -> dict[str, float]:
        """Every summary number as ``metric.name`` -> value (one row of :meth:`to_pandas`)."""
        return {f"{m}.{k}": v for m, r in self.results.items() for k, v in r["summary"].items()}

    def to_pandas(self) -> pandas.DataFrame:
        """One row per summary number: metric, name, value."""
        import pandas as pd

        return pd.DataFrame([{"metric": m, "name": k, "value": v} for m, r in self.results.items()
                             for k, v in r["summary"].items()], columns=["metric", "name", "value"])

    def format(self) -> str:
        """A text table of each metric's summary, then the skipped metrics and why."""
        lines = []
        for name, r in self.results.items():
            lines.append(f"[{name}]" + (f" ({r['note']})" if r.get("note") else ""))
            width = max((len(k) for k in r["summary"]), default=0)
            lines += [f"  {k:<{width}}  {_show(v)}" for k, v in r["summary"].items()]
        lines += [f"skipped {why}" for why in self.skipped.values()]
        return "\n".join(lines)


def _show(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def module_of(name: str):
    """The module that computes metric ``name``."""
    y = next(y for y in REGISTRY if y.name == name)
    return importlib.import_module(f"{__name__}.{y.module}")


def measure(names: list[str], inputs: Inputs, strict: bool = True) -> MetricResults:
    """Run the metrics ``names`` on ``inputs``. A metric whose inputs are missing, or that finds them too thin to
    measure (:class:`TooThin`), raises ValueError with why when ``strict`` (asked for by name), else is listed in
    ``skipped`` (asked for by ``all``)."""
    out = MetricResults()
    for name in names:
        y = next(y for y in REGISTRY if y.name == name)
        why = refusal(y, inputs)
        if why is None:
            try:
                out.results[name] = module_of(name).compute(inputs)
                continue
            except TooThin as e:
                if strict:
                    raise
                why = str(e) if str(e).startswith(f"{name}:") else f"{name}: {e}"
        if strict:
            raise ValueError(why)
        out.skipped[name] = why
    return out


ARCHITECTURES = {"relu": "standard", "topk": "topk", "batchtopk": "batch_topk", "jumprelu": "jumprelu",
                 "gated": "gated", "matryoshka": "matryoshka_batch_topk"}
"""conceptdict kind -> the ``architecture`` string SAEBench's graphs group by (other kinds keep their own name)."""


def write_saebench(results: MetricResults, folder: Path, sae: SparseCoder, sae_id: str, hookpoint: str,
                   config: dict[str, Any]) -> list[Path]:
    """One JSON per metric in SAEBench's layout, ``folder/<eval_type>/conceptdict_<sae_id>_eval_results.json``
    (the ``{release}_{sae_id}_eval_results.json`` names its ``graphing_utils.get_eval_results`` reads)."""
    import json
    import time
    import uuid

    summary = getattr(sae, "training_summary", None) or {}
    about = {"eval_config": config, "eval_id": str(uuid.uuid4()), "datetime_epoch_millis": int(time.time() * 1000),
             "sae_bench_commit_hash": None, "sae_lens_id": sae_id, "sae_lens_release_id": "conceptdict",
             "sae_lens_version": None,
             "sae_cfg_dict": {"architecture": ARCHITECTURES.get(sae.kind, sae.kind), "d_in": sae.d_in,
                              "d_sae": sae.n_latents, "k": sae.k, "hook_name": hookpoint,
                              "training_tokens": summary.get("rows") or 0}}
    paths = []
    for name, result in results.results.items():
        mod = module_of(name)
        path = Path(folder) / mod.SAEBENCH_TYPE / f"conceptdict_{sae_id}_eval_results.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(mod.saebench(result, about), indent=2) + "\n")
        paths.append(path)
    return paths


__all__ = [
    "CHECKS",
    "DEFAULT",
    "NAMES",
    "REGISTRY",
    "Inputs",
    "MetricResults",
    "Yardstick",
    "measure",
    "module_of",
    "parse_metrics",
    "refusal",
    "write_saebench",
]
