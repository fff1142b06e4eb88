"""The ``conceptdict`` command: thin glue over the three stages.

Each subcommand lives in its own module ``conceptdict.cli.<name>`` exposing::

    HELP: str                                  # one line for ``conceptdict --help``
    def add_arguments(parser) -> None          # flags, mostly generated from a stage config
    def run(args) -> int                       # the work; returns the exit status

Modules are imported only when their command runs, so ``conceptdict --help`` stays fast and a
missing optional dependency of one command never breaks another.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# command name -> module name (under conceptdict.cli)
COMMANDS: dict[str, str] = {
    "cache": "cache",
    "store": "store",
    "train": "train",
    "eval": "eval_cmd",
    "diff": "diff",
    "name": "name",
    "cbm": "cbm",
    "export": "export",
    "show": "show",
    "demo": "demo",
}


def _load(command: str):
    return importlib.import_module(f"conceptdict.cli.{COMMANDS[command]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conceptdict",
        description="Cache activations, train sparse dictionaries, name the concepts.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, add_help=False)
            continue
        module = _load(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from conceptdict.cli.args import ConfigError

    try:
        return int(_load(args.command).run(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        if args.verbose:
            raise
        print(f"conceptdict {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
