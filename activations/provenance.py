"""Whether a store passed to ``eval`` / ``compare`` holds the activations a dictionary was trained on.

A dictionary records the store(s) it was trained on (config.json's ``stores``). A store passed in a recorded
one's place is refused when it holds another model's activations, or when either store does not record its model
(an imported array) so that nothing shows the two hold the same model's activations: a dictionary measured on
another model's rows gives meaningless numbers (an FVU in the hundreds). A store of the same model over other
text is a legitimate out-of-distribution check: it is read, with a warning naming both stores."""

from __future__ import annotations

import logging
from pathlib import Path

from conceptdict.activations.store import read_manifest

log = logging.getLogger(__name__)


def _manifest(path: str | Path) -> dict | None:
    try:
        return read_manifest(Path(path).expanduser())
    except Exception:  # noqa: BLE001 - an unreadable store records nothing; opening it says why
        return None


def _readable(path: str | Path) -> bool:
    return _manifest(path) is not None


def store_model(path: str | Path) -> str | None:
    """The model a store's manifest records (hub id or local directory), None when it records none or the store
    cannot be read."""
    return ((_manifest(path) or {}).get("model") or {}).get("id")


def same_path(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_replacement(dictionary: str | Path, recorded: str | Path | None, given: str | Path | None,
                      flag: str = "--store") -> None:
    """Refuse (ValueError) or warn when ``given`` (``flag``'s store) replaces the store ``dictionary`` records
    (module docstring); nothing when either is None or they are the same folder."""
    if recorded is None or given is None or same_path(recorded, given):
        return
    if not Path(recorded).exists():
        log.warning("%s was trained on %s, which no longer exists; evaluating it on %s %s", dictionary, recorded,
                    flag, given)
        return
    if not _readable(given):
        return  # opening it says what is wrong with it
    was, now = store_model(recorded), store_model(given)
    if was is None or now is None or was != now:
        why = (f"it holds model {now}'s activations, {recorded} model {was}'s" if was and now else
               f"{recorded if was is None else given} records no model, so nothing shows both hold one model's "
               f"activations")
        raise ValueError(f"{flag} {given} is not the store {dictionary} was trained on ({recorded}): {why}; drop "
                         f"{flag} to evaluate it on its own store")
    log.warning("%s was trained on %s; evaluating it on %s %s, the same model (%s) over other data", dictionary,
                recorded, flag, given, now)
