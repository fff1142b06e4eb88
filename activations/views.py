"""A store read under another hookpoint name, so that two stores whose hookpoints are spelled differently
(e.g. arrays imported as ``base.npy`` and ``chat.npy``) can be streamed together as one aligned source pair."""

from __future__ import annotations

from typing import Any

from conceptdict.activations.store import ActivationStore


class RenamedHookpoint:
    """``store`` with its hookpoint ``name`` answering to ``alias``; every other attribute is the store's."""

    def __init__(self, store: ActivationStore, name: str, alias: str) -> None:
        if name not in store.hookpoints:
            raise ValueError(f"hookpoint {name!r} is not in store {store.path}; it has {store.hookpoints}")
        self._store, self._name, self._alias = store, name, alias

    def _real(self, hookpoint: str) -> str:
        return self._name if hookpoint == self._alias else hookpoint

    @property
    def hookpoints(self) -> list[str]:
        return [self._alias if h == self._name else h for h in self._store.hookpoints]

    def d_in(self, hookpoint: str) -> int:
        return self._store.d_in(self._real(hookpoint))

    def rows(self, hookpoint: str, start: int, stop: int):
        return self._store.rows(self._real(hookpoint), start, stop)

    def iter_rows(self, hookpoint: str, chunk: int = 8192):
        return self._store.iter_rows(self._real(hookpoint), chunk)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._store, attr)
