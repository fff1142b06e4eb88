"""Where training metrics go: a tiny sink protocol, a JSONL file sink and a null sink."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class MetricsSink(Protocol):
    """Receives one flat record (JSON-able values) per logging step."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops every record."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON line per record to ``path``.

    ``keep_until_step``: when resuming, first drop the records of steps after the checkpoint so the file
    reads as one uninterrupted run."""

    def __init__(self, path: str | Path, keep_until_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until_step is None:
            self.path.write_text("")
        elif self.path.exists():
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= keep_until_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
