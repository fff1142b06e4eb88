"""Reading and writing the files of a training run so that damage is named, not a traceback.

- :func:`read_checkpoint`: ``torch.load(weights_only=True)`` of a ``checkpoint.pt``; a truncated or foreign
  file raises :class:`CorruptFileError` naming it and the fix.
- :func:`write_atomic`: write through a temporary name, fsync, rename; the temporary is removed when the
  write fails (a full disk leaves nothing half-written behind).

Weight files of dictionaries are read by ``saes.formats.files`` (whose ``FormatError`` is a ``CorruptFileError``).
"""

from __future__ import annotations

import errno
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


class CorruptFileError(ValueError):
    """A file that exists but cannot be read as what it should be; the message names it and the fix."""


def read_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The training state saved at ``path`` (tensors and plain values only); ``mmap``: its tensors memory-mapped
    from the file (read as they are touched: a latent shard reads its slices of another shard count's files)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: run without --resume to start training there")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except PermissionError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CorruptFileError(f"checkpoint {path} is truncated or corrupt ({str(e).split('. ')[0][:120]}); it "
                               "cannot be resumed from: delete it and train again without --resume (or with "
                               "--overwrite)") from None
    if not isinstance(state, dict):
        raise CorruptFileError(f"checkpoint {path} does not hold a training state; delete it and train again")
    return state


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(fh)`` into a temporary next to ``path``, fsync, rename over ``path``; no temporary survives
    a failure."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # write/fsync errors name no file: name it
            raise OSError(e.errno, e.strerror, str(path)) from e
        if isinstance(e, RuntimeError) and any(s in str(e) for s in ("write failed", "unexpected pos")):
            raise OSError(errno.EIO, f"writing failed, most likely a full disk ({str(e).splitlines()[0][:100]})",
                          str(path)) from e  # torch.save's own wording of a short write
        raise
