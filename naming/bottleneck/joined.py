"""One bottleneck over several dictionaries' concepts (``conceptdict cbm CONCEPTS --also OTHER``): e.g. a sentence
dictionary's concepts beside a token dictionary's, pooled per text.

- :func:`align_inputs`: another dictionary's features of the same labelled inputs, reordered to the first's inputs
  by context index (the stores must hold the same texts with the same labels: both cached from one dataset, the
  token-level one with ``--packing false``).
- :class:`ConceptPart`: one dictionary's columns in the joined concepts.
- :func:`part_scale`: each part gets the scale it gets alone (``baseline.concept_scale`` with its own probe and
  decoder directions), so parts in other units (a sentence embedding's activations against pooled token
  activations) cost alike under the one L1 penalty: both scales leave a part's scaled concepts with a training std
  averaging 1. One probe scale over every part would normalise them together (on man2 the token part's scaled std
  then averages 6x the sentence part's), and a part's decoder directions lie in its own hookpoint's space, which
  only its own probe reads.

Shapes: N inputs, L concepts in all, D raw width of a part's hookpoint.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from conceptdict.naming.bottleneck.baseline import RawProbe, concept_scale, fit_raw_probe
from conceptdict.naming.bottleneck.features import CbmFeatures

__all__ = ["ConceptPart", "align_inputs", "check_same_texts", "part_scale", "parts_metrics", "route_names",
           "wide_probe_accuracy"]

FIX = ("cache both stores from the same dataset with the same --label-column (a token-level one with --packing false, "
       "one text per context)")


class ConceptPart(NamedTuple):
    """One dictionary's concepts among a joined CBM's columns (in the order given)."""

    route: str
    """The prefix of its concepts' names (its hookpoint)."""
    width: int
    """How many concept columns it has."""
    raw: Tensor | None = None
    """[N, D] the raw activations its own probe reads (a token store's: each input's mean token row); None: the
    CBM's raw probe (the first part's)."""
    directions: Tensor | None = None
    """[width, D] its concepts' decoder directions in ``raw``'s units, or None (its scale falls back to ``std``)."""


def route_names(hookpoints: Sequence[str]) -> list[str]:
    """Each part's name prefix: its hookpoint, numbered where two parts share one."""
    return [h if hookpoints.count(h) == 1 else f"{h}#{i}" for i, h in enumerate(hookpoints)]


def align_inputs(first: CbmFeatures, other: CbmFeatures, first_name: str, other_name: str) -> CbmFeatures:
    """``other``'s concepts, raw activations and labels reordered to ``first``'s inputs (by context index). Refuses
    (naming both stores and the fix) when an input of ``first`` is not in ``other`` or its label differs there."""
    fix = FIX
    if first.inputs is None or other.inputs is None:
        raise ValueError(f"{first_name if first.inputs is None else other_name} records no context index per input, "
                         f"so its inputs cannot be matched to the other's; {fix}")
    order = torch.argsort(other.inputs)
    ids = other.inputs[order]
    at = torch.searchsorted(ids, first.inputs).clamp_max(max(len(ids) - 1, 0))
    found = ids[at] == first.inputs if len(ids) else torch.zeros(len(first.inputs), dtype=torch.bool)
    if not bool(found.all()):
        missing = int((~found).sum())
        example = int(first.inputs[~found][0])
        raise ValueError(f"{missing} of {len(first.inputs)} inputs of {first_name} (e.g. context {example}) are not in "
                         f"{other_name}; {fix}")
    rows = order[at]
    labels = [other.labels[i] for i in rows.tolist()]
    differ = [i for i, (a, b) in enumerate(zip(first.labels, labels)) if str(a) != str(b)]
    if differ:
        i = differ[0]
        raise ValueError(f"{len(differ)} of {len(labels)} inputs have another label in {other_name} than in "
                         f"{first_name} (context {int(first.inputs[i])}: {labels[i]!r} against "
                         f"{first.labels[i]!r}); {fix}")
    return CbmFeatures(other.concepts[rows], other.raw[rows], labels, first.inputs)


def _texts_of(store) -> tuple:
    """(the fingerprint of the texts a store was cached from: its dataset's sha256, or its in-memory records'; the
    text column; the split), from its manifest."""
    data, config = store.manifest.get("dataset") or {}, store.manifest.get("config") or {}
    return data.get("sha256") or data.get("records_sha256"), config.get("text_column"), config.get("split")


def check_same_texts(first, other) -> None:
    """Refuses (naming both stores and what differs) when two stores record that they were cached from other texts:
    another dataset file or records, text column or split. Stores that record no fingerprint are matched by
    context index and label alone (:func:`align_inputs`)."""
    a, b = _texts_of(first), _texts_of(other)
    what = ("dataset", "text column", "split")
    differ = [f"{w} {x!r} against {y!r}" for w, x, y in zip(what, a, b) if x is not None and y is not None and x != y]
    if differ:
        raise ValueError(f"stores {first.path} and {other.path} were cached from other texts ({'; '.join(differ)}); "
                         f"{FIX}")


def part_scale(concepts_fit: Tensor, parts: Sequence[ConceptPart], how: str, probes: Sequence[RawProbe | None]
               ) -> tuple[Tensor, str]:  # fmt: skip
    """(scale [L], the rules used, e.g. "probe" or "probe+std") for the joined concepts whose fitting rows are
    ``concepts_fit`` [n, L]: each part's :func:`baseline.concept_scale` with its own probe (``probes``, one per
    part) and directions, side by side."""
    if sum(p.width for p in parts) != concepts_fit.shape[1]:
        raise ValueError(f"the parts' widths {[p.width for p in parts]} do not add up to the "
                         f"{concepts_fit.shape[1]} concept columns; pass one part per dictionary, in column order")
    scales, rules, at = [], [], 0
    for part, probe in zip(parts, probes):
        scale, rule = concept_scale(concepts_fit[:, at:at + part.width], how, probe, part.directions)
        scales.append(scale)
        rules.append(rule)
        at += part.width
    return torch.cat(scales), rules[0] if len(set(rules)) == 1 else "+".join(rules)


def parts_metrics(parts: Sequence[ConceptPart], weight: Tensor, contrib: Tensor,
                  probes: Sequence[RawProbe | None]) -> list[dict]:  # fmt: skip
    """Per part of a joined CBM with weight [C, L]: its route, width, the concepts it uses, its share of the test
    predictions' positive contribution (contrib [n_test, L] to each one's predicted class) and, where it has its
    own probe, that probe's test accuracy."""
    positive = contrib.clamp_min(0)
    total = float(positive.sum()) or 1.0
    out, at = [], 0
    for part, probe in zip(parts, probes):
        cols = slice(at, at + part.width)
        out.append({"route": part.route, "width": part.width, "used": int((weight[:, cols] != 0).any(0).sum()),
                    "contribution_share": float(positive[:, cols].sum()) / total,
                    "own_probe_accuracy": probe.test_accuracy if part.raw is not None and probe is not None else None})
        at += part.width
    return out


def wide_probe_accuracy(raw: Tensor | None, parts: Sequence[ConceptPart], keep: Tensor, y: Tensor, split,
                        n_classes: int, cfg, folds: int) -> float | None:  # fmt: skip
    """The test accuracy of the CBM's probe (``baseline.fit_raw_probe``, the same split, folds and L2 grid) on the
    CBM's raw inputs and every part's own side by side (e.g. the sentence embedding and each text's mean token row):
    the black box given all that the joined CBM reads. None when only one kind of raw input is there."""
    wide = [raw] * (raw is not None) + [p.raw for p in parts if p.raw is not None]
    if len(wide) < 2:
        return None
    x = torch.cat([w.float() for w in wide], 1)[keep].to(cfg.device)
    return fit_raw_probe(x, y, *split, n_classes, cfg.probe_l2, cfg.max_iter, cfg.tol, folds=folds,
                         seed=cfg.seed).test_accuracy  # fmt: skip
