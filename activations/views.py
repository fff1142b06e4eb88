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


class PatchRows:
    """A patch-level image store without its CLS rows (``position`` -1): rows, labels and context indices of
    the patch tokens only, renumbered 0..P_total-1, so per-image pooling (``cbm --pooling super``) runs over
    patch tokens as SuperActivator defines it. Every other attribute is the store's."""

    def __init__(self, store: ActivationStore) -> None:
        self._store = store
        self._keep = store.position(0, store.num_rows) >= 0
        self.num_rows = int(self._keep.sum())

    def iter_rows(self, hookpoint: str, chunk: int = 8192):
        out = 0
        for start, x in self._store.iter_rows(hookpoint, chunk):
            kept = x[self._keep[start:start + x.shape[0]]]
            yield out, kept
            out += kept.shape[0]

    def rows(self, hookpoint: str, start: int, stop: int):
        index = self._keep.nonzero().flatten()[start:stop]
        if not len(index):
            return self._store.rows(hookpoint, 0, 0)
        lo, hi = int(index[0]), int(index[-1]) + 1
        return self._store.rows(hookpoint, lo, hi)[self._keep[lo:hi]]

    def context_index(self, start: int, stop: int):
        return self._store.context_index(0, self._store.num_rows)[self._keep][start:stop]

    def position(self, start: int, stop: int):
        return self._store.position(0, self._store.num_rows)[self._keep][start:stop]

    def labels(self, key: str) -> list | None:
        values = self._store.labels(key)
        return None if values is None else [v for v, k in zip(values, self._keep.tolist()) if k]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._store, attr)


def pick_hookpoint(stores, wanted: str | None) -> str:
    """The hookpoint to read from every store: ``wanted`` when all hold it, else the single one they share."""
    common = [h for h in stores[0].hookpoints if all(h in s.hookpoints for s in stores[1:])]
    if wanted is not None:
        if wanted not in common:
            raise ValueError(f"hookpoint {wanted!r} is not in both stores (common hookpoints: {common}); "
                             f"pick one of those with --hookpoint, or name store B's with --hookpoint-b "
                             f"(B has {stores[1].hookpoints})")
        return wanted
    if len(common) != 1:
        raise ValueError(f"the stores share hookpoints {common}; choose one with --hookpoint")
    return common[0]


def pair_hookpoints(stores, wanted: str | None, wanted_b: str | None):
    """(stores, A's hookpoint, B's hookpoint): store B read under A's hookpoint name when the two name it
    differently (given as ``wanted_b``, or each store's only hookpoint), else :func:`pick_hookpoint`."""
    a, b = stores
    if wanted_b is None and wanted is None and len(a.hookpoints) == len(b.hookpoints) == 1 \
            and a.hookpoints != b.hookpoints:
        wanted, wanted_b = a.hookpoints[0], b.hookpoints[0]
    if wanted_b is None or wanted_b == wanted:
        hookpoint = pick_hookpoint(stores, wanted)
        return stores, hookpoint, hookpoint
    if wanted is None or wanted not in a.hookpoints:
        raise ValueError(f"--hookpoint-b needs --hookpoint naming store A's hookpoint; {a.path} has {a.hookpoints}")
    return [a, RenamedHookpoint(b, wanted_b, wanted)], wanted, wanted_b
