"""Never write over a user's files, and one writer per output directory.

Every command that writes a directory (``--out``; in Python ``out=``) runs inside :func:`writing`:

1. ``--out`` must not be one of the command's inputs or lie inside one (``cbm --out CONCEPTS_DIR`` would
   replace the report it reads);
2. the directory's writer lock is taken (the store's lock, :mod:`conceptdict.activations.lock`): a second
   command writing the same directory stops at once and names the first (pid, host, command); a lock whose
   process died is stale and taken over;
3. the directory is claimed: it is conceptdict's own only when it holds the marker :data:`MARKER`, which the
   first command writes into it before anything else (so a killed run's directory is recognised when it
   resumes). A directory without the marker that holds anything is the user's, whatever its files are called,
   and is refused unless ``overwrite``;
4. on failure, :func:`release` removes the temporaries the command left and, when the claim made the marker
   (or the directory) and nothing else was written, the marker (and the directory) again.

Under torchrun every rank claims (the check is the same on each), and rank 0 alone holds the lock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from conceptdict.activations.lock import LOCK_NAME, being_written, writer_lock

MARKER = ".conceptdict-output.json"
MARKERS = (MARKER, ".demo")  # .demo: `conceptdict demo`'s record of finished steps, older than MARKER
TEMPORARIES = ("*.tmp", f".*.tmp-{os.getpid()}", ".tokenizer.tmp")
# what makes a directory an input artifact (ours, or another SAE tool's) whose inside --out must not be
ARTIFACT_NAMES = (*MARKERS, "manifest.json", "config.json", "cfg.json", "concepts.json", "cbm.json")
INPUT_SETTINGS = ("store", "stores", "store_b", "sae", "cbm", "apply", "dataset", "dictionary", "concepts")


class Claim:
    """What :func:`claim` made: the directory itself, and the marker."""

    def __init__(self, created: bool, marked: bool) -> None:
        self.created, self.marked = created, marked


def claim(out: Path, command: str, overwrite: bool) -> Claim:
    """Check that ``command`` may write into ``out`` and mark it as conceptdict's. Raises FileExistsError naming a
    file of the user's unless ``overwrite``."""
    out = Path(out)
    _not_a_file(out)
    created = not out.exists()
    if not created and not any((out / m).exists() for m in MARKERS):
        # a marker that appeared since the check above is ours: under torchrun rank 0 writes it while another rank
        # looks (seen as "holds files conceptdict did not create (.conceptdict-output.json)")
        foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME and p.name not in MARKERS)
        if foreign and not overwrite:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise FileExistsError(f"--out {out} holds files conceptdict did not create ({shown}); choose a new or "
                                  "empty directory, or pass --overwrite to write into it anyway")
    out.mkdir(parents=True, exist_ok=True)
    marked = not (out / MARKER).exists()
    if marked:
        (out / MARKER).write_text(json.dumps({"created_by": f"conceptdict {command}",
                                              "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return Claim(created, marked)


def release(out: Path, made: Claim, since: float) -> None:
    """After a failed command: remove temporaries modified since ``since`` (top level and one below), and what the
    claim made (the marker, the directory) when nothing else was written."""
    out = Path(out)
    if not out.is_dir() or being_written(out) is not None:
        return  # another process writes there: its temporaries are not ours to remove
    for pattern in TEMPORARIES:
        for path in [*out.glob(pattern), *out.glob(f"*/{pattern}")]:
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime >= since - 1:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    if made.marked and {p.name for p in out.iterdir()} <= {MARKER, LOCK_NAME}:
        with contextlib.suppress(OSError):
            (out / MARKER).unlink(missing_ok=True)
            if made.created and not (out / LOCK_NAME).exists():
                out.rmdir()


def _not_a_file(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory; choose a directory path")


def check_not_inside(out: Path, inputs: Iterable[Any]) -> None:
    """Refuse an ``out`` that is one of the command's input directories or lies inside one."""
    where = Path(os.path.realpath(out))
    for value in inputs:
        if not isinstance(value, (str, Path)) or not any((Path(value) / n).exists() for n in ARTIFACT_NAMES):
            continue
        source = Path(os.path.realpath(value))
        if where == source or source in where.parents:
            raise FileExistsError(f"--out {out} is {'the input' if where == source else 'inside the input'} "
                                  f"{value}: writing there would replace what the command reads; choose a directory "
                                  "outside it")


def _main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun's rank; only rank 0 holds a directory's lock


@contextlib.contextmanager
def writing(out: str | Path, command: str, overwrite: bool = False, inputs: Iterable[Any] = (),
            lock: bool = True) -> Iterator[Path]:
    """Hold ``out`` for ``command`` for the ``with`` block: not an input, locked, claimed (see the module doc).
    ``lock=False``: the command takes the directory's lock itself (a store's writer holds it while it writes, and
    releases it before the other ranks of a torchrun job open the finished store)."""
    out = Path(out)
    check_not_inside(out, inputs)
    _not_a_file(out)  # before the lock, which makes the directory
    started = time.time()
    new_parents = [p for p in out.absolute().parents if not p.exists()]  # made by mkdir(parents=True)
    lock = writer_lock(out, what="--out") if lock and _main_rank() else contextlib.nullcontext()
    try:
        with lock:  # first: a second writer stops here, before it touches the directory (and removes it again
            made = claim(out, command, overwrite)  # when it made it and the claim's release left it empty)
            try:
                yield out
            except BaseException:
                release(out, made, started)
                raise
    except BaseException:
        for parent in new_parents:  # innermost first; only while empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _inputs(args: tuple, settings: dict[str, Any]) -> list[Any]:
    found: list[Any] = []
    for value in [*args, *(settings.get(k) for k in INPUT_SETTINGS)]:  # an object the API returned: its folder
        found.extend(getattr(v, "path", v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return found


def guarded(command: str, own_overwrite: bool = False, lock: bool = True) -> Callable:
    """Run an API function that writes ``out=`` inside :func:`writing` (``lock``: see there). ``overwrite=`` is the
    guard's opt-in; it is passed on to the function only when its settings have their own ``overwrite``
    (``own_overwrite``)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **settings: Any) -> Any:
            overwrite = bool(settings.get("overwrite") if own_overwrite else settings.pop("overwrite", False))
            if settings.get("out") is None:
                return fn(*args, **settings)
            with writing(settings["out"], command, overwrite, _inputs(args, settings), lock):
                return fn(*args, **settings)

        return run

    return wrap
