"""The ``conceptdict`` command: thin glue over the three stages.

Each subcommand lives in its own module ``conceptdict.cli.<name>`` exposing::

    HELP: str                                  # one line for ``conceptdict --help``
    def add_arguments(parser) -> None          # flags, generated from the command's settings dataclasses
    def run(args) -> int                       # flags -> settings -> one ``conceptdict`` API call -> print

Modules are imported only when their command runs, so ``conceptdict --help`` stays fast and a
missing optional dependency of one command never breaks another.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import conceptdict

# command name -> module name (under conceptdict.cli)
COMMANDS: dict[str, str] = {
    "cache": "cache",
    "store": "store",
    "train": "train",
    "eval": "eval_cmd",
    "diff": "diff",
    "compare": "compare",
    "name": "name",
    "cbm": "cbm",
    "erase": "erase",
    "steer": "steer",
    "export": "export",
    "show": "show",
    "hookpoints": "hookpoints",
    "score": "score",
    "cbsae": "cbsae",
    "demo": "demo",
    "broad": "broad",
    "plan": "plan",
}


def _load(command: str):
    return importlib.import_module(f"conceptdict.cli.{COMMANDS[command]}")


# commands that write an --out directory (guarded by conceptdict.outdir) but whose own flags have no --overwrite:
# the guard's opt-in is added here
_ADD_OVERWRITE = ("compare", "name", "cbm", "cbsae", "erase", "steer", "export")


def _common() -> argparse.ArgumentParser:
    """Flags every command takes (before or after the command name)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    common.add_argument("--no-verify", action="store_true", default=argparse.SUPPRESS,
                        help="skip the shards' sha256 check (for stores `store verify` checked)")
    common.add_argument("--wait", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                        help="wait this long for another process writing a store")
    common.add_argument("--help-all", action="store_true", default=argparse.SUPPRESS,
                        help="describe every flag, not only the common ones")
    return common


class Formatter(argparse.HelpFormatter):
    """argparse's help layout, without breaking a flag name at its hyphens."""

    def _fill_text(self, text, width, indent):
        import textwrap

        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="conceptdict",
        description="Cache activations, train sparse dictionaries, name the concepts.",
        parents=[common],
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"conceptdict {conceptdict.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name, add_help=False)
            continue
        module = _load(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, parents=[common],
                           usage=getattr(module, "USAGE", None), formatter_class=Formatter)
        module.add_arguments(p)
        if name in _ADD_OVERWRITE:
            try:
                p.add_argument("--overwrite", action="store_true",
                               help="write into --out even when it holds files conceptdict did not create")
            except argparse.ArgumentError:
                pass  # the command has its own --overwrite
    return parser


def _unknown_flags(command: str, unknown: list[str]) -> None:
    """Exit with ``command``'s usage and one line saying, for each unknown flag, which commands take it, or which of
    the command's own flags it is close to (``cbm --broad``: `conceptdict broad` is a command of its own)."""
    import difflib

    commands = build_parser()._subparsers._group_actions[0].choices  # every command's parser
    own = commands[command]
    hints = []
    for flag in (a.split("=", 1)[0] for a in unknown if a.startswith("--")):
        takers = [name for name, p in commands.items() if name != command and flag in p._option_string_actions]
        close = difflib.get_close_matches(flag, [o for o in own._option_string_actions if o.startswith("--")], n=1,
                                          cutoff=0.8)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
            continue
        if flag[2:] in COMMANDS:
            hints.append(f"`conceptdict {flag[2:]}` is a command of its own: run it first and pass {command} the "
                         "directory it writes")
        if takers:
            hints.append(f"{flag} is a flag of `conceptdict {'`, `conceptdict '.join(takers)}`, not of {command}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    own.error(f"unrecognized arguments: {' '.join(unknown)}{hint}; `conceptdict {command} --help` lists its flags")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from conceptdict.cli import args as flags

    flags.SHOW_ALL = flags.HELP_ALL in argv
    argv = ["--help" if a == flags.HELP_ALL else a for a in argv]
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(command)
    args, rest = parser.parse_known_args(argv)
    if rest:  # the common flags after a nested command (`store info DIR --debug`); anything else is an error
        common = _common()
        common.prog = parser.prog
        known, unknown = common.parse_known_args(rest)
        if unknown and args.command is not None:
            _unknown_flags(args.command, unknown)
        for key, value in vars(common.parse_args(rest)).items():
            setattr(args, key, value)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from conceptdict import set_read_policy
    from conceptdict.cli.errors import describe_failure

    set_read_policy(verify_hash=not getattr(args, "no_verify", False), wait_for_writer=getattr(args, "wait", 0.0))
    try:  # the API guards each --out (conceptdict.outdir): a user's files, one writer, not inside an input
        from conceptdict.ranks import refuse_ranks

        refuse_ranks(args.command)  # under torchrun: only the commands that split their work over ranks
        return int(_load(args.command).run(args) or 0)
    except BaseException as e:  # noqa: BLE001 - one boundary: known failures become one line
        message = describe_failure(e)
        if message is None or getattr(args, "debug", False) or args.verbose:
            raise
        print(f"conceptdict {args.command}: error: {message}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        from conceptdict import ranks

        ranks.leave()


if __name__ == "__main__":
    sys.exit(main())
