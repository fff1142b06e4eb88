"""A static HTML report of a concept dictionary (and optionally its CBM), readable without a server.

``index.html`` holds the summary and the first page of concept cards (most frequent concepts first);
``concepts-N.html`` the further pages; with a CBM, ``cbm.html`` its metrics and ``cbm-class-I.html`` one
page per class. Every string that comes from data (names, tokens, texts, class labels, paths) goes through
:func:`esc`; nothing from the data is ever placed in a tag, attribute name, script or URL unescaped.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conceptdict.naming.bottleneck.cbm import CbmResult, class_concepts, gap_notes
from conceptdict.naming.bottleneck.path import chosen_refit, describe_fit, is_chosen
from conceptdict.naming.concepts import Concept, ConceptDictionary, Example
from conceptdict.naming.images import shown_examples

log = logging.getLogger(__name__)

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:16px 28px}header h1{margin:0 0 4px;font-size:22px}
header .meta{opacity:.8;font-size:13px}header a{color:#9cd0ff}
main{padding:18px 28px}nav{margin:8px 0 16px;font-size:14px}nav a{margin-right:10px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:14px}
.card{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:12px 14px;overflow:hidden}
.card h2{font-size:17px;margin:0 0 2px}.card h2 .id{color:#8a93a6;font-weight:400;font-size:13px;margin-right:6px}
.sub{color:#5b6475;font-size:12.5px;margin-bottom:6px}.runner{color:#5b6475;font-size:12.5px}
.row{display:flex;gap:12px;align-items:flex-end}.stat{font-size:12.5px;color:#333}
.ex{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;background:#f7f8fa;border-left:3px solid #d6dae3;
margin:4px 0;padding:3px 6px;white-space:pre-wrap;word-break:break-word;max-height:5.2em;overflow:hidden}
.ex .act{float:right;color:#8a93a6;margin-left:8px}
mark{background:#ffd54a;border-radius:3px;padding:0 1px;font-weight:600}
.tok{display:inline-block;background:#eef3ff;border-radius:3px;padding:0 4px;margin:1px;font-family:ui-monospace,monospace;
font-size:12px}.neg{background:#ffeef0}.dead{opacity:.55}
.imgs{display:flex;flex-wrap:wrap;gap:6px;margin:4px 0}.imgex{width:100px;font-size:11px;color:#5b6475;
word-break:break-all}.imgex svg,.imgex img{display:block;width:96px;height:96px;image-rendering:pixelated;
border-radius:4px;background:#ddd}
table{border-collapse:collapse;background:#fff}td,th{padding:4px 10px;border-bottom:1px solid #e4e7ee;text-align:left;
font-size:14px}.bar{display:inline-block;height:10px;background:#4a7bd0;border-radius:2px;vertical-align:middle}
"""


def esc(value: object) -> str:
    """HTML-escape any value for text and attribute positions."""
    return html.escape(str(value), quote=True)


def histogram_svg(edges: Sequence[float], counts: Sequence[float], *, label: str | None = None, width: int = 200,
                  height: int = 54) -> str:
    """THE inline SVG bar chart of a histogram (every report uses it): bins between ``edges`` [n + 1], bar
    heights on a sqrt scale so rare bins stay visible, the axis ends labelled, and ``label`` (escaped) under
    the middle when given."""
    name = label or "activation"
    if not counts or max(counts) <= 0:
        empty = "never fires" if label is None else f"no {label} values"
        return f'<svg width="{width}" height="{height}" role="img"><title>{esc(empty)}</title></svg>'
    top = math.sqrt(max(counts))
    bw = width / len(counts)
    bars = []
    for i, c in enumerate(counts):
        h = (height - 12) * math.sqrt(c) / top
        title = f"{edges[i]:.3g} to {edges[i + 1]:.3g}: {int(c)}"
        bars.append(
            f'<rect x="{i * bw:.1f}" y="{height - 12 - h:.1f}" width="{max(bw - 1, 1):.1f}" height="{h:.1f}" '
            f'fill="#4a7bd0"><title>{esc(title)}</title></rect>'
        )
    text = 'font-size="9" fill="#5b6475"'
    axis = (
        f'<text x="0" y="{height - 1}" {text}>{esc(f"{edges[0]:.3g}")}</text>'
        f'<text x="{width}" y="{height - 1}" {text} text-anchor="end">{esc(f"{edges[-1]:.3g}")}</text>'
        + (f'<text x="{width / 2}" y="{height - 1}" {text} text-anchor="middle">{esc(label)}</text>' if label else "")
    )
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="{esc(name)} histogram">'
            f'{"".join(bars)}{axis}</svg>')


def image_example_html(e: Example, size: int = 96) -> str:
    """An image example: its thumbnail (``thumbs/CONTEXT.png``, written by :func:`write_report`), under a heat
    map of the latent over the image's patches when the example has one; the source and activation below."""
    info = e.image or {}
    src = f"thumbs/{int(info.get('context', -1))}.png"
    grid, heat = info.get("grid"), info.get("heat")
    title = f"<title>{esc(e.text)} · {e.activation:.3g}</title>"
    if grid and heat and len(heat) == grid[0] * grid[1]:
        rows, cols = int(grid[0]), int(grid[1])
        cells = "".join(f'<rect x="{i % cols}" y="{i // cols}" width="1" height="1" fill="#ffd400" '
                        f'fill-opacity="{0.75 * v / 255:.2f}"/>' for i, v in enumerate(heat) if v > 0)
        figure = (f'<svg viewBox="0 0 {cols} {rows}" preserveAspectRatio="none" role="img">{title}'
                  f'<image href="{src}" width="{cols}" height="{rows}" preserveAspectRatio="none"/>{cells}</svg>')
    else:
        figure = f'<img src="{src}" alt="{esc(e.text)}" width="{size}" height="{size}">'
    return f'<div class="imgex">{figure}{e.activation:.3g} · {esc(e.text.rsplit("/", 1)[-1])}</div>'


def image_examples_html(c: Concept) -> str:
    """A card's images: its distinct top images, then images across the activation range."""
    top, quant = shown_examples(c.top_examples, c.quantile_examples)
    html_ = f'<div class="imgs">{"".join(image_example_html(e) for e in top)}</div>'
    if quant:
        html_ += ('<div class="sub">across the activation range</div><div class="imgs">'
                  + "".join(image_example_html(e) for e in quant) + "</div>")
    return html_


def example_html(e: Example) -> str:
    """An example with its activating token in <mark>; all text escaped."""
    if e.image is not None:
        return image_example_html(e)
    if e.marked >= 0 and e.tokens:
        toks = e.display_tokens()
        parts = [esc(t) for t in toks]
        lead = toks[e.marked][: len(toks[e.marked]) - len(toks[e.marked].lstrip(" "))]
        parts[e.marked] = f"{lead}<mark>{esc(toks[e.marked].lstrip(' '))}</mark>"
        body = "".join(parts)
    else:
        body = esc(e.text)
    return f'<div class="ex"><span class="act">{e.activation:.3g}</span>{body}</div>'


def decoder_norms_text(norms: list[float]) -> str:
    """A cross-layer transcoder feature's decoder norm per target layer, as one line."""
    return "decoder norm per layer: " + ", ".join(f"{l}: {v:.3g}" for l, v in enumerate(norms))


def concept_card(c: Concept, n_examples: int = 5) -> str:
    dead = c.extra.get("dead", False)
    runner = ", ".join(f"{esc(n)} ({s:.2f})" for n, s in zip(c.runner_ups, c.runner_up_scores))
    tokens = ""
    if c.logit_top:
        tokens += '<div class="sub">promotes ' + "".join(f'<span class="tok">{esc(t)}</span>' for t in c.logit_top[:8])
        tokens += "</div>"
    if c.logit_bottom:
        tokens += '<div class="sub">suppresses ' + "".join(
            f'<span class="tok neg">{esc(t)}</span>' for t in c.logit_bottom[:8]
        )
        tokens += "</div>"
    flags = "".join(f" · {esc(k)}: {esc(v if not isinstance(v, float) else f'{v:.2f}')}" for k, v in c.extra.items()
                    if k != "decoder_norms")
    if c.extra.get("decoder_norms"):  # a cross-layer transcoder's feature: what it writes to each later layer
        tokens = f'<div class="sub">{esc(decoder_norms_text(c.extra["decoder_norms"]))}</div>' + tokens
    if any(e.image is not None for e in c.top_examples + c.quantile_examples):
        examples = image_examples_html(c)
    else:
        examples = "".join(example_html(e) for e in c.top_examples[:n_examples])
        if c.quantile_examples:
            examples += '<div class="sub">across the activation range</div>' + "".join(
                example_html(e) for e in c.quantile_examples[::2]
            )
    return (
        f'<section class="card{" dead" if dead else ""}" id="c{c.id}">'
        f'<h2><span class="id">#{c.id}</span>{esc(c.name or "(unnamed)")}</h2>'
        f'<div class="sub">{esc(c.namer)} score {c.score:.3f}{flags}</div>'
        + (f'<div class="runner">also: {runner}</div>' if runner else "")
        + scores_html(c)
        + f'<div class="row">{histogram_svg(c.histogram.get("edges", []), c.histogram.get("counts", []))}'
        f'<div class="stat">fires on {100 * c.frequency:.2f}% of rows<br>max {c.stats.get("max", 0):.3g}'
        f' · mean when active {c.stats.get("mean_active", 0):.3g}</div></div>'
        f"{tokens}{examples or '<div class=sub>no activating examples</div>'}</section>"
    )


def scores_html(c: Concept) -> str:
    """The card's score lines: confidence, each scorer's score (with its negatives), each namer's name."""
    if not c.scores and not c.names:
        return ""
    parts = [f"confidence {c.confidence:.2f}"] if c.confidence is not None else []
    for name, m in c.scores.items():
        s = m.get("score")
        neg = f" ({esc(m['negatives'])} negatives)" if m.get("negatives") else ""
        parts.append(f"{esc(name)} {s:.3f}{neg}" if isinstance(s, (int, float)) else f"{esc(name)} –")
    names = ", ".join(f"{esc(n)}: {esc(e.get('name', ''))}" for n, e in c.names.items())
    return (f'<div class="sub scores">{" · ".join(parts)}</div>'
            + (f'<div class="runner">namers: {names}</div>' if len(c.names) > 1 else ""))  # fmt: skip


def page(title: str, header: str, body: str, css: str = "") -> str:
    """THE page skeleton of every report: the escaped ``title``, the shared CSS (plus ``css``), a header bar
    and the main part (``header`` and ``body`` are HTML the caller built with :func:`esc`)."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
        f"<style>{CSS}{css}</style></head><body><header>{header}</header><main>{body}</main></body></html>\n"
    )


def header_html(n_concepts: int, meta: dict, cbm: bool = False, scored: bool = False) -> str:
    """The header bar of a report's pages: how many concepts, the meta's model, hookpoint, namer and rows, links."""
    m = meta
    parts = [f"{n_concepts} concepts"] + [
        f"{label} {esc(m[key])}" for key, label in (("model", "model"), ("hookpoint", "hookpoint"), ("namer", "namer"),
                                                    ("num_rows", "rows:")) if m.get(key) is not None
    ]  # fmt: skip
    links = '<a href="index.html">concepts</a>' + (' · <a href="cbm.html">concept bottleneck model</a>' if cbm else "")
    if scored:
        links += ' · <a href="scores.html">scores</a>'
    return f'<h1>Concept dictionary</h1><div class="meta">{" · ".join(parts)} · {links}</div>'


def concept_order(frequencies: Sequence[float]) -> list[int]:
    """Latent ids in the report's order: those that fire, most frequent first, then dead ones (ties by id)."""
    return sorted(range(len(frequencies)), key=lambda i: (frequencies[i] <= 0, -frequencies[i], i))


def page_name(i: int) -> str:
    return "index.html" if i == 0 else f"concepts-{i + 1}.html"


def write_report(
    cd: ConceptDictionary, directory: str | Path, cbm: CbmResult | None = None, per_page: int = 200
) -> Path:
    """Write the HTML report into ``directory``; returns the path of ``index.html`` (a block of concepts at a time:
    ``naming.reports.report_stream.ReportWriter``)."""
    # report_scores imports this module's page skeleton
    from conceptdict.naming.reports.report_scores import scorer_names

    concepts = cd.concepts
    return write_report_pages(Path(directory), cd.meta, [c.frequency for c in concepts],
                              lambda i: concept_card(concepts[i]), cbm, per_page, lambda i: concepts[i],
                              scorer_names(cd), sum(1 for c in concepts if c.scores))


def write_report_pages(directory: Path, meta: dict, frequencies: Sequence[float], card: Callable[[int], str],
                       cbm: CbmResult | None = None, per_page: int = 200, row: Callable[[int], Any] | None = None,
                       scorers: Sequence[str] = (), n_scored: int = 0) -> Path:
    """The report of ``len(frequencies)`` concepts given one at a time: ``card(id)`` (:func:`concept_card`) and
    ``row(id)`` (the concept, or its ``report_scores.ScoreRow``) of latent ``id``; the score pages when
    ``n_scored`` of them are scored (by ``scorers``, ``report_scores.scorers_of``); a CBM's pages when ``cbm`` is
    given. Returns the path of ``index.html``."""
    header = header_html(len(frequencies), meta, cbm is not None, n_scored > 0)
    where = write_pages(directory, header, concept_order(frequencies), card, meta.get("thumbnails") or {}, per_page)
    if cbm is not None:
        _write_cbm_pages(cbm, directory, header, where)
    if n_scored:
        from conceptdict.naming.reports.report_scores import write_score_rows

        if row is None:
            raise ValueError(f"{n_scored} concepts are scored: pass row(id) for the score pages")
        write_score_rows(meta, len(frequencies), row, list(scorers), n_scored, directory, header, where)
    return directory / "index.html"


def write_pages(directory: Path, header: str, order: Sequence[int], card: Callable[[int], str],
                thumbnails: dict[str, str], per_page: int = 200) -> dict[int, str]:
    """The concept pages of a report: the cards (``card(id)``, :func:`concept_card`) of ``order``'s latents,
    ``per_page`` a page, and the thumbnails; returns each latent's page."""
    directory.mkdir(parents=True, exist_ok=True)
    pages = [order[i : i + per_page] for i in range(0, len(order), per_page)] or [[]]
    write_thumbnails(thumbnails, directory / "thumbs")
    for p, chunk in enumerate(pages):
        nav = " ".join(
            f'<a href="{page_name(i)}">{i + 1}</a>' if i != p else f"<strong>{i + 1}</strong>" for i in range(len(pages))
        )
        body = f"<nav>pages: {nav}</nav>" if len(pages) > 1 else ""
        body += '<div class="grid">' + "".join(card(i) for i in chunk) + "</div>"
        (directory / page_name(p)).write_text(page("Concept dictionary", header, body), encoding="utf-8")
    log.info("report: %s (%d pages)", directory / "index.html", len(pages))
    return {i: page_name(p) for p, chunk in enumerate(pages) for i in chunk}


def write_thumbnails(thumbnails: dict[str, str], directory: Path) -> None:
    """``directory/CONTEXT.png`` for each image's PNG data URI (image stores; see ``naming.images``)."""
    import base64

    prefix = "data:image/png;base64,"
    for ctx, uri in thumbnails.items():
        if not str(uri).startswith(prefix):
            log.warning("thumbnail of image %s is not a PNG data URI; not shown", ctx)
            continue
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{int(ctx)}.png").write_bytes(base64.b64decode(uri[len(prefix):]))


def _concept_link(cid: int, name: str, where: dict[int, str]) -> str:
    """A link to the concept's card; plain text for a concept without one in this report (another dictionary's,
    in a CBM joined with ``--also``, or one ``--add-pairs`` added)."""
    return f'<a href="{where[cid]}#c{cid}">#{cid} {esc(name)}</a>' if cid in where else f"#{cid} {esc(name)}"


def _write_cbm_pages(cbm: CbmResult, directory: Path, header: str, where: dict[int, str]) -> None:
    m = cbm.metrics
    cov = m.get("coverage", {})
    rows = [
        ("CBM test accuracy", f"{100 * m.get('accuracy', float('nan')):.1f}%"),
        ("raw linear probe test accuracy", f"{100 * m['probe_accuracy']:.1f}%" if "probe_accuracy" in m else "n/a"),
        ("gap to the probe", f"{100 * (m['probe_accuracy'] - m['accuracy']):+.1f} points" if "probe_accuracy" in m
         else "n/a"),
        ("lambda (chosen on validation)", f"{cbm.lam:g}{chosen_refit(m)}"),
        ("zero weights", f"{m.get('zero_weights', 0)} of {m.get('n_weights', 0)}"),
        ("concepts used", str(m.get("concepts_used", ""))),
        ("concepts for 90/95/99% of a prediction",
         " / ".join(f"{cov.get(k, float('nan')):.1f}" for k in ("90", "95", "99"))),
        ("split train/val/test", f"{m.get('n_train')}/{m.get('n_val')}/{m.get('n_test')}"),
    ]  # fmt: skip
    if m.get("probe_all_parts_accuracy") is not None:
        rows.insert(3, ("probe on every dictionary's raw inputs", f"{100 * m['probe_all_parts_accuracy']:.1f}% (gap "
                        f"{100 * (m['probe_all_parts_accuracy'] - m['accuracy']):+.1f} points)"))
    if per := m.get("concepts_per_prediction"):
        rows.insert(-1, ("concepts per prediction (median)", f"{per['nonzero']:.0f} contribute, {per['90']:.0f} make "
                                                              "up 90%"))  # fmt: skip
    rows[-1:-1] = [(f"concepts of {p['route']}", f"{p['used']} of {p['width']} used, "
                    f"{100 * p['contribution_share']:.1f}% of the positive contribution") for p in m.get("parts") or ()]
    table = "<table>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"
    classes = "".join(
        f'<li><a href="cbm-class-{i}.html">{esc(c)}</a> — '
        + ", ".join(esc(x.name) for x in class_concepts(cbm, i, top=4))
        + "</li>"
        for i, c in enumerate(cbm.classes)
    )
    curve = "".join(
        f"<tr><td>{p['lambda']:g}{' (chosen)' if is_chosen(p, cbm.lam) else ''}</td><td>{describe_fit(p)}</td>"
        f"<td>{100 * p['val_accuracy']:.1f}%</td><td>{p['concepts_used']}</td></tr>"
        for p in m.get("lambda_path", [])
    )
    if curve:
        curve = (f"<h2>Sparsity trade-off</h2><p>Validation accuracy per lambda, of its L1 fit and of its concepts "
                 f"refitted without the L1 term; the chosen fit is within {100 * m['val_tolerance']:g} points of the "
                 "best and uses the fewest concepts.</p><table><tr>"
                 f"<th>lambda</th><th>fit</th><th>validation accuracy</th><th>concepts used</th></tr>{curve}</table>")
    notes = gap_notes(m)
    why = f"<h2>Gap to the probe</h2><p>{esc(notes[0])}</p><ul>" + "".join(
        f"<li>{esc(n[2:])}</li>" for n in notes[1:]) + "</ul>" if notes else ""
    body = f"<h2>Concept bottleneck model</h2>{table}{curve}{why}<h2>Classes</h2><ul>{classes}</ul>"
    (directory / "cbm.html").write_text(page("Concept bottleneck model", header, body), encoding="utf-8")
    for i, c in enumerate(cbm.classes):
        top = class_concepts(cbm, i, top=25)
        wmax = max((x.value for x in top), default=1.0) or 1.0
        trs = "".join(
            f'<tr><td>{_concept_link(x.concept_id, x.name, where)}</td><td>{x.value:.3f}</td>'
            f'<td><span class="bar" style="width:{int(200 * x.value / wmax)}px"></span></td></tr>'
            for x in top
        )
        body = (
            f'<nav><a href="cbm.html">all classes</a></nav><h2>Class: {esc(c)}</h2>'
            f"<p>Concepts with the largest positive weights (applied to standardised concept activations).</p>"
            f"<table><tr><th>concept</th><th>weight</th><th></th></tr>{trs}</table>"
        )
        (directory / f"cbm-class-{i}.html").write_text(page(f"CBM class {c}", header, body), encoding="utf-8")
