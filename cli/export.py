"""``conceptdict export DICT_DIR|SAE_DIR --format FORMAT --out DIR``: json, html and neuronpedia for a concept
dictionary; saelens, sparsify, dictionary-learning and circuit-tracer layouts (with a model card) for a dictionary.
The formats, their help and what is printed come from ``conceptdict.export_formats``."""

from pathlib import Path

import conceptdict as cd
from conceptdict.cli.args import add_dataclass_args, settings_from
from conceptdict.concept_api import ExportConfig
from conceptdict.export_formats import export_formats, export_summary, formats_help

USAGE = "conceptdict export DICT_DIR|SAE_DIR --format FORMAT --out DIR [options]"
HELP = ("export a concept dictionary (json, html report, Neuronpedia) or a dictionary (SAELens, sparsify, "
        "dictionary_learning, circuit-tracer layouts)")


def add_arguments(parser) -> None:
    parser.add_argument("source", type=Path, help="a concept dictionary (DICT_DIR) or a dictionary (SAE_DIR)")
    # the formats are read when the parser is built, so that one added at run time is a choice
    parser.add_argument("--format", dest="format", default=None, choices=list(export_formats()), metavar="FORMAT",
                        help=f"{formats_help()} (default: {ExportConfig.format})".replace("%", "%%"))
    add_dataclass_args(parser, ExportConfig, skip=("format",))


def run(args) -> int:
    settings = settings_from(args, ExportConfig)
    fmt = settings.get("format", ExportConfig.format)
    written = cd.export(args.source, **settings)
    print(export_summary(fmt, written, settings["out"]))
    if settings.get("push"):
        print(f"uploaded {settings['out']} to {settings['push']}")
    return 0
