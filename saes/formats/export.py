"""Write a dictionary in another library's layout, with a model card (README.md) next to it.

:func:`export_dictionary` is what ``conceptdict export --format saelens|sparsify|dictionary-learning`` calls;
each layout reads back through :func:`saes.formats.open_dictionary` to the same weights, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..model import SparseCoder
from . import circuit_tracer, dictlearn, saelens, sparsify
from .hookpoints import to_transformer_lens

EXPORT_FORMATS = ("saelens", "sparsify", "dictionary-learning", "circuit-tracer")
LIBRARY = {"saelens": "saelens", "sparsify": "sparsify", "dictionary-learning": "dictionary_learning",
           "circuit-tracer": "circuit-tracer"}


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
    """Write ``model`` as ``fmt`` under ``out`` plus ``out/README.md``; returns the dictionary's directory.

    ``config`` is the dictionary's config (for the card: stores, training); ``model_name`` / ``hookpoint``
    default to the ones it records (``model_name=""``: none, e.g. a model known only by a local path); ``evals`` (an eval.json record) adds its metrics to the card."""
    model_name = model_name_of(config) if model_name is None else (model_name or None)  # "": no name to give
    hookpoint = hookpoint or hookpoint_of(config)
    if model.spec.transcodes and fmt not in ("sparsify", "circuit-tracer"):
        raise ValueError(f"a {model.kind} (encodes {config.get('input_hookpoint')}, decodes "
                         f"{config.get('output_hookpoint')}) has no {fmt} layout here; export it with --format "
                         f"sparsify or circuit-tracer, whose formats hold transcoders")
    if fmt == "circuit-tracer":
        hps = config.get("hookpoints") or []
        if model.spec.layered:
            where = circuit_tracer.write_clt(model, out, hps, model_name)
        elif model.spec.transcodes:
            where = circuit_tracer.write_set([model], [hps], out, model_name)
        else:
            raise ValueError(f"circuit-tracer holds transcoders (per layer, or cross-layer); a {model.kind} is neither")
    elif fmt == "saelens":
        where = saelens.write(model, out, {"model_name": model_name, "conceptdict_hookpoint": hookpoint,
                                           "hook_name": to_transformer_lens(hookpoint) if hookpoint else None})
    elif fmt == "sparsify":
        if not hookpoint:
            raise ValueError("sparsify names each SAE's folder after its hookpoint; the dictionary records none")
        pair = config.get("hookpoints") if model.spec.transcodes else None
        where = sparsify.write(model, out, hookpoint, model_name, transcoder_hookpoints=pair)
    elif fmt == "dictionary-learning":
        where = dictlearn.write(model, out, hookpoint, model_name)
    else:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(EXPORT_FORMATS)}")
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


def model_card(model: SparseCoder, config: dict[str, Any], fmt: str, model_name: str | None,
               hookpoint: str | None, evals: dict[str, Any] | None, subdir: str) -> str:
    """A Hugging Face style README: what was trained, on what, with which evals, and how to load it."""
    training = config.get("training") or {}
    stores = config.get("stores") or []
    rule = f"k = {model.k}" if model.kind in ("topk", "batchtopk", "batchtopk-absolute") else "no fixed k"
    lines = [
        "---", f"library_name: {LIBRARY[fmt]}", "tags:", "- sparse-autoencoder", "- conceptdict",
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
