"""The report of ``conceptdict diff``: the per-latent table as CSV and an HTML page (counts per tag and flag,
histograms of Delta and the decoder cosine, the B-only latents with their Latent Scaling flags, the A-only
latents). Rendered with the concept report's one page skeleton and one histogram (naming.report); every
string that comes from data goes through :func:`~conceptdict.naming.reports.report.esc`."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

from conceptdict.saes.diffing import SOURCE_NAMES, histogram

from conceptdict.naming.reports.report import esc, histogram_svg, page

REPORT_COLUMNS = ("latent", "tag", "delta", "cosine", "change", "norm_a", "norm_b", "nu_eps", "nu_r", "beta_eps_a",
                  "beta_eps_b", "fires", "model_specific", "complete_shrinkage", "latent_decoupling")
CSS = ("td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:right}th{background:#eee}"
       ".figs{display:flex;gap:2em;flex-wrap:wrap}")


def _num(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.3f}" if math.isfinite(v) else "–"
    return str(v)


def write_csv(records: list[dict], path: Path) -> Path:
    """One row per latent; empty cells for missing values."""
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]) if records else ["latent"])
        writer.writeheader()
        for rec in records:
            writer.writerow({k: "" if v is None else v for k, v in rec.items()})
    return path


def _table(records: list[dict], limit: int = 200) -> str:
    cols = [c for c in REPORT_COLUMNS if records and c in records[0]]
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    rows = "".join("<tr>" + "".join(f"<td>{esc(_num(r[c]))}</td>" for c in cols) + "</tr>"
                   for r in records[:limit])
    more = f"<p>{len(records) - limit} more in latents.csv</p>" if len(records) > limit else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{more}"


def _figure(values: list, lo: float, hi: float, label: str) -> str:
    counts = histogram(torch.tensor(values, dtype=torch.float64), 20, lo, hi)
    edges = [lo + (hi - lo) * i / len(counts) for i in range(len(counts) + 1)]
    return histogram_svg(edges, counts, label=label, width=420, height=120)


def render_diff_report(summary: dict, records: list[dict]) -> str:
    """The HTML report of a diff: ``summary`` as ``conceptdict diff`` writes it to diff.json, ``records`` its
    per-latent records (``saes.diffing.LatentDiff.records``)."""
    models = summary["sources"]
    counts = "".join(f"<tr><td>{esc(k)}</td><td>{v}</td></tr>" for k, v in summary["counts"].items())
    b_only = sorted((r for r in records if r["tag"] == "B-only"),
                    key=lambda r: (not r.get("model_specific", False), -(r["delta"] or 0)))
    a_only = [r for r in records if r["tag"] == "A-only"]
    changed = summary.get("changed") or []
    ev = summary.get("eval") or {}
    fvu = ", ".join(f"{esc(n)} {v:.4f}" for n, v in zip(SOURCE_NAMES, ev.get("per_source_fvu", [])))
    t = summary["thresholds"]
    header = (f"<h1>Model diff</h1><div class=\"meta\">A = <code>{esc(models['A'])}</code>, B = "
              f"<code>{esc(models['B'])}</code>, hookpoint <code>{esc(summary['hookpoint'])}</code></div>")
    body = f"""<p>Crosscoder <code>{esc(summary['kind'])}</code> with {summary['n_latents']} latents (k = {summary['k']}).
FVU per source on the analysed rows: {fvu or 'n/a'}; L0 {esc(_num(ev.get('l0')))}.</p>
<p>Delta = &frac12;((|d<sup>B</sup>| &minus; |d<sup>A</sup>|) / max(|d<sup>A</sup>|, |d<sup>B</sup>|) + 1): 1 = only in B.
Latent Scaling fits d<sup>B</sup> to each model's reconstruction (&beta;<sup>r</sup>) and error (&beta;<sup>&epsilon;</sup>);
a B-only latent is model-specific when &nu;<sup>&epsilon;</sup> &lt; {t['nu_eps_max']:g} and
&nu;<sup>r</sup> &lt; {t['nu_r_max']:g}. The flags concern B-only latents; to analyse A-only
latents the same way, run the diff with the two models swapped.</p>
<h2>Counts</h2><table><tbody>{counts}</tbody></table>
<div class="figs"><div><h3>Delta</h3>{_figure([r["delta"] for r in records], 0.0, 1.0, "Delta")}</div>
<div><h3>Decoder cosine(A, B)</h3>{_figure([r["cosine"] for r in records], -1.0, 1.0, "cosine")}</div></div>
<h2>Most changed decoders ({len(changed)})</h2><p>Ranked by |d<sup>B</sup> &minus; d<sup>A</sup>| /
max(|d<sup>A</sup>|, |d<sup>B</sup>|) whatever the tag: a direction B adds on top of an existing latent shows here
even when Delta calls it shared or other.</p>{_table(changed)}
<h2>B-only latents ({len(b_only)})</h2>{_table(b_only)}
<h2>A-only latents ({len(a_only)})</h2>{_table(a_only)}"""
    return page(f"conceptdict diff: {models['A']} vs {models['B']}", header, body, CSS)


DIFF_FORMAT = "conceptdict-diff"
DIFF_VERSION = 1


def write_diff(out: Path, summary: dict, records: list[dict]) -> dict[str, Path]:
    """diff.json (summary + per-latent records), latents.csv, report.html in ``out``."""
    import json

    paths = {"json": out / "diff.json", "csv": out / "latents.csv", "html": out / "report.html"}
    doc = {"format": DIFF_FORMAT, "format_version": DIFF_VERSION, **summary, "latents": records}
    paths["json"].write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n")
    write_csv(records, paths["csv"])
    paths["html"].write_text(render_diff_report(summary, records))
    return paths


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
