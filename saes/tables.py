"""Results as data: the helpers every result's ``to_dict`` / ``to_pandas`` / ``format`` and the short reprs use.

- :func:`plain`: any nested value (dataclasses, tensors, numpy values, paths, tuples) as plain JSON types;
  non-finite floats become None, so ``json.dumps(..., allow_nan=False)`` accepts the result.
- :func:`flat_record`: a nested record as one table row, nested dicts spread into dotted columns
  (``{"splice": {"ce_clean": 2.1}}`` -> ``{"splice.ce_clean": 2.1}``); lists stay one cell.
- :func:`frame`: rows -> a pandas DataFrame. pandas is optional (``pip install "conceptdict[pandas]"``) and imported
  only here, when a table is asked for.
- :func:`text_table`: rows -> an aligned text table (first column left, the others right).
- :func:`shorten`: a value cut to a width for one-line reprs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas

PANDAS_HINT = 'pip install "conceptdict[pandas]"'
"""How to get pandas, in the error :func:`frame` raises without it."""


def plain(value: Any) -> Any:
    """``value`` as plain JSON types (dict, list, str, int, float, bool, None): dataclasses and NamedTuples as
    dicts, tensors and numpy arrays as (nested) lists, numpy / 0-dim values as numbers, paths and dtypes as
    strings, tuples and sets as lists; non-finite floats become None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # torch / numpy arrays and scalars
        return plain(value.tolist())
    return str(value)  # dtypes, devices and other small objects: their name


def flat_record(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """One table row out of a nested record: nested dicts spread into ``outer.inner`` columns, everything else (lists
    included) one cell."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_record(value, f"{name}."))
        else:
            out[name] = value
    return out


def frame(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None) -> pandas.DataFrame:
    """A pandas DataFrame with one row per record of ``rows`` (each made plain and flat: :func:`plain`,
    :func:`flat_record`); ``columns`` first, in that order, then the rest in the order they first appear."""
    try:
        import pandas
    except ImportError:
        raise ImportError(f"to_pandas() needs pandas, which is not installed: {PANDAS_HINT}") from None
    flat = [flat_record(plain(r)) for r in rows]
    order = list(dict.fromkeys([*(columns or []), *(k for r in flat for k in r)]))
    return pandas.DataFrame(flat, columns=order)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An aligned text table: the first column left-aligned, the others right-aligned, two spaces between."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in
                               enumerate(zip(line, widths))).rstrip() for line in [header, *rows])


def shorten(value: Any, width: int = 40) -> str:
    """``str(value)`` cut to ``width`` characters: a path keeps its end (``.../runs/sae``), anything else its start
    (``blocks.6.hook_resi...``)."""
    text = str(value)
    if len(text) <= width:
        return text
    if isinstance(value, Path) or "/" in text:
        return "..." + text[-(width - 3):]
    return text[: width - 3] + "..."


def short_list(items: Sequence[Any], shown: int = 3, width: int = 40) -> str:
    """``[a, b, c, +12 more]`` with each item :func:`shorten`-ed (strings quoted)."""
    parts = [repr(shorten(x, width)) if isinstance(x, str) else shorten(x, width) for x in list(items)[:shown]]
    if len(items) > shown:
        parts.append(f"+{len(items) - shown} more")
    return "[" + ", ".join(parts) + "]"
