"""``conceptdict demo``: the whole flow on the embedded default (what ``make demo`` runs)."""

from pathlib import Path

import conceptdict as cd

HELP = "run the whole flow on the embedded default model and the standard-library docstrings"


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output root (default: runs/demo)")
    parser.add_argument("--fresh", action="store_true", help="redo every step instead of reusing finished ones")
    parser.add_argument("--fast", action="store_true", help="a small slice of the data (for smoke tests)")
    parser.add_argument("--broad", action="store_true",
                        help="build the broad dictionary if it is not cached (about 15 minutes once on 2 cores)")


def run(args) -> int:
    status, summary = cd.demo(args.out, fast=args.fast, fresh=args.fresh, broad=args.broad)
    print("\n".join(status))
    print()
    print("\n\n".join(summary))
    return 0
