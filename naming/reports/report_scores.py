"""The report's score pages (written when ``conceptdict score`` has run): one table row per scored concept
with its confidence, every scorer's score and every namer's name, sortable and filterable without scripts.

- Sorting: ``scores.html`` is sorted by confidence; ``scores-by-SCORER.html`` by that scorer's score. The
  column headers link to those pages (highest first).
- Filtering: every row carries the band of its sort key (``b-hi`` >= 0.8, ``b-mid`` 0.6-0.8, ``b-lo`` < 0.6,
  ``b-none`` unscored). The table sits inside elements with ids ``hi``, ``mid``, ``lo``, ``none``; the links
  ``#hi`` ... make that element the CSS ``:target``, and a rule hides the rows of the other bands. The pages
  hold no script (tests/test_report.py checks every page).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from conceptdict.naming.concepts import Concept, ConceptDictionary
from conceptdict.naming.reports.report import esc, page

BANDS = (("hi", "≥ 0.8", 0.8), ("mid", "0.6 – 0.8", 0.6), ("lo", "< 0.6", -math.inf))
CSS = (
    "".join(f"#{b}:target tr.r:not(.b-{b}){{display:none}}" for b, _, _ in BANDS)
    + "#none:target tr.r:not(.b-none){display:none}"
    + ".num{text-align:right;font-variant-numeric:tabular-nums}.names{color:#5b6475;font-size:12.5px}"
)


def scorer_names(cd: ConceptDictionary) -> list[str]:
    """Scorers present in any concept, in the order the run listed them."""
    return scorers_of(cd.meta, {s for c in cd.concepts for s in c.scores})


def scorers_of(meta: dict[str, Any], seen: set[str]) -> list[str]:
    """The scorers ``seen`` in the concepts, those the run listed (``meta["scoring"]``) first, in its order."""
    listed = list(meta.get("scoring", {}).get("scorers", []))
    return [s for s in listed if s in seen] + sorted(seen - set(listed))


class ScoreRow(NamedTuple):
    """What the score pages show of a concept: its fields that :func:`key_of` and a table row read, each score's
    headline number only (a writer that goes a block at a time keeps these, not the concepts)."""

    id: int
    name: str
    namer: str
    confidence: float | None
    scores: dict[str, dict[str, Any]]
    names: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, c: Concept) -> ScoreRow:
        return cls(c.id, c.name, c.namer, c.confidence, {s: {"score": m.get("score")} for s, m in c.scores.items()},
                   {n: {"name": e.get("name")} for n, e in c.names.items()})


def key_of(c: Concept, sort: str) -> float | None:
    """The value a page sorts and bands by: the confidence or one scorer's ``score``."""
    v = c.confidence if sort == "confidence" else c.scores.get(sort, {}).get("score")
    return float(v) if v is not None and math.isfinite(v) else None


def band(value: float | None) -> str:
    if value is None:
        return "none"
    return next(b for b, _, lo in BANDS if value >= lo)


def _fmt(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.3f}"


def page_for(sort: str) -> str:
    return "scores.html" if sort == "confidence" else f"scores-by-{sort}.html"


def _row(c: Concept, scorers: list[str], sort: str, where: dict[int, str]) -> str:
    others = ", ".join(f"{esc(n)}: {esc(e.get('name', ''))}" for n, e in c.names.items() if e.get("name") != c.name)
    cells = "".join(f'<td class="num">{_fmt(c.scores.get(s, {}).get("score"))}</td>' for s in scorers)
    return (f'<tr class="r b-{band(key_of(c, sort))}"><td><a href="{where.get(c.id, "index.html")}#c{c.id}">'
            f"#{c.id}</a></td><td>{esc(c.name or '(unnamed)')}</td><td>{esc(c.namer)}</td>"
            f'<td class="num">{_fmt(c.confidence)}</td>{cells}<td class="names">{others}</td></tr>')  # fmt: skip


ROWS = "\x00rows\x00"
"""Where :func:`scores_table` leaves the table's rows, written one at a time by :func:`write_score_rows`."""


def scores_table(scorers: list[str], sort: str) -> str:
    """The filter links and the table, sorted by ``sort``, with :data:`ROWS` for its rows."""
    heads = "".join(f'<th><a href="{esc(page_for(s))}">{esc(s)}</a></th>' for s in ["confidence", *scorers])
    links = " · ".join(f'<a href="#{b}">{esc(label)}</a>' for b, label, _ in BANDS)
    filters = f'<nav>sorted by <strong>{esc(sort)}</strong> · show {links} · <a href="#none">unscored</a> · ' \
              f'<a href="#">all</a></nav>'  # fmt: skip
    table = f"<table><tr><th>id</th><th>name</th><th>namer</th>{heads}<th>other namers</th></tr>{ROWS}</table>"
    for b in ("none", *(b for b, _, _ in reversed(BANDS))):
        table = f'<div id="{b}">{table}</div>'
    return filters + table


def write_score_rows(meta: dict[str, Any], n: int, rows: Callable[[int], Concept | ScoreRow], scorers: list[str],
                     n_scored: int, directory: Path, header: str, where: dict[int, str]) -> list[Path]:
    """``scores.html`` and one ``scores-by-SCORER.html`` per scorer of ``n`` concepts given one at a time
    (``rows(id)``): ``n_scored`` of them scored, ``scorers`` those seen (:func:`scorers_of`); returns their paths."""
    info = meta.get("scoring", {})
    neg = info.get("negatives", {}).get("kinds", "?")
    intro = (f"<p>{n_scored} scored concepts · negatives: {esc(neg)} · "
             f"namers: {esc(', '.join(info.get('namers', [])))} · confidence = mean of name agreement and "
             f"clip(2·(score − 0.5), 0, 1) per scorer (docs/scores.md)</p>")  # fmt: skip
    paths = []
    for sort in ["confidence", *scorers]:
        keys = [key_of(rows(i), sort) for i in range(n)]
        order = sorted(range(n), key=lambda i: (keys[i] is None, -(keys[i] or 0.0), i))  # highest first
        head, tail = page("Concept scores", header, intro + scores_table(scorers, sort), CSS).split(ROWS)
        path = directory / page_for(sort)
        with open(path, "w", encoding="utf-8") as out:  # a row at a time: one page holds every concept
            out.write(head)
            out.writelines(_row(rows(i), scorers, sort, where) for i in order)
            out.write(tail)
        paths.append(path)
    return paths
