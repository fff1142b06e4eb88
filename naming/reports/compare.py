"""The report of ``conceptdict compare``: a text table, an HTML page (the same table, the FVU-L0 frontier as an
inline SVG, the cross-dictionary matches, the names only one dictionary found). Rendered with the concept
report's page skeleton (naming.report); every string from data goes through
:func:`~conceptdict.naming.reports.report.esc`; no script and no network."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from conceptdict.naming.reports.report import esc, page

COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "dictionary"), ("kind", "kind"), ("n_latents", "L"), ("k", "k"), ("metrics.l0", "L0"),
    ("metrics.fvu", "FVU"), ("metrics.explained_variance", "expl. var."), ("metrics.ce_loss_recovered", "CE rec."),
    ("metrics.kl_score", "KL score"), ("metrics.dead_fraction", "dead"), ("metrics.dense_fraction", "dense"),
    ("weights.decoder_max_cosine_mean", "dec cos max (mean)"), ("weights.near_duplicate_fraction", "dup > 0.9"),
    ("weights.encoder_decoder_cosine_mean", "enc-dec cos"), ("weights.split_fraction", "split"),
    ("unique_latents", "only here"), ("unique_names.count", "names only here"),
)
CSS = ("td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:right}th{background:#eee}"
       "td:first-child{text-align:left}.front{font-weight:bold}")


def _get(row: dict[str, Any], key: str):
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else "-"
    return str(v)


def comparison_table(result: dict[str, Any]) -> str:
    """A fixed-width text table, one row per dictionary (``*`` marks the FVU-L0 frontier)."""
    head = [label for _, label in COLUMNS]
    body = [[_fmt(_get(r, key)) + ("*" if key == "name" and r["name"] in result["frontier"] else "")
             for key, _ in COLUMNS] for r in result["dictionaries"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    return "\n".join(lines + [f"* on the FVU-L0 frontier; {result['n_rows']} rows; latents matched at decoder "
                              f"cosine >= {result['match_threshold']}"])


def frontier_svg(result: dict[str, Any], width: int = 520, height: int = 280, label_room: int = 110) -> str:
    """FVU against L0, one labelled point per dictionary, the frontier joined by a line (inline SVG)."""
    pts = [(r["name"], r["metrics"]["l0"], r["metrics"]["fvu"]) for r in result["dictionaries"]
           if math.isfinite(r["metrics"]["l0"]) and math.isfinite(r["metrics"]["fvu"])]
    if not pts:
        return '<svg width="10" height="10" role="img"><title>no finite points</title></svg>'
    pad, x_hi, y_hi = 36, max(p[1] for p in pts) * 1.1 or 1.0, max(p[2] for p in pts) * 1.1 or 1.0

    def xy(l0, fvu):
        return pad + (width - 2 * pad - label_room) * l0 / x_hi, height - pad - (height - 2 * pad) * fvu / y_hi

    front = sorted((p for p in pts if p[0] in result["frontier"]), key=lambda p: p[1])
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(p[1], p[2]) for p in front))
    dots = "".join(
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{"#d0452a" if n in result["frontier"] else "#4a7bd0"}">'
        f'<title>{esc(f"{n}: L0 {l0:.3g}, FVU {fvu:.3g}")}</title></circle>'
        f'<text x="{x + 6:.1f}" y="{y - 6:.1f}" font-size="10">{esc(n)}</text>'
        for n, l0, fvu in pts for x, y in [xy(l0, fvu)])
    axes = (f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad - label_room}" y2="{height - pad}" stroke="#888"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>'
            f'<text x="{(width - label_room) / 2}" y="{height - 8}" font-size="11" text-anchor="middle">L0 (0 to '
            f'{x_hi:.3g})</text>'
            f'<text x="10" y="{height / 2}" font-size="11" transform="rotate(-90 10 {height / 2})" '
            f'text-anchor="middle">FVU (0 to {y_hi:.3g})</text>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="FVU against L0">{axes}'
            f'<polyline points="{line}" fill="none" stroke="#d0452a"/>{dots}</svg>')


def _table_html(result: dict[str, Any]) -> str:
    head = "".join(f"<th>{esc(label)}</th>" for _, label in COLUMNS)
    rows = "".join(
        f'<tr class="{"front" if r["name"] in result["frontier"] else ""}">'
        + "".join(f"<td>{esc(_fmt(_get(r, key)))}</td>" for key, _ in COLUMNS) + "</tr>"
        for r in result["dictionaries"])
    return f"<table><tr>{head}</tr>{rows}</table>"


def _matches_html(result: dict[str, Any]) -> str:
    names = [r["name"] for r in result["dictionaries"]]
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    rows = "".join(f"<tr><td>{esc(a)}</td>" + "".join(
        f"<td>{esc(_fmt(result['matches'].get(a, {}).get(b)))}</td>" for b in names) + "</tr>" for a in names)
    return (f"<h2>Latents matched across dictionaries</h2><p>Share of the row dictionary's live latents whose "
            f"decoder has cosine &ge; {esc(result['match_threshold'])} with a live latent of the column's "
            f"(same hookpoint only).</p><table><tr><th></th>{head}</tr>{rows}</table>")


def _names_html(result: dict[str, Any]) -> str:
    parts = [f"<h3>{esc(r['name'])}: {r['unique_names']['count']}</h3><p>"
             + ", ".join(esc(n) for n in r["unique_names"]["examples"]) + "</p>"
             for r in result["dictionaries"] if r.get("unique_names")]
    return ("<h2>Names only one dictionary found</h2>" + "".join(parts)) if parts else ""


def _layers_html(result: dict[str, Any]) -> str:
    """Per-layer FVU / L0 / dead of the replacement models (a CLT, or a set of per-layer transcoders)."""
    rows = "".join(f"<tr><td>{esc(r['name'])}</td><td>{l}</td><td>{esc(_fmt(f))}</td><td>{esc(_fmt(z))}</td>"
                   f"<td>{esc(_fmt(d))}</td></tr>"
                   for r in result["dictionaries"] if r["metrics"].get("per_layer_l0")
                   for l, (f, z, d) in enumerate(zip(r["metrics"]["per_source_fvu"], r["metrics"]["per_layer_l0"],
                                                     r["metrics"]["per_layer_dead"])))
    return ("<h2>Per layer</h2><table><tr><th>dictionary</th><th>layer</th><th>FVU</th><th>L0</th><th>dead</th></tr>"
            f"{rows}</table>") if rows else ""


def render_comparison(result: dict[str, Any]) -> str:
    """The whole HTML page."""
    body = (f"<h2>Side by side</h2>{_table_html(result)}<p>Bold: on the FVU-L0 frontier. split: share of live "
            f"latents with a partner of decoder cosine &ge; {esc(result['split_cosine'])} they almost never fire "
            f"with (Jaccard &le; {esc(result['split_jaccard'])}), a splitting / absorption proxy.</p>"
            f"{_layers_html(result)}<h2>FVU-L0 frontier</h2>{frontier_svg(result)}{_matches_html(result)}"
            f"{_names_html(result)}")
    header = f"<h1>{len(result['dictionaries'])} dictionaries on {esc(result['n_rows'])} rows</h1>"
    return page("conceptdict compare", header, body, CSS)


def write_comparison(result: dict[str, Any], directory: Path) -> Path:
    """Write ``index.html`` into ``directory``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "index.html"
    path.write_text(render_comparison(result))
    return path
