"""One writer per store: an advisory lock file ``.conceptdict-writer.lock`` in the store directory.

The writer holds an exclusive ``flock`` on the file and writes its pid, host, command and start time
into it. The kernel drops the ``flock`` when the writer dies, however it dies, so a lock file nobody
holds is stale by construction: the next writer takes it over (and says so) without guessing from pids.
A second writer fails at once with :class:`StoreLocked` naming the first. Readers
(:func:`wait_for_writer`) refuse a store whose lock is held, or wait for it when asked to.

Platforms without ``fcntl`` fall back to the pid: a lock file whose pid is not alive on this host is stale.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from conceptdict.activations.store import StoreError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".conceptdict-writer.lock"
_HELD: set[str] = set()  # store directories this process is writing (its own readers may read them)


class StoreLocked(StoreError):
    """The store is being written by another process; the message names it."""


def _owner(path: Path) -> dict:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process (its lock file is empty)"
    return (f"pid {owner.get('pid')} on host {owner.get('host')} (`{owner.get('command')}`, since "
            f"{owner.get('started')})")


def _pid_alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell for another host
    try:
        os.kill(int(owner.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


def _try_lock(fd: int, shared: bool = False) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _acquire(path: Path, what: str) -> int:
    """An fd holding the exclusive lock on ``path``; raises StoreLocked when another process holds it."""
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        owner = _owner(path)
        got = _try_lock(fd)
        if fcntl is None and owner and owner.get("pid") != os.getpid() and _pid_alive(owner):
            got = False
        if not got:
            for _ in range(20):  # the holder writes its record just after it takes the lock
                owner = owner or _owner(path)
                if owner:
                    break
                time.sleep(0.05)
            os.close(fd)
            raise StoreLocked(f"{what} {path.parent} is being written by {_describe(owner)}; wait for it to "
                              f"finish, or write to another --out (if that process is gone, delete {path})")
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file the previous holder unlinked while we waited
            if owner:
                log.warning("taking over the stale writer lock of %s at %s (that process is gone)",
                            _describe(owner), path.parent)
            return fd
        os.close(fd)
    raise StoreLocked(f"could not take the writer lock {path}: it keeps being replaced; retry")


def _acquire_waiting(path: Path, what: str, wait: float, poll: float) -> int:
    """:func:`_acquire`, trying again every ``poll`` seconds for up to ``wait`` seconds while another process holds
    the lock (logged once); the last StoreLocked is raised when the time is up."""
    deadline, said = time.monotonic() + wait, False
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)  # the holder removes the folder it made when it leaves it empty
        try:
            return _acquire(path, what)
        except StoreLocked as e:
            if time.monotonic() >= deadline:
                raise
            if not said:
                log.warning("%s; waiting for it to finish", e)
                said = True
            time.sleep(poll)


@contextlib.contextmanager
def writer_lock(directory: Path, what: str = "store", wait: float = 0.0, poll: float = 5.0) -> Iterator[Path]:
    """Hold the writer lock of ``directory`` (a store, or a command's --out: ``what`` names it in the message) for
    the ``with`` block; creates the directory and removes it again when it was created here and is left empty.
    Re-entrant within a process: a block inside another one for the same directory holds the same lock. While
    another process holds it: raise StoreLocked at once, or after waiting up to ``wait`` seconds (``math.inf``:
    until it is free), trying again every ``poll`` seconds and saying so once."""
    directory = Path(directory)
    key = os.path.realpath(directory)
    if key in _HELD:
        yield directory / LOCK_NAME
        return
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = _acquire_waiting(path, what, wait, poll)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(info) + "\n").encode())
    os.fsync(fd)
    _HELD.add(key)
    try:
        yield path
    finally:
        _HELD.discard(key)
        path.unlink(missing_ok=True)  # before the unlock: a waiter then sees a replaced file and retries
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only succeeds when empty


def being_written(directory: Path) -> dict | None:
    """The owner record of a live writer of ``directory`` (another process), or None."""
    path = Path(directory) / LOCK_NAME
    if os.path.realpath(directory) in _HELD or not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        owner = _owner(path)
        free = _try_lock(fd, shared=True) if fcntl is not None else not (owner and _pid_alive(owner))
    finally:
        os.close(fd)
    return None if free else owner


def wait_for_writer(directory: Path, wait: float = 0.0, poll: float = 0.5) -> None:
    """Return once no other process writes ``directory``; raise StoreLocked after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        owner = being_written(directory)
        if owner is None:
            return
        if time.monotonic() >= deadline:
            raise StoreLocked(f"store {directory} is being written by {_describe(owner)}; wait for it to finish "
                              "(or pass --wait SECONDS to wait here)")
        time.sleep(poll)
