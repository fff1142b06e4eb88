"""Never write over a user's files: a command's ``--out`` directory must be new, empty, or conceptdict's own.

A directory is conceptdict's own when it holds the marker :data:`MARKER` (written when a command first
claims the directory, before anything else, so a killed run's directory is still recognised when the
same command resumes) or when every entry in it is a name conceptdict writes that a user would not
(``manifest.json``, ``shard-*.safetensors``, ``checkpoint.pt`` ...; not ``index.html``). Anything else is
refused unless ``--overwrite``. On failure, :func:`release` removes what the claim itself made (an empty
directory with only the marker) and temporary files the failed command left in it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import time
from pathlib import Path

MARKER = ".conceptdict-output.json"
# Names only conceptdict writes (a directory holding nothing else predates the marker, or is a killed run).
OWN_NAMES = (
    MARKER, ".conceptdict-writer.lock", "manifest.json", "shard-*.safetensors", "tokenizer", "*_config.json",
    "config.json", "weights.safetensors", "checkpoint.pt", "metrics.jsonl", "eval.json", "concepts.json",
    "concepts.safetensors", "cbm.json", "cbm.safetensors", "cfg.json", "sae_weights.safetensors", "diff.json",
    "latents.csv", "stores", "crosscoder", "parts", "report", ".demo", "*.tmp", ".*.tmp-*", ".tokenizer.tmp",
)
MARKERS = (MARKER, ".demo")  # .demo: `conceptdict demo`'s record of finished steps, older than MARKER
TEMPORARIES = ("*.tmp", f".*.tmp-{os.getpid()}", ".tokenizer.tmp")


def _own(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in OWN_NAMES)


def claim(out: Path, command: str, overwrite: bool) -> bool:
    """Check that ``command`` may write into ``out`` and mark it as conceptdict's; returns whether the
    directory was created here. Raises FileExistsError naming a foreign file unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory; choose a directory path")
    created = not out.exists()
    if not created and not any((out / m).exists() for m in MARKERS):
        foreign = sorted(p.name for p in out.iterdir() if not _own(p.name))
        if foreign and not overwrite:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise FileExistsError(f"--out {out} holds files conceptdict did not create ({shown}); choose a new or "
                                  "empty directory, or pass --overwrite to write into it anyway")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():
        (out / MARKER).write_text(json.dumps({"created_by": f"conceptdict {command}",
                                              "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return created


def release(out: Path, created: bool, since: float) -> None:
    """After a failed command: remove temporaries modified since ``since`` (top level and one below), and
    the directory itself when the claim created it and nothing else was written."""
    from conceptdict.activations.lock import being_written

    out = Path(out)
    if not out.is_dir() or being_written(out) is not None:
        return  # another process writes there: its temporaries are not ours to remove
    for pattern in TEMPORARIES:
        for path in [*out.glob(pattern), *out.glob(f"*/{pattern}")]:
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime >= since - 1:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    if created and {p.name for p in out.iterdir()} <= {MARKER}:
        with contextlib.suppress(OSError):
            (out / MARKER).unlink(missing_ok=True)
            out.rmdir()
