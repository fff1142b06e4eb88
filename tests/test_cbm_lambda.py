"""Choosing the CBM's lambda (within a tolerance of the best validation accuracy, then the sparsest), the trade-off
curve it records and prints, and why a CBM trails its raw probe when it does by more than two points."""

from __future__ import annotations

import pytest
import torch

from conceptdict.naming.bottleneck.cbm import CbmConfig, CbmResult, choose_lambda, gap_notes, train_cbm
from conceptdict.naming.reports.report_text import format_cbm

pytestmark = pytest.mark.unit

PATH = [
    {"lambda": 0.1, "val_accuracy": 0.90, "concepts_used": 300},
    {"lambda": 1.0, "val_accuracy": 0.896, "concepts_used": 120},
    {"lambda": 3.0, "val_accuracy": 0.894, "concepts_used": 120},
    {"lambda": 10.0, "val_accuracy": 0.85, "concepts_used": 30},
]


def test_choose_lambda_takes_the_sparsest_within_the_tolerance_of_the_best():
    assert choose_lambda(PATH, 0.0)["lambda"] == 0.1  # only the best qualifies
    assert choose_lambda(PATH, 0.005)["lambda"] == 1.0  # 1.0 qualifies (0.4 below), 3.0 does not (0.6)
    assert choose_lambda(PATH, 0.007)["lambda"] == 3.0  # 3.0 now qualifies too: same concepts, larger lambda
    assert choose_lambda(PATH, 0.06)["lambda"] == 10.0  # everything qualifies: the fewest concepts


def _dataset(n=400, L=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    concepts = torch.rand(n, L, generator=gen)
    concepts[torch.arange(n), y] += 0.6  # concept c signals class c, the rest is noise
    raw = concepts @ torch.randn(L, 12, generator=gen)
    return concepts, [f"class{int(v)}" for v in y], [f"c{i}" for i in range(L)], raw


def test_train_cbm_records_the_whole_curve_and_the_tolerance_moves_the_choice():
    concepts, labels, names, raw = _dataset()
    lams = [0.01, 0.3, 3.0, 30.0]
    exact = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, val_tolerance=0.0, grow_lambda=0), raw=raw)
    path = exact.metrics["lambda_path"]
    assert [p["lambda"] for p in path] == lams and exact.metrics["val_tolerance"] == 0.0
    assert all(set(p) == {"lambda", "val_accuracy", "concepts_used", "zero_weights"} for p in path)
    best = max(p["val_accuracy"] for p in path)
    chosen = next(p for p in path if p["lambda"] == exact.lam)
    assert chosen["val_accuracy"] == best and chosen["concepts_used"] == exact.metrics["concepts_used"]
    assert len({p["concepts_used"] for p in path}) > 1  # the curve spans different sparsities
    loose = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, val_tolerance=0.99, grow_lambda=0), raw=raw)
    assert loose.metrics["concepts_used"] == min(p["concepts_used"] for p in path) < chosen["concepts_used"]
    assert loose.metrics["probe_gap"] == pytest.approx(loose.metrics["probe_accuracy"] - loose.metrics["accuracy"])
    with pytest.raises(ValueError, match="val_tolerance=1.5"):
        CbmConfig(val_tolerance=1.5)


def test_the_path_grows_above_the_grid_while_its_largest_lambda_is_chosen_and_stops_when_accuracy_falls():
    concepts, labels, names, raw = _dataset()
    grid = [0.001, 0.003]  # both fit the signal: the larger (sparser) one is chosen, so the path grows
    grown = train_cbm(concepts, labels, names, CbmConfig(lambdas=grid, grow_lambda=8), raw=raw)
    path = grown.metrics["lambda_path"]
    lams = [p["lambda"] for p in path]
    assert lams[:2] == grid and len(lams) > 2 and lams[2:] == pytest.approx([0.003 * 3 ** i for i in
                                                                             range(1, len(lams) - 1)])
    best = max(p["val_accuracy"] for p in path)
    chosen = next(p for p in path if p["lambda"] == grown.lam)
    assert grown.lam > grid[-1] and chosen["concepts_used"] == min(
        p["concepts_used"] for p in path if p["val_accuracy"] >= best - 0.005 - 1e-12)
    if len(lams) < 2 + 8:  # stopped early: the last lambda tried fell out of the tolerance band
        assert grown.lam != lams[-1] and path[-1]["val_accuracy"] < best - 0.005 or path[-1]["concepts_used"] == 0
    fixed = train_cbm(concepts, labels, names, CbmConfig(lambdas=grid, grow_lambda=0), raw=raw)
    assert [p["lambda"] for p in fixed.metrics["lambda_path"]] == grid and fixed.lam == 0.003
    assert grown.metrics["concepts_used"] <= fixed.metrics["concepts_used"]


def _metrics(gap, fvu=0.40, own=0.41):
    return {"accuracy": 0.9 - gap, "probe_accuracy": 0.9, "probe_gap": gap, "concepts_used": 77,
            "dictionary": {"fvu": fvu, "l0": 16.0, "k": 16, "n_latents": 1024, "rows": 4000,
                           "rows_from": "not trained on", "training_fvu": own}}


def test_gap_notes_say_why_only_above_two_points():
    assert gap_notes(_metrics(0.015)) == []
    assert gap_notes({"accuracy": 0.8}) == []  # no probe, nothing to compare
    same = gap_notes(_metrics(0.07))
    assert same[0].startswith("the CBM is 7.0 points below the raw probe")
    text = "\n".join(same)
    assert "FVU on these rows is 0.400" in text and "own training data's held-out rows 0.410" in text
    assert "16.0 concepts fire per row" in text and "uses 77 of 1024" in text and "unlikely to help" in text
    assert "should help" in "\n".join(gap_notes(_metrics(0.07, fvu=0.60, own=0.40)))
    assert "records no held-out FVU" in "\n".join(gap_notes(_metrics(0.07, own=None)))
    assert "memorised" not in text
    memorised = _metrics(0.07)
    memorised["dictionary"]["fit_gap"] = {"train_fvu": 0.04, "heldout_fvu": 0.44, "ratio": 11.0, "memorised": True}
    assert "it memorised its training rows (FVU 0.040 on them, 0.440 held out)" in "\n".join(gap_notes(memorised))


def test_format_cbm_prints_the_curve_the_gap_and_the_reasons():
    m = {**_metrics(0.05), "n_classes": 4, "n_test": 80, "zero_weights": 5, "n_weights": 96,
         "coverage": {"90": 2.0, "95": 3.0, "99": 4.0}, "val_tolerance": 0.005,
         "lambda_path": [{"lambda": 0.1, "val_accuracy": 0.9, "concepts_used": 20, "zero_weights": 1},
                         {"lambda": 1.0, "val_accuracy": 0.898, "concepts_used": 12, "zero_weights": 5}]}
    res = CbmResult(torch.zeros(4, 24), torch.ones(24), ("a", "b", "c", "d"), tuple(range(24)),
                    tuple(f"c{i}" for i in range(24)), 1.0, m)
    out = format_cbm(res)
    assert "(gap +5.0 points)" in out and "within 0.5 points of the best" in out
    assert "lambda 1        val  89.8%      12 concepts  <- chosen" in out
    assert "lambda 0.1      val  90.0%      20 concepts\n" in out
    assert "5.0 points below the raw probe" in out and "unlikely to help" in out
    assert "points below" not in format_cbm(CbmResult(res.weight, res.scale, res.classes, res.concept_ids,
                                                       res.concept_names, 1.0, {**m, **_metrics(0.01)}))

