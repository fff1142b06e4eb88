"""``conceptdict export DICT_DIR|SAE_DIR --format FORMAT --out DIR``.

- ``json``: the concept dictionary (concepts.json + concepts.safetensors) of a DICT_DIR;
- ``html``: the static report of a DICT_DIR (with ``--cbm CBM_DIR``: plus the CBM pages);
- ``neuronpedia``: the files Neuronpedia imports for one source (``naming.neuronpedia``) of a DICT_DIR;
- ``saelens`` / ``sparsify`` / ``dictionary-learning``: the dictionary of an SAE_DIR (any format
  ``saes.formats`` reads, or the one a DICT_DIR was named from) in that library's layout, with a model-card
  README.md (``saes.formats.export``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config

HELP = ("export a concept dictionary (json, html report, Neuronpedia) or a dictionary (SAELens, sparsify, "
        "dictionary_learning layouts)")
DICTIONARY_FORMATS = ("saelens", "sparsify", "dictionary-learning")


@dataclass
class ExportConfig:
    """Flags of ``conceptdict export``."""

    out: Path | None = None
    """Output directory."""
    format: Literal["json", "html", "neuronpedia", "saelens", "sparsify", "dictionary-learning"] = "html"
    """json (concepts.json + concepts.safetensors), html, neuronpedia (Neuronpedia's import files), or a
    dictionary layout: saelens, sparsify, dictionary-learning (each with a README.md model card)."""
    cbm: Path | None = None
    """html only: a CBM directory whose pages are added to the report."""
    per_page: int = 200
    """html only: concept cards per page."""
    neuronpedia_model: str | None = None
    """neuronpedia only: the Neuronpedia model id; default: the last part of the recorded model name."""
    source_set: str = "conceptdict"
    """neuronpedia only: the source set name (the source id is LAYER-SOURCE_SET)."""
    creator: str = "conceptdict"
    """neuronpedia only: creator name and id the records are filed under."""
    device: str = "cpu"
    """neuronpedia only: device for re-encoding the top examples."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="a concept dictionary (DICT_DIR) or a dictionary (SAE_DIR)")
    add_dataclass_args(parser, ExportConfig)


def _dictionary(source: Path, fmt: str, out: Path) -> Path:
    import json

    from conceptdict.naming import is_concept_dir, load_concepts
    from conceptdict.saes import open_dictionary
    from conceptdict.saes.formats.export import export_dictionary

    names: dict = {}
    if is_concept_dir(source):
        cd = load_concepts(source)
        if not cd.meta.get("sae_dir"):
            raise ConfigError(f"{source} records no sae_dir; pass the SAE_DIR itself to --format {fmt}")
        names = {"model_name": cd.meta.get("model"), "hookpoint": cd.meta.get("hookpoint")}
        source = Path(cd.meta["sae_dir"])
    model, config = open_dictionary(source)
    eval_json = source / "eval.json"
    evals = json.loads(eval_json.read_text()) if eval_json.exists() else None
    return export_dictionary(model, config, fmt, out, evals=evals, **names)


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import is_concept_dir, load_cbm, load_concepts, save_concepts, write_report

    cfg = build_config(ExportConfig, args)
    if cfg.out is None:
        raise ConfigError("conceptdict export needs --out DIR")
    source = Path(args.source)
    if cfg.format in DICTIONARY_FORMATS:
        out = _dictionary(source, cfg.format, cfg.out)
        print(f"{cfg.format} dictionary: {out} (model card: {cfg.out}/README.md)")
        return 0
    if not is_concept_dir(source):
        raise ConfigError(f"{source} is not a concept dictionary (no concepts.json); run `conceptdict name` first, "
                          f"or use --format {'|'.join(DICTIONARY_FORMATS)} for an SAE_DIR")  # fmt: skip
    if cfg.format == "neuronpedia":
        from conceptdict.naming.neuronpedia import NeuronpediaConfig, export_neuronpedia

        np_cfg = NeuronpediaConfig(model_id=cfg.neuronpedia_model, source_set=cfg.source_set, creator=cfg.creator)
        where = export_neuronpedia(source, cfg.out, np_cfg, device=cfg.device)
        print(f"Neuronpedia export: {where} (features/, activations/, explanations/ + source records)")
        return 0
    cd = load_concepts(source)
    if cfg.format == "json":
        save_concepts(cd, cfg.out)
        print(f"concept dictionary: {cfg.out}/concepts.json, {cfg.out}/concepts.safetensors")
        return 0
    index = write_report(cd, cfg.out, cbm=load_cbm(cfg.cbm) if cfg.cbm else None, per_page=cfg.per_page)
    print(f"report: {index}")
    return 0
