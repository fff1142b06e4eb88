"""Known failure types -> the one line ``conceptdict`` prints instead of a traceback (``--debug`` shows it).

The stages raise precise errors where a failure happens (``StoreError``, ``CorruptFileError``,
``ConfigError``, ValueError naming the value and the fix); this module only words what arrives from
the platform (a full disk, a missing GPU, a damaged file found by a library). Anything not recognised
returns None and keeps its traceback: that is a bug to report.
"""

from __future__ import annotations

import errno
import os

_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)
_CUDA_MISSING = ("Torch not compiled with CUDA", "no CUDA GPUs are available", "Found no NVIDIA driver",
                 "CUDA driver initialization failed", "Invalid device id", "invalid device ordinal")
_NO_SPACE = ("No space left on device", "os error 28", "Disk quota exceeded")
_WRITE_FAILED = ("file write failed", "unexpected pos", "PytorchStreamWriter failed")


def _disk_full(where: str | None) -> str:
    place = f"{os.path.dirname(os.path.abspath(where)) or '/'} (writing {where})" if where else "the output's disk"
    return f"no space left on {place}: free some space or write to another --out (nothing partial was kept)"


def _oserror(e: OSError) -> str:
    where = e.filename or "a file"
    if e.errno in _DISK_FULL:
        return _disk_full(e.filename)
    if e.errno in _NO_ACCESS:
        return f"permission denied for {where} ({e.strerror}): choose a path you can write, or fix its permissions"
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)) and not e.filename:
        return str(e)
    return f"{e.strerror or e}: {where}" if e.filename else str(e)


def describe_failure(e: BaseException) -> str | None:
    """The one-line message for a known failure, or None to show the traceback."""
    from safetensors import SafetensorError

    text = str(e)
    if type(e) is RuntimeError and e.__cause__ is not None:  # e.g. the store writer thread's error, wrapped
        inner = describe_failure(e.__cause__)
        if inner is not None:
            return inner
    if isinstance(e, KeyboardInterrupt):
        return "interrupted; temporary files were removed, and re-running the same command resumes where it can"
    if isinstance(e, OSError):
        return _oserror(e)
    if isinstance(e, (AssertionError, RuntimeError)) and any(s in text for s in _CUDA_MISSING):
        return f"CUDA is not available ({text.splitlines()[0]}); use --device cpu"
    if isinstance(e, RuntimeError) and "out of memory" in text.lower():
        return f"out of memory ({text.splitlines()[0][:160]}); lower --batch-size (or --latents), or use a larger device"
    if isinstance(e, RuntimeError) and any(s in text for s in _WRITE_FAILED):
        return f"a write failed, most likely a full disk ({text.splitlines()[0][:160]}); free space or use another --out"
    if any(s in text for s in _NO_SPACE):  # a library's words for ENOSPC (safetensors, torch.save)
        return _disk_full(None)
    if isinstance(e, SafetensorError):
        return (f"a .safetensors file is truncated or not safetensors ({text}); run `conceptdict store verify` on "
                "the store, or re-save the file")
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not valid {e.encoding} ({text}); re-save it as UTF-8 (for datasets: pass --encoding)"
    if isinstance(e, (ValueError, FloatingPointError)):  # ConfigError, StoreError, bad values, a diverged run:
        return text  # worded where raised
    if isinstance(e, KeyError):
        return f"a file lacks the key {text}; it is damaged or from another tool (--debug shows which file)"
    return None
