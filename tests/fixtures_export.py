"""Minimal example export formats, as test fixtures (not product formats): what a new format needs is its writer
and one line in a table. ``torch-state`` is a dictionary layout (a line of ``saes.formats.export.WRITERS``),
``names-txt`` a concept dictionary's format (a line of ``conceptdict.export_formats.CONCEPT_FORMATS``);
tests/test_export_formats.py adds them at run time and exports through ``cd.export`` and the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conceptdict.export_formats import ExportFormat
from conceptdict.naming import load_concepts
from conceptdict.saes import SparseCoder
from conceptdict.saes.formats.export import Writer

STATE_FILE = "state.pt"
NAMES_FILE = "names.txt"


def write_state(model: SparseCoder, out: Path, *, config: dict[str, Any], model_name: str | None,
                hookpoint: str | None) -> Path:
    """The dictionary's state dict in one torch file (what a layout's ``export`` does: write under ``out``, return
    where the dictionary went)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"kind": model.kind, "hookpoint": hookpoint, "state": model.state_dict()}, out / STATE_FILE)
    return out


def write_names(source: Path, cfg) -> Path:
    """One concept name per line, by latent id."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / NAMES_FILE
    path.write_text("".join(f"{name}\n" for name in load_concepts(source).names))
    return path


STATE_LAYOUT = Writer(write_state, "a torch.save of the state dict (a test layout)", "torch")
NAMES_FORMAT = ExportFormat("concepts", write_names, "one concept name per line (a test format)",
                            "names: {written}")
