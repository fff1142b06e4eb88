"""The per-prediction bound in the CBM's choice (``CbmConfig.max_per_prediction``, naming/bottleneck/path.py): only
fits whose median concepts per validation prediction is at most the bound may be chosen; the path grows above the
grid while none is; where none is after it, the fewest is chosen with a warning; 0 is the rule without it."""

from __future__ import annotations

import logging

import pytest
import torch
from conceptdict.naming.bottleneck.cbm import CbmConfig, train_cbm
from conceptdict.naming.bottleneck.path import choose_lambda, per_prediction_breach
from conceptdict.naming.reports.report_text import format_cbm

pytestmark = pytest.mark.unit

CHEAP = {"refit_l2": [10.0], "cv_folds": 0, "max_iter": 500, "probe_l2": [1.0]}


def spread(n: int = 600, L: int = 48, seed: int = 0):
    """Two classes, each of the L non-negative concepts (all active on every row) carrying a little of the label: the
    most accurate fits weight most of them, so a prediction reads many concepts; a few concepts predict worse."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    concepts = torch.rand(n, L, generator=g) + 0.25 * y[:, None] * torch.rand(L, generator=g)
    return concepts, [("no", "yes")[i] for i in y.tolist()], [f"c{i}" for i in range(L)]


def fit(**kw):
    concepts, labels, names = spread()
    return train_cbm(concepts, labels, names, CbmConfig(scale="std", **{**CHEAP, **kw}))


def chosen(result):
    (entry,) = [p for p in result.metrics["lambda_path"] if p["chosen"]]
    return entry


def test_the_breach_names_the_median_and_the_bound():
    assert per_prediction_breach(40.0, 50, 32) == "40 concepts per prediction (median) > 32"
    assert per_prediction_breach(32.0, 50, 32) is None and per_prediction_breach(500.0, 900, 0) is None
    assert per_prediction_breach(0.0, 0, 32) == "no concepts"  # keeps the bound trivially, and is no CBM
    path = [{"lambda": 0.1, "val_accuracy": 0.9, "concepts_used": 40, "breach": "40 per prediction"},
            {"lambda": 1.0, "val_accuracy": 0.8, "concepts_used": 30, "breach": None}]
    assert choose_lambda(path, 0.005)["lambda"] == 1.0
    assert choose_lambda(path, 0.005, breach=lambda p: None)["lambda"] == 0.1  # the rule without the bound


def test_the_bound_changes_the_choice_and_the_chosen_fit_keeps_it():
    lams = [0.01, 0.1, 1.0, 3.0, 5.0, 7.0]
    free = fit(lambdas=lams, max_per_prediction=0, grow_lambda=0)
    many = chosen(free)["per_prediction"]
    assert many > 20  # the rule without the bound reads many concepts per prediction here
    bounded = fit(lambdas=lams, max_per_prediction=16, grow_lambda=0)
    entry, report = chosen(bounded), bounded.metrics["per_prediction_bound"]
    assert entry["per_prediction"] <= 16 and not entry["breach"]
    assert report["max"] == 16 and report["met"] and report["changed"]
    assert (report["unbounded"]["lambda"], report["unbounded"]["l2"]) == (free.lam, free.metrics["refit_l2"])
    assert report["unbounded"]["per_prediction"] == many
    # every fit above the bound is marked and never chosen; the best of those that keep it sets the tolerance
    kept = [p for p in bounded.metrics["lambda_path"] if p["per_prediction"] <= 16 and p["concepts_used"]]
    assert all(p["breach"] for p in bounded.metrics["lambda_path"] if p not in kept)
    assert entry["val_accuracy"] >= max(p["val_accuracy"] for p in kept) - 0.005 - 1e-12
    assert bounded.metrics["concepts_per_prediction"]["nonzero"] < free.metrics["concepts_per_prediction"]["nonzero"]
    assert "per-prediction bound  at most 16 concepts per prediction (median, validation): kept; without it: " \
           f"lambda {free.lam:g}, {many:g} per prediction" in format_cbm(bounded)


def test_bound_zero_is_the_rule_without_it():
    lams = [0.001, 0.01, 0.1, 1.0]
    free = fit(lambdas=lams, max_per_prediction=0)
    loose = fit(lambdas=lams, max_per_prediction=10 ** 6)  # a bound that never binds
    assert torch.equal(free.weight, loose.weight) and free.lam == loose.lam
    assert free.metrics["per_prediction_bound"] == {**loose.metrics["per_prediction_bound"], "max": 0}
    assert not free.metrics["per_prediction_bound"]["changed"] and free.metrics["per_prediction_bound"]["met"]
    assert all("breach" not in p for p in free.metrics["lambda_path"])  # nothing bounded, nothing marked
    strip = [{k: v for k, v in p.items() if k not in ("breach", "chosen")} for p in loose.metrics["lambda_path"]]
    assert strip == [{k: v for k, v in p.items() if k != "chosen"} for p in free.metrics["lambda_path"]]
    assert "per-prediction bound" not in format_cbm(free)


def test_the_path_grows_while_no_fit_keeps_the_bound():
    grid = [0.001, 0.003]  # every fit on the grid reads many concepts per prediction
    grown = fit(lambdas=grid, max_per_prediction=8, grow_lambda=8)
    path = grown.metrics["lambda_path"]
    assert all(p["breach"] for p in path if p["lambda"] in grid)
    assert grown.lam > grid[-1] and chosen(grown)["per_prediction"] <= 8
    assert grown.metrics["per_prediction_bound"]["met"]
    lams = sorted({p["lambda"] for p in path})
    assert lams[2:] == pytest.approx([0.003 * 3 ** i for i in range(1, len(lams) - 1)])
    fixed = fit(lambdas=grid, max_per_prediction=8, grow_lambda=0)
    assert sorted({p["lambda"] for p in fixed.metrics["lambda_path"]}) == grid


def test_where_no_fit_keeps_the_bound_the_fewest_is_chosen_and_a_warning_says_so(caplog):
    grid = [0.001, 0.003]
    with caplog.at_level(logging.WARNING, logger="conceptdict.naming.bottleneck.path"):
        res = fit(lambdas=grid, max_per_prediction=2, grow_lambda=0)
    path, report = res.metrics["lambda_path"], res.metrics["per_prediction_bound"]
    assert all(p["breach"] for p in path)
    entry = chosen(res)
    assert entry["per_prediction"] == min(p["per_prediction"] for p in path) > 2
    assert not report["met"] and report["max"] == 2
    assert "reads at most 2 concepts per prediction" in caplog.text and "--max-per-prediction" in caplog.text
    assert "NOT met by any fit; the fewest chosen" in format_cbm(res)


def test_the_bound_is_a_flag_with_its_default():
    assert CbmConfig().max_per_prediction == 32
    assert "per_prediction" in fit(lambdas=[0.1], grow_lambda=0).to_pandas().columns
