"""Concepts and CBMs as text for a terminal: what ``conceptdict name``, ``show`` and ``cbm`` print."""

from __future__ import annotations

from collections.abc import Sequence

from conceptdict.naming.bottleneck.cbm import gap_notes
from conceptdict.naming.bottleneck.path import chosen_refit, describe_fit, is_chosen
from conceptdict.naming.concepts import Concept, ConceptDictionary
from conceptdict.naming.reports.report import decoder_norms_text
from conceptdict.naming.reports.report_scores import key_of, scorer_names

BARS = " ▁▂▃▄▅▆▇█"


def format_concepts(cd: ConceptDictionary | Sequence[Concept], n: int = 12) -> str:
    """A few named concepts (of a concept dictionary, or given), most frequent first, one per line."""
    concepts = cd.concepts if isinstance(cd, ConceptDictionary) else cd
    firing = sorted((c for c in concepts if c.frequency > 0), key=lambda c: -c.frequency)
    return "\n".join(f"  #{c.id:<6} {c.name[:40]:<40} score {c.score:6.3f}  freq {100 * c.frequency:6.2f}%"
                     for c in firing[:n])


def sparkline(counts: list[float]) -> str:
    top = max(counts, default=0)
    if top <= 0:
        return "(never fires)"
    return "".join(BARS[min(len(BARS) - 1, round((len(BARS) - 1) * c / top + 0.49 * (c > 0)))] for c in counts)


def short(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def format_concept(c: Concept, examples: int = 8, width: int = 100) -> str:
    """One concept's card: name, runner-ups, frequency, statistics, histogram, logit lens, scores, top contexts."""
    lines = [f"#{c.id}  {c.name or '(unnamed)'}   [{c.namer} score {c.score:.3f}]"]
    if c.runner_ups:
        lines.append("also:       " + ", ".join(f"{n} ({s:.3f})" for n, s in zip(c.runner_ups, c.runner_up_scores)))
    lines.append(f"frequency:  {100 * c.frequency:.3f}% of rows" + ("  (dead)" if c.extra.get("dead") else ""))
    lines.append("stats:      " + "  ".join(f"{k} {v:.4g}" for k, v in c.stats.items()))
    edges = c.histogram.get("edges") or [0.0]
    lines.append(f"histogram:  0 {sparkline(c.histogram.get('counts', []))} {edges[-1]:.3g}")
    if c.logit_top:
        lines.append("promotes:   " + " ".join(repr(t) for t in c.logit_top))
        lines.append("suppresses: " + " ".join(repr(t) for t in c.logit_bottom))
    if c.scores or c.confidence is not None:
        lines.append(f"confidence: {'–' if c.confidence is None else f'{c.confidence:.3f}'}")
        for scorer, m in c.scores.items():
            shown = ", ".join(f"{k}={short(v)}" for k, v in m.items() if k != "score")
            lines.append(f"score:      {scorer} {short(m.get('score'))}  ({shown})")
    for namer, entry in c.names.items():
        scored = ", ".join(f"{k} {short(v.get('score'))}" for k, v in entry.get("scores", {}).items())
        lines.append(f"namer:      {namer}: {entry.get('name', '')!r} {scored}")
    if c.extra.get("decoder_norms"):
        lines.append(decoder_norms_text(c.extra["decoder_norms"]))
    extra = {k: v for k, v in c.extra.items() if k not in ("dead", "decoder_norms")}
    if extra:
        lines.append("extra:      " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    lines.append("top contexts (activating token in «»):")
    for e in c.top_examples[:examples]:
        text = " ".join(e.marked_text("«", "»").split())
        lines.append(f"  {e.activation:8.4g}  {text[:width]}")
    return "\n".join(lines)


def format_ranking(cd: ConceptDictionary, sort: str = "confidence", min_score: float | None = None,
                   max_score: float | None = None, limit: int = 30) -> str:
    """One line per concept: id, name, confidence and every scorer's score, ranked by ``sort``."""
    scorers = scorer_names(cd)
    if sort != "confidence" and sort not in scorers:
        raise ValueError(f"--sort {sort!r} is not confidence or a scorer of this dictionary ({scorers or 'none'}); "
                         "run `conceptdict score` first or pick one of those")
    rows = [(key_of(c, sort), c) for c in cd.concepts]
    rows = [(k, c) for k, c in rows if k is not None and (min_score is None or k >= min_score)
            and (max_score is None or k <= max_score)]
    rows.sort(key=lambda kc: (-kc[0], kc[1].id))
    head = f"{'id':>6}  {'name':30s} {'confidence':>10}" + "".join(f" {s:>10.10}" for s in scorers) + "  other namers"
    lines = [head]
    for _, c in rows[: limit or None]:
        cells = "".join(f" {short(c.scores.get(s, {}).get('score')):>10}" for s in scorers)
        others = ", ".join(f"{n}: {e.get('name')}" for n, e in c.names.items() if e.get("name") != c.name)
        lines.append(f"{c.id:>6}  {c.name[:30]:30s} {short(c.confidence):>10}{cells}  {others}")
    lines.append(f"{len(rows)} concepts match (sorted by {sort})")
    return "\n".join(lines)


def format_cbm(cbm) -> str:
    """Accuracy of a CBM beside its linear probe, its sparsity and how many concepts a prediction needs."""
    m = cbm.metrics
    cov = m["coverage"]
    scale = f", concepts scaled by {m['scale']}" if "scale" in m else ""
    lines = [f"CBM accuracy        {100 * m['accuracy']:.1f}%  (lambda {cbm.lam:g}{chosen_refit(m)}{scale}, "
             f"{m['n_classes']} classes, test {m['n_test']} inputs)"]
    if "probe_accuracy" in m:
        lines.append(f"linear probe (raw)  {100 * m['probe_accuracy']:.1f}%  (gap {100 * (m['probe_accuracy'] - m['accuracy']):+.1f} points)")
    lines += [f"zero weights        {m['zero_weights']} of {m['n_weights']} ({m['concepts_used']} concepts used)",
              f"concepts per prediction for 90/95/99%: {cov['90']:.1f} / {cov['95']:.1f} / {cov['99']:.1f}"]
    if m.get("concepts_per_prediction"):
        per = m["concepts_per_prediction"]
        lines.append(f"concepts per prediction (median): {per['nonzero']:.0f} contribute, {per['90']:.0f} make up 90%")
    if m.get("probe_all_parts_accuracy") is not None:
        wide = m["probe_all_parts_accuracy"]
        lines.append(f"probe (every part)  {100 * wide:.1f}%  (gap {100 * (wide - m['accuracy']):+.1f} points; "
                     "every dictionary's raw inputs side by side)")
    parts = m.get("parts") or ()
    width = max((len(part["route"]) for part in parts), default=0)
    for part in parts:
        lines.append(f"concepts of {part['route'] + ':':<{width + 1}} {part['used']} of {part['width']} used, "
                     f"{100 * part['contribution_share']:.1f}% of the positive contribution")
    if m.get("added_bound"):
        b, a = m["added_bound"], m.get("added_concepts") or {}
        lines.append(f"added concepts      refused: {b['refused']}" if b["refused"] else
                     f"added concepts      {len(a.get('used', ()))} of {a.get('n_added', 0)} used, "
                     f"{100 * m['added_share']:.1f}% of the |contribution| (bound {100 * b['max_share']:g}%)")
    if m.get("lambda_path"):
        on = f"{m['cv_folds']}-fold cross-validation" if m.get("cv_folds") else "validation"
        lines.append(f"lambda trade-off ({on}; chosen: within {100 * m['val_tolerance']:g} points of the best, "
                     "fewest concepts):")
        lines += [f"  lambda {p['lambda']:<8g} {describe_fit(p):<13} val {100 * p['val_accuracy']:5.1f}%  "
                  f"{p['concepts_used']:>6} concepts" + (f"  {p['per_prediction']:>5g} per prediction" if
                                                         "per_prediction" in p else "")
                  + ("  <- chosen" if is_chosen(p, cbm.lam) else "") for p in m["lambda_path"]]
    if (b := m.get("per_prediction_bound")) and b["max"]:
        u = b["unbounded"] or {}
        lines.append(f"per-prediction bound  at most {b['max']} concepts per prediction (median, validation): "
                     + ("kept" if b["met"] else "NOT met by any fit; the fewest chosen")
                     + (f"; without it: lambda {u.get('lambda'):g}, {u.get('per_prediction'):g} per prediction"
                        if b["changed"] and u else ""))
    return "\n".join(lines + gap_notes(m))
