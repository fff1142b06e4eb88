"""A batch source that dies part-way, for the crash-and-resume tests."""

from __future__ import annotations

from typing import Callable, Iterator


class Crash(RuntimeError):
    """The simulated crash (distinct from every error the code under test raises)."""


def crashing(batches: Callable[[int], Iterator], at: int) -> Callable[[int], Iterator]:
    """``batches`` (start -> iterator over batches start, start + 1, ...) that raises :class:`Crash` instead of
    yielding batch ``at``."""
    def gen(start: int) -> Iterator:
        for i, x in enumerate(batches(start), start):
            if i == at:
                raise Crash(f"simulated crash at batch {i}")
            yield x
    return gen
