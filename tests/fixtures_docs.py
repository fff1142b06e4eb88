"""Reading the guides' tables, for the tests that check a doc against a registry (every registered name has a row,
every row is a registered name)."""

from __future__ import annotations

import re
from pathlib import Path


def table_names(doc: Path, heading: str) -> list[str]:
    """The backticked names in the first column of the table under ``heading`` (up to the next heading) of the
    markdown file ``doc``, in order; a row may name several (`` `a`, `b` ``)."""
    text = doc.read_text()
    if heading not in text:
        raise AssertionError(f"{doc} has no heading {heading!r}")
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and the |---|
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])]
