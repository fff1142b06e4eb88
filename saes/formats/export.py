"""Write a dictionary in another library's layout, with a model card (README.md) next to it.

:data:`WRITERS` is the writers' table, beside the readers' (``saes.formats.FORMATS``): layout name -> its module's
``export`` function, one line of description, the library that loads it, whether it holds transcoders and, where
it has one, the writer of ``train --layers``' folder of per-layer transcoders. :func:`export_dictionary` is what
``conceptdict export --format NAME`` calls for every name in it; each layout reads back through
:func:`saes.formats.open_dictionary` to the same weights, bit for bit. Adding a layout: its module (a reader and
an ``export``), one line in :data:`WRITERS`, its tests; the command's choices, help and dispatch follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model import SparseCoder
from . import circuit_tracer, dictlearn, saelens, sparsify


@dataclass(frozen=True)
class Writer:
    """One layout ``conceptdict export`` writes a dictionary in."""

    export: Callable[..., Path]
    """(model, out, *, config, model_name, hookpoint) -> the directory the dictionary went to (``out`` or a folder
    in it); raises ValueError naming the fix for a dictionary the layout cannot hold exactly."""
    description: str
    """One line for ``conceptdict export --help``: the files it writes and what holds them."""
    library: str
    """The model card's ``library_name``: the library that loads the layout."""
    transcoders: bool = False
    """Whether it holds transcoders (a dictionary that encodes one hookpoint and decodes another)."""
    write_set: Callable[[Sequence[SparseCoder], Sequence[Sequence[str]], Path, str | None], Path] | None = None
    """(models, each one's [input, output] hookpoints, out, model_name) -> the directory: ``train --layers``'
    folder of per-layer transcoders as one set; None: the layout holds one dictionary."""
    streams: bool = False
    """Whether ``export`` also takes a ``saes.lazy.LazyDictionary`` and writes it a block of latents at a time
    (``saes.lazy.save_tensors_of``; dictionary-learning: ``saes.lazy_io.TorchArchiveWriter``; circuit-tracer: a
    CLT's, ``saes.lazy_clt``), so that a dictionary larger than memory is exported without being whole."""


WRITERS: dict[str, Writer] = {
    "saelens": Writer(saelens.export, "SAELens cfg.json + sae_weights.safetensors, for the kinds with a SAELens "
                      "architecture, docs/guide/train.md", "saelens", streams=True),
    "sparsify": Writer(sparsify.export, "EleutherAI sparsify HOOKPOINT/cfg.json + sae.safetensors: TopK SAEs and "
                       "transcoders", "sparsify", transcoders=True, streams=True),
    "dictionary-learning": Writer(dictlearn.export, "dictionary_learning ae.pt + config.json, for the kinds with an "
                                  "exact dictionary_learning class", "dictionary_learning", streams=True),
    "circuit-tracer": Writer(circuit_tracer.export, "circuit-tracer config.yaml + weights: a cross-layer "
                             "transcoder, or train --layers' set of transcoders", "circuit-tracer", transcoders=True,
                             write_set=circuit_tracer.write_set, streams=True),
}
"""layout name -> :class:`Writer`: the layouts ``conceptdict export`` writes a dictionary in."""


def writer(fmt: str) -> Writer:
    """The writer of layout ``fmt``; the error lists the layouts."""
    if fmt not in WRITERS:
        raise ValueError(f"unknown dictionary layout {fmt!r}; choose one of {list(WRITERS)}")
    return WRITERS[fmt]


def model_name_of(config: dict[str, Any]) -> str | None:
    """The model's name string from a dictionary config (``model`` is a provenance record in ours)."""
    m = config.get("model")
    if isinstance(m, dict):
        m = m.get("id") or m.get("name") or m.get("source")
    return str(m) if m else None


def hookpoint_of(config: dict[str, Any]) -> str | None:
    hp = config.get("hookpoints") or config.get("hookpoint")
    return (hp[0] if hp else None) if isinstance(hp, list) else hp


def export_dictionary(model: SparseCoder, config: dict[str, Any], fmt: str, out: Path, *,
                      model_name: str | None = None, hookpoint: str | None = None,
                      evals: dict[str, Any] | None = None) -> Path:
    """Write ``model`` in layout ``fmt`` (a name of :data:`WRITERS`) under ``out`` plus ``out/README.md``; returns the
    dictionary's directory.

    ``config`` is the dictionary's config (for the card: stores, training); ``model_name`` / ``hookpoint``
    default to the ones it records (``model_name=""``: none, e.g. a model known only by a local path); ``evals`` (an
    eval.json record) adds its metrics to the card."""
    layout = writer(fmt)
    model_name = model_name_of(config) if model_name is None else (model_name or None)  # "": no name to give
    hookpoint = hookpoint or hookpoint_of(config)
    if model.spec.transcodes and not layout.transcoders:
        holders = " or ".join(name for name, w in WRITERS.items() if w.transcoders)
        raise ValueError(f"a {model.kind} (encodes {config.get('input_hookpoint')}, decodes "
                         f"{config.get('output_hookpoint')}) has no {fmt} layout here; export it with --format "
                         f"{holders}, whose formats hold transcoders")
    where = layout.export(model, out, config=config, model_name=model_name, hookpoint=hookpoint)
    (out / "README.md").write_text(model_card(model, config, fmt, model_name, hookpoint, evals,
                                              where.relative_to(out).as_posix()))
    return where


def _eval_lines(evals: dict[str, Any] | None, config: dict[str, Any]) -> list[str]:
    metrics = (evals or {}).get("metrics") or (config.get("training") or {}).get("heldout_eval")
    if not metrics:
        return ["No evaluation was recorded; run `conceptdict eval SAE_DIR` before exporting to add one."]
    where = (f"on {evals.get('store')} [{evals.get('hookpoint')}], {evals.get('rows_from')}" if evals
             else "on the batches training held out")
    keys = ("l0", "fvu", "explained_variance", "cosine", "dead_fraction", "dense_fraction", "ce_loss_recovered",
            "kl_score")
    rows = [f"| {k} | {metrics[k]:.4g} |" for k in keys if isinstance(metrics.get(k), (int, float))]
    return [f"Measured {where}:", "", "| metric | value |", "|---|---|", *rows]


def _selection(model: SparseCoder) -> str:
    """How k sets the dictionary's L0, from its kind's spec: TopK (no threshold, AuxK for its dead latents) keeps k
    per row; BatchTopK (a threshold estimated while training) k on average; other rules (a penalty, learned
    thresholds) have no fixed k."""
    spec = model.spec
    if spec.uses_aux and not spec.uses_threshold:
        return f"k = {model.k} per row"
    if spec.estimates_threshold:
        return f"k = {model.k} on average per row"
    return "no fixed k"


def model_card(model: SparseCoder, config: dict[str, Any], fmt: str, model_name: str | None,
               hookpoint: str | None, evals: dict[str, Any] | None, subdir: str) -> str:
    """A Hugging Face style README: what was trained, on what, with which evals, and how to load it."""
    training = config.get("training") or {}
    stores = config.get("stores") or []
    rule = _selection(model)
    lines = [
        "---", f"library_name: {writer(fmt).library}", "tags:", "- sparse-autoencoder", "- conceptdict",
        *([f"base_model: {model_name}"] if model_name and "/" in model_name else []), "---", "",
        f"# {model.kind} sparse autoencoder on {model_name or 'an unrecorded model'} at "
        f"{hookpoint or 'an unrecorded hookpoint'}",
        "", "## What was trained", "",
        f"- kind: {model.kind} ({rule}); d_in = {model.d_in}, latents = {model.n_latents}",
        f"- model: {model_name or 'not recorded'}; hookpoint: {hookpoint or 'not recorded'}",
        f"- source: {config.get('source_format', 'conceptdict')} dictionary"
        + (f" from {config['source']}" if config.get("source") else ""),
        "", "## On what", "",
        f"- activation stores: {', '.join(map(str, stores)) or 'not recorded'}",
        f"- training: {training.get('steps', 'unknown')} steps over {training.get('rows', 'unknown')} rows"
        if training else "- training: not recorded (imported dictionary)",
        "", "## Evaluation", "", *_eval_lines(evals, config),
        "", "## Loading", "",
        f"Written by `conceptdict export --format {fmt}` into `{subdir}`; `conceptdict eval DIR` and "
        f"`conceptdict name DIR` read it back as it is.", "",
    ]
    return "\n".join(lines)
