"""What naming needs from the two other stages, written down: a :class:`Store` of activations and a
:class:`Dictionary`. ``conceptdict.activations.ActivationStore`` and ``conceptdict.saes.SparseCoder`` satisfy
them, and so do the in-memory fakes of tests/test_naming_fakes.py, which is how stage 3 is tested on known
tensors without stages 1 and 2 (tests/test_naming_fakes.py checks both sides against these)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from conceptdict.activations import RowContext


@runtime_checkable
class Store(Protocol):
    """The activation rows to name over, with their context for showing examples."""

    path: Path
    """Where the store lives (error messages, the concept dictionary's metadata)."""
    level: str
    """"token" (one row per token of a context) or "sequence" (one row per input)."""
    hookpoints: list[str]
    num_rows: int
    manifest: dict[str, Any]
    """The store's manifest; naming reads its ``model`` entry."""

    def d_in(self, hookpoint: str) -> int: ...

    def rows(self, hookpoint: str, start: int, stop: int) -> Tensor:
        """Rows [stop - start, D] of ``hookpoint``."""

    def iter_rows(self, hookpoint: str, chunk: int = 8192) -> Iterator[tuple[int, Tensor]]:
        """(start row, rows [n, D]) in row order."""

    def row_context(self, row: int, before: int = 8, after: int = 4) -> "RowContext":
        """The text around ``row`` (tokens, the row's position among them, text, context index, position)."""

    def labels(self, key: str) -> list | None:
        """The value of label column ``key`` per row (sequence stores), None when the store has none."""


@runtime_checkable
class Dictionary(Protocol):
    """The dictionary whose latents are named. A 2-source crosscoder must be a ``saes.SparseCoder``: its
    per-latent tags come from ``saes.diffing.decoder_table``, which reads its decoder and normalisation."""

    kind: str
    d_in: int
    k: int
    n_latents: int
    n_sources: int

    def encode(self, x: Tensor) -> Tensor:
        """x [n, D] (or [n, S, D]) -> codes [n, L]."""

    def decoder_directions(self) -> Tensor:
        """Decoder rows [L, D] (or [L, S, D]) in raw activation units."""

    def dense_activations(self, x: Tensor) -> Tensor:
        """x [n, D] (or [n, S, D]) -> [n, L]: every latent's ReLU activation before selection (the CBM's input)."""

    def to(self, device: Any) -> Any: ...
