"""``conceptdict export DICT_DIR|SAE_DIR --format FORMAT --out DIR``: json, html and neuronpedia for a concept
dictionary; saelens, sparsify and dictionary-learning layouts (with a model card) for a dictionary."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_dataclass_args, settings_from
from conceptdict.concept_api import ExportConfig

USAGE = "conceptdict export DICT_DIR|SAE_DIR --format FORMAT --out DIR [options]"
HELP = ("export a concept dictionary (json, html report, Neuronpedia) or a dictionary (SAELens, sparsify, "
        "dictionary_learning layouts)")


def add_arguments(parser) -> None:
    parser.add_argument("source", type=Path, help="a concept dictionary (DICT_DIR) or a dictionary (SAE_DIR)")
    add_dataclass_args(parser, ExportConfig)


def run(args) -> int:
    settings = settings_from(args, ExportConfig)
    fmt = settings.get("format", "html")
    written = cd.export(args.source, **settings)
    if fmt in ("saelens", "sparsify", "dictionary-learning"):
        print(f"{fmt} dictionary: {written} (model card: {settings['out']}/README.md)")
    elif fmt == "neuronpedia":
        print(f"Neuronpedia export: {written} (features/, activations/, explanations/ + source records)")
    elif fmt == "json":
        print(f"concept dictionary: {written}/concepts.json, {written}/concepts.safetensors")
    else:
        print(f"report: {written}")
    if settings.get("push"):
        print(f"uploaded {settings['out']} to {settings['push']}")
    return 0
