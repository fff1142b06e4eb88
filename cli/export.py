"""``conceptdict export DICT_DIR|SAE_DIR --format json|saelens|html --out DIR``.

- ``json``: the concept dictionary (concepts.json + concepts.safetensors) of a DICT_DIR;
- ``html``: the static report of a DICT_DIR (with ``--cbm CBM_DIR``: plus the CBM pages);
- ``saelens``: SAELens ``cfg.json`` + ``sae_weights.safetensors`` of an SAE_DIR (or of the dictionary a
  DICT_DIR was named from).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config

HELP = "export a concept dictionary (json, html report) or a dictionary (SAELens layout)"


@dataclass
class ExportConfig:
    """Flags of ``conceptdict export``."""

    out: Path | None = None
    """Output directory."""
    format: Literal["json", "saelens", "html"] = "html"
    """json (concepts.json + concepts.safetensors), saelens (cfg.json + sae_weights.safetensors) or html."""
    cbm: Path | None = None
    """html only: a CBM directory whose pages are added to the report."""
    per_page: int = 200
    """html only: concept cards per page."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="a concept dictionary (DICT_DIR) or a dictionary (SAE_DIR)")
    add_dataclass_args(parser, ExportConfig)


def _saelens(source: Path, out: Path) -> Path:
    from conceptdict.naming import is_concept_dir, load_concepts
    from conceptdict.saes import export_saelens, load_dictionary, load_dictionary_config

    meta: dict = {}
    if is_concept_dir(source):
        cd = load_concepts(source)
        if not cd.meta.get("sae_dir"):
            raise ConfigError(f"{source} records no sae_dir; pass the SAE_DIR itself to --format saelens")
        meta = {"model_name": cd.meta.get("model"), "hook_name": cd.meta.get("hookpoint")}
        source = Path(cd.meta["sae_dir"])
    config = load_dictionary_config(source)
    meta.setdefault("model_name", config.get("model"))
    hook = config.get("hookpoints") or config.get("hookpoint")
    meta.setdefault("hook_name", hook[0] if isinstance(hook, list) and hook else hook)
    return export_saelens(load_dictionary(source), out, {k: v for k, v in meta.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from conceptdict.naming import is_concept_dir, load_cbm, load_concepts, save_concepts, write_report

    cfg = build_config(ExportConfig, args)
    if cfg.out is None:
        raise ConfigError("conceptdict export needs --out DIR")
    source = Path(args.source)
    if cfg.format == "saelens":
        out = _saelens(source, cfg.out)
        print(f"SAELens dictionary: {out}/cfg.json, {out}/sae_weights.safetensors")
        return 0
    if not is_concept_dir(source):
        raise ConfigError(f"{source} is not a concept dictionary (no concepts.json); run `conceptdict name` first, "
                          "or use --format saelens for an SAE_DIR")  # fmt: skip
    cd = load_concepts(source)
    if cfg.format == "json":
        save_concepts(cd, cfg.out)
        print(f"concept dictionary: {cfg.out}/concepts.json, {cfg.out}/concepts.safetensors")
        return 0
    index = write_report(cd, cfg.out, cbm=load_cbm(cfg.cbm) if cfg.cbm else None, per_page=cfg.per_page)
    print(f"report: {index}")
    return 0
