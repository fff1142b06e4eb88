"""Why a CBM trails its raw probe: the notes ``conceptdict cbm`` prints and the report shows (:func:`gap_notes`)."""

from __future__ import annotations

from typing import Any

GAP_POINTS = 2.0
"""A CBM more than this many accuracy points below its raw probe is explained in its output (:func:`gap_notes`)."""
FVU_MARGIN = 0.1
"""Rows whose FVU exceeds the dictionary's own held-out FVU by more than this share lie partly outside its data."""


def gap_notes(metrics: dict[str, Any]) -> list[str]:
    """Why a CBM trails its raw probe by more than :data:`GAP_POINTS` (from ``metrics["dictionary"]``: the
    dictionary's FVU and L0 on the labelled rows, set by ``conceptdict.cbm``); [] when it does not."""
    gap = metrics.get("probe_gap")
    if gap is None or 100 * gap <= GAP_POINTS:
        return []
    notes = [f"the CBM is {100 * gap:.1f} points below the raw probe (more than {GAP_POINTS:g}); why:"]
    if (dense := metrics.get("concept_probe_accuracy")) is not None:
        lost = 100 * (metrics["probe_accuracy"] - dense)
        where = (f"{lost:.1f} points are lost in what the concepts carry (more active latents per row, a larger k, "
                 "or other concepts carry more), " if lost > 0 else "they carry what the raw probe reads, ")
        notes.append(f"- the same probe on the concept activations (dense: all of them, no L1) is at {100 * dense:.1f}"
                     f"%: {where}{100 * (dense - metrics['accuracy']):.1f} in the bottleneck's sparsity")
    if not metrics.get("parts"):  # one dictionary: the route that held the probe on every bench corpus joins two
        notes.append("- a second dictionary of the same texts at another level (a sentence one and a token one, "
                     "`conceptdict cbm CONCEPTS --also OTHER`) held the probe within a point on six held-out corpora "
                     "where each alone missed on some (docs/guide/concepts.md)")
    d = metrics.get("dictionary")
    if not d:
        return notes + ["- no dictionary measurement on these rows was recorded (fit through `conceptdict cbm`)"]
    own = d.get("training_fvu")
    notes += [f"- the dictionary's FVU on these rows is {d['fvu']:.3f} ({d['rows']} rows: {d['rows_from']})"
              + ("" if own is None else f"; on its own training data's held-out rows {own:.3f}"),
              f"- {d['l0']:.1f} concepts fire per row in its code (k={d['k']}); the CBM uses "
              f"{metrics.get('concepts_used')} of {d['n_latents']}"]  # fmt: skip
    fit = d.get("fit_gap") or {}
    if fit.get("memorised"):
        notes.append(f"- it memorised its training rows (FVU {fit['train_fvu']:.3f} on them, {fit['heldout_fvu']:.3f} "
                     "held out): fewer latents, or the broad dictionary (`conceptdict broad`), should help")
    if own is None:
        notes.append(f"- it records no held-out FVU of its own to compare with; {100 * d['fvu']:.0f}% of these rows' "
                     "variance lies outside its concepts, and a broader dictionary helps when that is well above "
                     "what it reaches on its own data")
    elif d["fvu"] > own * (1 + FVU_MARGIN):
        notes.append("- these rows are reconstructed worse than its own data: they lie partly outside what it learned, "
                     "so a broader dictionary (or one trained on these rows) should help")
    else:
        notes.append("- these rows are reconstructed as well as its own data, so a broader dictionary is unlikely to "
                     "help by coverage: what the bottleneck misses is how the classes are split over narrow latents "
                     "(a shorter run or fewer latents gives broader ones)")
    return notes
