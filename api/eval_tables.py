"""``Evaluation`` and ``Comparison`` (eval_api.py) as data: their ``to_dict`` and ``to_pandas``, kept here so that
eval_api.py stays within the module size limit (the classes take these functions as methods)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conceptdict.saes.compare import comparison_rows
from conceptdict.saes.tables import frame, plain

if TYPE_CHECKING:
    import pandas

    from conceptdict.naming.yardsticks import MetricResults

    from conceptdict.eval_api import Comparison, Evaluation


def evaluation_to_dict(self: Evaluation, flat: bool = False) -> dict[str, Any]:
    """As plain JSON types: kind, hookpoint (" -> " between a transcoder's), store, rows_from, path (eval.json),
    latent_tags and ``metrics`` (``EvalResult.to_dict``), ``yardsticks`` when metrics were asked for; ``flat``: each
    metric a key of its own, a yardstick's as ``metric.name`` (the row of :meth:`to_pandas`)."""
    about = {"kind": self.metrics.kind or self.dictionary.kind, "hookpoint": " -> ".join(self.hookpoints),
             "store": self.store, "rows_from": self.rows_from, "path": self.path, "latent_tags": self.latent_tags}
    sticks = self.yardsticks
    more = {} if sticks is None else sticks.flat() if flat else {"yardsticks": sticks.to_dict()}
    return plain({**about, **(self.metrics.to_dict() if flat else {"metrics": self.metrics.to_dict()}), **more})


def evaluation_to_pandas(self: Evaluation) -> pandas.DataFrame:
    """A DataFrame of one row, this dictionary: ``to_dict(flat=True)``, every metric a column (lists such as
    per_source_fvu as cells); ``pd.concat`` the frames of several evaluations to sort or plot them."""
    return frame([evaluation_to_dict(self, flat=True)])


def comparison_to_dict(self: Comparison) -> dict[str, Any]:
    """compare.json's content as plain JSON types, with rows_from and the paths written."""
    return plain({**self.result, "rows_from": self.rows_from, "paths": self.paths})


def comparison_to_pandas(self: Comparison) -> pandas.DataFrame:
    """A DataFrame with one row per dictionary: name, kind, n_latents, k, l0, fvu, on_frontier, then every metric and
    weight metric, live and unique latents, matched.OTHER (``saes.compare.comparison_rows``), and with ``metrics``
    each yardstick's numbers as ``metric.name``."""
    from conceptdict.naming.yardsticks import MetricResults

    rows = comparison_rows(self.result)
    for row in rows:  # a yardstick's numbers as metric.name columns, as Evaluation.to_pandas has them
        sticks = row.pop("yardsticks", None)
        row.update(MetricResults(**sticks).flat() if sticks else {})
    return frame(rows, ["name", "kind", "n_latents", "k", "l0", "fvu", "on_frontier"])


def side_by_side(names: list[str], results: list[MetricResults]) -> str:
    """The yardsticks of several dictionaries as one table: a row per ``metric.name``, a column per dictionary."""
    flats = [r.flat() for r in results]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    width = max([len(k) for k in keys] + [6])
    cols = [max(len(n), 10) for n in names]
    show = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["  ".join([f"{'metric':<{width}}", *(f"{n:>{c}}" for n, c in zip(names, cols))])]
    lines += ["  ".join([f"{k:<{width}}", *(f"{show(f.get(k)):>{c}}" for f, c in zip(flats, cols))]) for k in keys]
    lines += [f"{n}: skipped {why}" for n, r in zip(names, results) for why in r.skipped.values()]
    return "\n".join(lines)
