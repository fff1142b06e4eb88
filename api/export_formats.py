"""The formats ``conceptdict export`` writes: a concept dictionary's (:data:`CONCEPT_FORMATS`: json, html,
neuronpedia) and a dictionary's layouts (``saes.formats.export.WRITERS``: saelens, sparsify, dictionary-learning,
circuit-tracer). :func:`export_formats` lists them all, each with what it needs, its writer, one line of
description and what the command line prints; the export command's choices, help and dispatch come from it.

A concept dictionary's formats read it :data:`BLOCK` concepts at a time (``naming.concepts_file.ConceptsFile``),
never whole, and write the files its whole-dictionary writers write (``save_concepts``, ``write_report``,
``write_neuronpedia``), byte for byte.

Adding a format: its writer (a module of naming/ for a concept dictionary's, of saes/formats/ for a dictionary
layout), one line in :data:`CONCEPT_FORMATS` or ``WRITERS``, its tests. Tests and extensions add one at run time
the same way (an entry of either table).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from conceptdict.activations import hub_id_of
from conceptdict.naming import CbmResult, dictionary_of, is_concept_dir, load_cbm
from conceptdict.naming.concepts_file import ConceptsFile
from conceptdict.naming.written import ConceptsWriter
from conceptdict.saes.formats.export import WRITERS, export_dictionary
from conceptdict.settings import ConfigError

if TYPE_CHECKING:
    from conceptdict.concept_api import ExportConfig

NEEDS = {"concepts": "a concept dictionary (DICT_DIR)",
         "dictionary": "a dictionary (SAE_DIR, or the one a DICT_DIR was named from), with a README.md model card"}
"""What an export format reads, in words (:attr:`ExportFormat.needs`)."""


@dataclass(frozen=True)
class ExportFormat:
    """One format ``conceptdict export`` writes."""

    needs: Literal["concepts", "dictionary"]
    """What the source must be: "concepts", a concept dictionary; "dictionary", a dictionary in any format
    conceptdict reads (a concept dictionary stands for the dictionary it was named from)."""
    write: Callable[[Path, ExportConfig], Path]
    """(source, the export's settings) -> the main file or directory written, under ``settings.out``."""
    description: str
    """One line for ``conceptdict export --help``."""
    shows: str = "{format}: {written}"
    """What the command line prints after writing it: a template of ``format``, ``written`` and ``out``."""


BLOCK = 512
"""Concepts the json, html and neuronpedia exports read at a time (``naming.concepts_file.ConceptsFile``)."""


def write_json(source: Path, cfg: ExportConfig, block: int = BLOCK) -> Path:
    """The concept dictionary as conceptdict writes it (``concepts.json`` + ``concepts.safetensors``), read and
    written ``block`` concepts at a time: the files ``save_concepts(load_concepts(source), cfg.out)`` writes."""
    file = ConceptsFile(source)
    with ConceptsWriter(cfg.out, file.n_concepts, file.directions_shape) as out:
        for concepts, directions in file.blocks(block):
            out.add(concepts, directions)
        return out.finish(file.meta)


def write_html(source: Path, cfg: ExportConfig, block: int = BLOCK) -> Path:
    """The HTML report, with a CBM's pages when ``cfg.cbm`` names one fitted on this concept dictionary, the concepts
    read ``block`` at a time: the files ``write_report(load_concepts(source), ...)`` writes. A CBM is checked
    against the concept dictionary's names first (one pass that keeps only the names of the CBM's concepts)."""
    from conceptdict.naming.reports.report_stream import ReportWriter

    file = ConceptsFile(source)
    cbm = load_cbm(cfg.cbm) if cfg.cbm else None
    if cbm is not None:
        wanted = set(cbm.concept_ids)
        names = {c.id: c.name for concepts in file.concepts(block) for c in concepts if c.id in wanted}
        check_cbm_of(names, file.n_concepts, cbm, source, cfg.cbm)
    with ReportWriter(cfg.out, cfg.per_page) as out:
        for concepts in file.concepts(block):
            out.add(concepts)
        return out.finish(file.meta, cbm)


def write_neuronpedia(source: Path, cfg: ExportConfig, block: int = BLOCK) -> Path:
    """Neuronpedia's import files (naming.reports.neuronpedia), the concepts read ``block`` at a time."""
    from conceptdict.naming.reports.neuronpedia import (
        NeuronpediaConfig,
        export_neuronpedia,
    )

    np_cfg = NeuronpediaConfig(model_id=cfg.neuronpedia_model, source_set=cfg.source_set, creator=cfg.creator)
    return export_neuronpedia(source, cfg.out, np_cfg, device=cfg.device, block=block)


CONCEPT_FORMATS: dict[str, ExportFormat] = {
    "json": ExportFormat("concepts", write_json, "concepts.json + concepts.safetensors, as `conceptdict name` writes "
                         "them", "concept dictionary: {written}/concepts.json, {written}/concepts.safetensors"),
    "html": ExportFormat("concepts", write_html, "the HTML report; --cbm adds a CBM's pages", "report: {written}"),
    "neuronpedia": ExportFormat("concepts", write_neuronpedia, "Neuronpedia's import files",
                                "Neuronpedia export: {written} (features/, activations/, explanations/ + source "
                                "records)"),
}
"""format name -> :class:`ExportFormat`, for the formats of a concept dictionary."""


def export_formats() -> dict[str, ExportFormat]:
    """Every format ``conceptdict export`` writes, by name: :data:`CONCEPT_FORMATS`, then the dictionary layouts of
    ``saes.formats.export.WRITERS`` (both read at each call, so a format added at run time is listed)."""
    both = set(CONCEPT_FORMATS) & set(WRITERS)
    if both:
        raise ValueError(f"export format {sorted(both)} is both a concept dictionary's format and a dictionary layout; "
                         f"give one of them another name")
    layouts = {name: ExportFormat("dictionary", partial(write_dictionary, name), w.description,
                                  "{format} dictionary: {written}") for name, w in WRITERS.items()}
    return {**CONCEPT_FORMATS, **layouts}


def export_format(name: str) -> ExportFormat:
    """The format ``name``; a :class:`ConfigError` listing the formats otherwise."""
    formats = export_formats()
    if name not in formats:
        raise ConfigError(f"unknown export format {name!r}; choose one of {', '.join(formats)}")
    return formats[name]


def formats_help() -> str:
    """The formats in words, grouped by what they read (``--format``'s help)."""
    formats = export_formats()
    groups = [f"For {NEEDS[needs]}: " + "; ".join(f"{name} ({f.description})" for name, f in formats.items()
                                                  if f.needs == needs) for needs in NEEDS]
    return "What to write. " + ". ".join(groups) + "."


def write_export(source: Path, cfg: ExportConfig) -> Path:
    """Write ``source`` in ``cfg.format`` under ``cfg.out``; returns the main file or directory written."""
    fmt = export_format(cfg.format)
    if fmt.needs == "concepts" and not is_concept_dir(source):
        layouts = [name for name, f in export_formats().items() if f.needs == "dictionary"]
        raise ConfigError(f"{source} is not a concept dictionary (no concepts.json), which --format {cfg.format} "
                          f"writes; run `conceptdict name` first, or use --format {'|'.join(layouts)} for an SAE_DIR")
    return fmt.write(source, cfg)


def export_summary(name: str, written: Path, out: Path) -> str:
    """What the command line prints after writing format ``name``: its ``shows``, and the model card when one was
    written."""
    fmt = export_format(name)
    text = fmt.shows.format(format=name, written=written, out=out)
    card = Path(out) / "README.md"
    return f"{text} (model card: {card})" if fmt.needs == "dictionary" and card.exists() else text


def check_cbm_of(names: Mapping[int, str], n_concepts: int, cbm: CbmResult, source: Path, cbm_dir: Path) -> None:
    """Refuse a CBM fitted on another concept dictionary: its concepts must be the latents of ``source`` (of
    ``n_concepts``, whose ``names`` by id hold at least the CBM's) under the same names (a report mixing the two
    would show one dictionary's names beside the other's weights)."""
    wrong = [(i, n) for i, n in zip(cbm.concept_ids, cbm.concept_names) if not (0 <= i < n_concepts) or names[i] != n]
    if wrong:
        i, n = wrong[0]
        theirs = repr(names[i]) if 0 <= i < n_concepts else f"no latent {i}"
        raise ConfigError(f"--cbm {cbm_dir} was fitted on another concept dictionary ({cbm.meta.get('dict_dir', '?')}): "
                          f"its concept {i} is {n!r}, {source} has {theirs} ({len(wrong)} of {len(cbm.concept_ids)} "
                          f"differ); pass the CBM made from {source} (`conceptdict cbm {source} ...`)")


def write_dictionary(fmt: str, source: Path, cfg: ExportConfig) -> Path:
    """A dictionary (or a concept dictionary's) in layout ``fmt`` of ``saes.formats.export.WRITERS``, with a model
    card naming the model by its hub id; ``train --layers``' folder of per-layer transcoders as one set where the
    layout has a set writer."""
    from conceptdict.saes import open_dictionary
    from conceptdict.saes.formats import transcoder_set

    write_set = WRITERS[fmt].write_set
    layers = transcoder_set(source) if write_set is not None else []
    if layers:  # train --layers' OUT: one transcoder per MLP
        opened = [open_dictionary(d) for d in layers]
        return write_set([m for m, _ in opened], [c.get("hookpoints") or [] for _, c in opened], cfg.out,
                         hub_id_of(opened[0][1].get("model")) or None)
    ref = dictionary_of(source)
    # too large for memory, in a layout that streams: written a block of latents at a time (saes.lazy)
    model, config = open_dictionary(ref.path, lazy=None if WRITERS[fmt].streams else False)
    recorded = (ref.meta or {}).get("model") or config.get("model")
    hookpoint = (ref.meta or {}).get("hookpoint")
    eval_json = Path(ref.path) / "eval.json"
    evals = json.loads(eval_json.read_text()) if eval_json.exists() else None
    return export_dictionary(model, config, fmt, cfg.out, evals=evals, model_name=hub_id_of(recorded) or "",
                             hookpoint=hookpoint)
