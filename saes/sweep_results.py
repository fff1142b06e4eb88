"""A sweep's results (``cd.train(..., sweep=...)``): :class:`Sweep`, a mapping name -> dictionary (``sweep["k-16"]``,
iteration and ``.items()`` as with a dict) that also holds each run's final numbers, as data (``to_dict``,
``to_pandas``) and as one aligned table (``format``).

Each run's numbers are read from its output folder:

- ``config.json``'s ``training`` record: the FVU, L0 and dead fraction of the held-out evaluation that training ends
  with (``heldout_eval``), or the last training step's (``last_step``) when nothing was held out; steps and rows;
- ``metrics.jsonl``: the seconds of the training loop, each logged line's new rows over its rows per second, summed
  (after a resume, the resumed part's). The dictionaries of a sweep that read the data alike train in one loop over
  it (``saes.plan.stream_groups``), so each one's seconds are that shared loop's.

The swept fields are the training settings (``training.config``) whose values differ between the runs, and the
hookpoint when the runs read different ones (a run over several hookpoints of a model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .artifact import CONFIG_FILE
from .model import SparseCoder
from .tables import frame, plain, text_table
from .training import METRICS_FILE

if TYPE_CHECKING:
    import pandas


@dataclass(frozen=True)
class SweepPoint:
    """One dictionary of a sweep and its final numbers (None where its folder does not record them)."""

    name: str
    """Its name in the sweep (its sub-folder, e.g. ``k-16_kind-topk``)."""
    path: Path | None
    """Its output folder."""
    settings: dict[str, Any] = field(default_factory=dict, repr=False)
    """Its flat training settings (``config.json``'s ``training.config``), and ``hookpoint``."""
    fvu: float | None = None
    """Fraction of variance unexplained on ``measured_on``."""
    l0: float | None = None
    """Mean active latents per row on ``measured_on``."""
    dead: float | None = None
    """Fraction of latents that never fired on ``measured_on``."""
    measured_on: str = ""
    """held-out (the batches training held out) or last step (the last training batch: nothing was held out)."""
    steps: int | None = None
    """Training steps."""
    rows: int | None = None
    """Training rows."""
    seconds: float | None = None
    """Seconds of the training loop (module docstring)."""


def loop_seconds(metrics_file: Path) -> float | None:
    """The training loop's seconds from a metrics.jsonl: sum over its lines of (rows - the previous line's) / tok_s."""
    if not metrics_file.exists():
        return None
    total, before = 0.0, 0
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if record.get("tok_s"):
            total += max(int(record["rows"]) - before, 0) / float(record["tok_s"])
        before = int(record.get("rows", before))
    return total


def read_point(name: str, out: Path | None, model: SparseCoder) -> SweepPoint:
    """The :class:`SweepPoint` of run ``name``: its numbers from ``out`` (module docstring), or from the dictionary's
    own training summary when ``out`` holds no config.json (another process wrote it)."""
    config: dict[str, Any] = {}
    if out is not None and (Path(out) / CONFIG_FILE).exists():
        config = json.loads((Path(out) / CONFIG_FILE).read_text())
    summary = config.get("training") or getattr(model, "training_summary", None) or {}
    held, last = summary.get("heldout_eval"), summary.get("last_step") or {}
    hookpoints = config.get("hookpoints") or list((getattr(model, "config", None) or {}).get("hookpoints") or [])
    settings = {**summary.get("config", {}), "hookpoint": " -> ".join(hookpoints) or None}
    if held:
        numbers = {"fvu": held["fvu"], "l0": held["l0"], "dead": held["dead_fraction"], "measured_on": "held-out"}
    elif last:
        numbers = {"fvu": last.get("fvu"), "l0": last.get("l0"), "dead": last.get("dead"), "measured_on": "last step"}
    else:
        numbers = {}
    return SweepPoint(name, Path(out) if out is not None else None, settings, **numbers, steps=summary.get("steps"),
                      rows=summary.get("rows"),
                      seconds=loop_seconds(Path(out) / METRICS_FILE) if out is not None else None)


class Sweep(Mapping[str, SparseCoder]):
    """The dictionaries of a sweep by name, with each one's final numbers (module docstring).

    ``sweep["k-16"]`` is a dictionary; ``sweep.points`` their :class:`SweepPoint`; ``sweep.swept`` the fields that
    vary; ``sweep.format()`` one table; ``sweep.to_pandas()`` one row per point."""

    def __init__(self, runs: Sequence[tuple[str, Path | None, SparseCoder]]) -> None:
        """``runs``: (name, output folder, dictionary) of each run, as training returns them."""
        names = [name for name, _, _ in runs]
        if len(set(names)) != len(names):
            raise ValueError(f"a sweep's dictionaries need distinct names, got {names}")
        self.dictionaries: dict[str, SparseCoder] = {name: model for name, _, model in runs}
        self.points: list[SweepPoint] = [read_point(name, out, model) for name, out, model in runs]
        keys = list(dict.fromkeys(k for p in self.points for k in p.settings))
        self.swept: list[str] = [k for k in keys if len({json.dumps(p.settings.get(k), default=str)
                                                          for p in self.points}) > 1]

    def __getitem__(self, name: str) -> SparseCoder:
        try:
            return self.dictionaries[name]
        except KeyError:
            raise KeyError(f"no dictionary {name!r} in this sweep; it holds {list(self.dictionaries)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.dictionaries)

    def __len__(self) -> int:
        return len(self.dictionaries)

    @property
    def paths(self) -> dict[str, Path | None]:
        """name -> output folder."""
        return {p.name: p.path for p in self.points}

    def rows(self) -> list[dict[str, Any]]:
        """One record per point: name, the swept fields, fvu, l0, dead, seconds, steps, rows, measured_on, path."""
        return [{"name": p.name, **{k: p.settings.get(k) for k in self.swept}, "fvu": p.fvu, "l0": p.l0,
                 "dead": p.dead, "seconds": p.seconds, "steps": p.steps, "rows": p.rows,
                 "measured_on": p.measured_on, "path": p.path} for p in self.points]

    def to_dict(self) -> dict[str, Any]:
        """As plain JSON types: the swept fields and :meth:`rows`."""
        return plain({"swept": self.swept, "points": self.rows()})

    def to_pandas(self) -> pandas.DataFrame:
        """A DataFrame with one row per point (:meth:`rows`); e.g. ``df.plot.scatter("l0", "fvu")``."""
        return frame(self.rows())

    def format(self) -> str:
        """One aligned table: name, the swept fields, FVU, L0, dead %, steps and seconds per point (``*``: measured
        on the last training step, nothing having been held out)."""
        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        body = [[p.name, *(str(p.settings.get(k)) for k in self.swept),
                 num(p.fvu, ".4f") + ("*" if p.measured_on == "last step" else ""), num(p.l0, ".2f"),
                 num(None if p.dead is None else 100 * p.dead, ".1f"), num(p.steps, "d"), num(p.seconds, ".1f")]
                for p in self.points]
        table = text_table(["name", *self.swept, "FVU", "L0", "dead %", "steps", "seconds"], body)
        note = any(p.measured_on == "last step" for p in self.points)
        return table + ("\n* on the last training step (no held-out rows)" if note else "")

    def __repr__(self) -> str:
        names = ", ".join(list(self.dictionaries)[:3]) + (f", +{len(self) - 3} more" if len(self) > 3 else "")
        swept = ", ".join(self.swept) or "nothing"
        text = f"Sweep({len(self)} dictionaries over {swept}: {names})"
        return text if len(text) <= 200 else text[:196] + "...)"
