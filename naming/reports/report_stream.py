"""The HTML report of a concept dictionary given a block of concepts at a time (``conceptdict name`` and ``score``
as they write, ``export --format html`` of a concept dictionary read as a stream).

:class:`ReportWriter` writes each concept's card to a spool file as it comes, and its score-page row
(``report_scores.ScoreRow``) to a second one; :meth:`ReportWriter.finish` puts the pages together in the report's
order (most frequent first) from the spools, with a CBM's pages when given: the files
``naming.reports.report.write_report`` writes of the whole dictionary, byte for byte. What stays in memory across
blocks: each latent's frequency (8 bytes) and where its card and its row lie in the spools (32 bytes).
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from conceptdict.naming.bottleneck.cbm import CbmResult
from conceptdict.naming.concepts import Concept
from conceptdict.naming.reports.report import concept_card, write_report_pages
from conceptdict.naming.reports.report_scores import ScoreRow, scorers_of


class ReportWriter:
    """The report in ``directory``: :meth:`add` blocks of concepts in latent order, then :meth:`finish` with the
    concept dictionary's meta (and a CBM). Until then the spools are ``cards.part`` and ``scores.part`` in
    ``directory``; a context manager removes them on an error."""

    def __init__(self, directory: str | Path, per_page: int = 200) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.per_page = per_page
        self.spool_path = self.directory / "cards.part"
        self.spool = open(self.spool_path, "wb")  # noqa: SIM115 (closed by finish / close)
        self.rows_path = self.directory / "scores.part"  # the score pages' rows, as the cards
        self.rows = open(self.rows_path, "wb")  # noqa: SIM115 (closed by finish / close)
        self.frequency, self.cards, self.row_at = array("d"), array("q"), array("q")  # (offset, length) pairs
        self.scorers: set[str] = set()
        self.scored = 0

    def __len__(self) -> int:
        return len(self.frequency)

    def add(self, concepts: Sequence[Concept]) -> None:
        """The next block of concepts (ids ``len(self), len(self) + 1, ...``)."""
        first = len(self.frequency)
        if [c.id for c in concepts] != list(range(first, first + len(concepts))):
            raise ValueError(f"concepts must come in latent order: expected ids from {first}, got "
                             f"{[c.id for c in concepts][:3]}...")
        for c in concepts:
            data = concept_card(c).encode("utf-8")
            self.cards.extend((self.spool.tell(), len(data)))
            self.spool.write(data)
            self.frequency.append(c.frequency)
            row = json.dumps(ScoreRow.of(c), ensure_ascii=False).encode("utf-8")
            self.row_at.extend((self.rows.tell(), len(row)))
            self.rows.write(row)
            self.scorers.update(c.scores)
            self.scored += bool(c.scores)

    def finish(self, meta: dict, cbm: CbmResult | None = None) -> Path:
        """Write the pages (and ``cbm``'s) from the spools and remove them; returns the path of ``index.html``."""
        self.spool.close()
        self.rows.close()
        with open(self.spool_path, "rb") as spool, open(self.rows_path, "rb") as rows:
            def card(i: int) -> str:
                return os.pread(spool.fileno(), self.cards[2 * i + 1], self.cards[2 * i]).decode("utf-8")

            def row(i: int) -> ScoreRow:
                return ScoreRow(*json.loads(os.pread(rows.fileno(), self.row_at[2 * i + 1], self.row_at[2 * i])))

            index = write_report_pages(self.directory, meta, self.frequency, card, cbm, self.per_page, row,
                                       scorers_of(meta, self.scorers), self.scored)
        self.close()
        return index

    def close(self) -> None:
        """Remove the spools (after :meth:`finish`, or an error)."""
        self.spool.close()
        self.rows.close()
        self.spool_path.unlink(missing_ok=True)
        self.rows_path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.close()


__all__ = ["ReportWriter"]
