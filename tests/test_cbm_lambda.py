"""Choosing the CBM's lambda (within a tolerance of the best validation accuracy, then the sparsest), the trade-off
curve it records and prints, and why a CBM trails its raw probe when it does by more than two points."""

from __future__ import annotations

import pytest
import torch

from conceptdict.naming.bottleneck.baseline import fit_raw_probe, stratified_folds
from conceptdict.naming.bottleneck.cbm import CbmConfig, CbmResult, gap_notes, train_cbm
from conceptdict.naming.bottleneck.path import choose_lambda, refit_support
from conceptdict.naming.bottleneck.solvers import kkt_residual
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
    refits = [{**PATH[1], "l2": 10.0, "val_accuracy": 0.899}, {**PATH[1], "l2": 1.0, "val_accuracy": 0.902}]
    assert choose_lambda(PATH + refits, 0.005) == refits[1]  # same lambda and concepts: the better refit
    assert choose_lambda(PATH + refits, 0.0) == refits[1]  # and it is now the best of all


def _dataset(n=400, L=24, seed=0, signal=0.6):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    concepts = torch.rand(n, L, generator=gen)
    concepts[torch.arange(n), y] += signal  # concept c signals class c, the rest is noise
    raw = concepts @ torch.randn(L, 12, generator=gen)
    return concepts, [f"class{int(v)}" for v in y], [f"c{i}" for i in range(L)], raw


def _l1(path):
    return [p for p in path if p["l2"] is None]


def test_train_cbm_records_the_whole_curve_and_the_tolerance_moves_the_choice():
    concepts, labels, names, raw = _dataset()
    lams = [0.01, 0.3, 3.0, 30.0]
    exact = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, val_tolerance=0.0, grow_lambda=0), raw=raw)
    path = exact.metrics["lambda_path"]
    assert [p["lambda"] for p in _l1(path)] == lams and exact.metrics["val_tolerance"] == 0.0
    keys = {"lambda", "l2", "val_accuracy", "concepts_used", "per_prediction", "breach", "zero_weights", "chosen"}
    assert all(set(p) == keys for p in path)
    best = max(p["val_accuracy"] for p in path)
    (chosen,) = [p for p in path if p["chosen"]]
    assert (chosen["lambda"], chosen["l2"]) == (exact.lam, exact.metrics["refit_l2"])
    assert chosen["val_accuracy"] == best == exact.metrics["val_accuracy"]
    assert chosen["concepts_used"] == exact.metrics["concepts_used"]
    assert len({p["concepts_used"] for p in path}) > 1  # the curve spans different sparsities
    loose = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, val_tolerance=0.99, grow_lambda=0), raw=raw)
    assert loose.metrics["concepts_used"] == min(p["concepts_used"] for p in path) < chosen["concepts_used"]
    assert loose.metrics["probe_gap"] == pytest.approx(loose.metrics["probe_accuracy"] - loose.metrics["accuracy"])
    with pytest.raises(ValueError, match="val_tolerance=1.5"):
        CbmConfig(val_tolerance=1.5)
    with pytest.raises(ValueError, match="refit_l2=.-1"):
        CbmConfig(refit_l2=[-1.0])


def test_each_lambda_is_refitted_on_its_concepts_and_without_refits_the_curve_is_the_l1_path():
    concepts, labels, names, raw = _dataset()
    lams, refit = [0.01, 0.3, 3.0], [0.0, 10.0]
    plain = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, refit_l2=[], grow_lambda=0), raw=raw)
    relaxed = train_cbm(concepts, labels, names, CbmConfig(lambdas=lams, refit_l2=refit, grow_lambda=0), raw=raw)
    assert all(p["l2"] is None for p in plain.metrics["lambda_path"]) and plain.metrics["refit_l2"] is None
    # the L1 fits are the same with or without refits; each lambda's refits use exactly its concepts
    def unmarked(path):
        return [{k: v for k, v in p.items() if k != "chosen"} for p in path]

    assert unmarked(_l1(relaxed.metrics["lambda_path"])) == unmarked(plain.metrics["lambda_path"])
    for lam in lams:
        group = [p for p in relaxed.metrics["lambda_path"] if p["lambda"] == lam]
        assert [p["l2"] for p in group] == [None, *refit]
        assert {p["concepts_used"] for p in group} == {group[0]["concepts_used"]}
    best = max(p["val_accuracy"] for p in relaxed.metrics["lambda_path"])
    assert best >= max(p["val_accuracy"] for p in plain.metrics["lambda_path"])


def test_refit_support_fits_the_used_concepts_without_l1_and_leaves_the_others_at_zero():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(200, 10, generator=gen), torch.randint(0, 3, (200,), generator=gen)
    W = torch.zeros(3, 10)
    W[0, 2], W[1, 5], W[2, 5], W[2, 7] = 1.0, -0.5, 0.3, 0.2  # concepts 2, 5 and 7 are used
    fits = refit_support(x, y, 3, W, [0.0, 100.0], tol=1e-6)
    assert set(fits) == {0.0, 100.0}
    for c, V in fits.items():
        assert (V[:, [0, 1, 3, 4, 6, 8, 9]] == 0).all() and (V[:, [2, 5, 7]] != 0).all()  # every class refitted
        assert kkt_residual(x[:, [2, 5, 7]], y, V[:, [2, 5, 7]], l2=c) < 1e-5  # optimal on the support
    assert fits[100.0].norm() < fits[0.0].norm()
    assert refit_support(x, y, 3, torch.zeros(3, 10), [0.0]) == {} and refit_support(x, y, 3, W, []) == {}


def test_the_path_grows_above_the_grid_while_its_largest_lambda_is_chosen_and_stops_when_accuracy_falls():
    concepts, labels, names, raw = _dataset()
    grid = [0.001, 0.003]  # both fit the signal: the larger (sparser) one is chosen, so the path grows
    grown = train_cbm(concepts, labels, names, CbmConfig(lambdas=grid, grow_lambda=8), raw=raw)
    path = grown.metrics["lambda_path"]
    lams = [p["lambda"] for p in _l1(path)]
    assert lams[:2] == grid and len(lams) > 2 and lams[2:] == pytest.approx([0.003 * 3 ** i for i in
                                                                             range(1, len(lams) - 1)])
    best = max(p["val_accuracy"] for p in path)
    (chosen,) = [p for p in path if p["chosen"]]
    assert grown.lam == chosen["lambda"] > grid[-1] and chosen["concepts_used"] == min(
        p["concepts_used"] for p in path if p["val_accuracy"] >= best - 0.005 - 1e-12)
    if len(lams) < 2 + 8:  # stopped early: the last lambda tried fell out of the tolerance band
        last = [p for p in path if p["lambda"] == lams[-1]]
        assert grown.lam != lams[-1] and all(p["val_accuracy"] < best - 0.005 for p in last) or (
            last[0]["concepts_used"] == 0)
    fixed = train_cbm(concepts, labels, names, CbmConfig(lambdas=grid, grow_lambda=0), raw=raw)
    assert [p["lambda"] for p in _l1(fixed.metrics["lambda_path"])] == grid and fixed.lam == 0.003
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


def test_a_cbm_far_below_its_probe_says_whether_the_concepts_or_the_sparsity_lose_it():
    concepts, labels, names, raw = _dataset(signal=0.6)
    gen = torch.Generator().manual_seed(1)
    blind = torch.rand(concepts.shape, generator=gen)  # concepts that carry nothing of the label; raw carries it all
    cfg = CbmConfig(lambdas=[0.01, 0.1], grow_lambda=0, cv_folds=0)
    lost = train_cbm(blind, labels, names, cfg, raw=raw).metrics
    assert 100 * lost["probe_gap"] > 20 and lost["concept_probe_accuracy"] < lost["probe_accuracy"] - 0.2
    note = [n for n in gap_notes(lost) if "dense: all of them" in n]
    assert len(note) == 1 and "points are lost in what the concepts carry" in note[0]
    carried = {**_metrics(0.07), "concept_probe_accuracy": 0.91}
    assert "they carry what the raw probe reads, 8.0 in the bottleneck's sparsity" in "\n".join(gap_notes(carried))
    close = train_cbm(concepts, labels, names, cfg, raw=raw).metrics
    assert 100 * close["probe_gap"] <= 2 and "concept_probe_accuracy" not in close  # fitted only when it explains


def test_format_cbm_prints_the_curve_the_gap_and_the_reasons():
    m = {**_metrics(0.05), "n_classes": 4, "n_test": 80, "zero_weights": 5, "n_weights": 96,
         "coverage": {"90": 2.0, "95": 3.0, "99": 4.0}, "val_tolerance": 0.005,
         "refit_l2": 10.0,
         "lambda_path": [{"lambda": 0.1, "l2": None, "val_accuracy": 0.9, "concepts_used": 20, "chosen": False},
                         {"lambda": 1.0, "l2": None, "val_accuracy": 0.894, "concepts_used": 12, "chosen": False},
                         {"lambda": 1.0, "l2": 10.0, "val_accuracy": 0.898, "concepts_used": 12, "chosen": True}]}
    res = CbmResult(torch.zeros(4, 24), torch.ones(24), ("a", "b", "c", "d"), tuple(range(24)),
                    tuple(f"c{i}" for i in range(24)), 1.0, m)
    out = format_cbm(res)
    assert "(gap +5.0 points)" in out and "within 0.5 points of the best" in out
    assert "(lambda 1, refit with L2 10, 4 classes" in out
    assert "lambda 1        refit L2 10   val  89.8%      12 concepts  <- chosen" in out
    assert "lambda 1        L1            val  89.4%      12 concepts\n" in out
    assert "lambda 0.1      L1            val  90.0%      20 concepts\n" in out
    assert "5.0 points below the raw probe" in out and "unlikely to help" in out
    older = [{"lambda": 0.1, "val_accuracy": 0.9, "concepts_used": 20}, {"lambda": 1.0, "val_accuracy": 0.898,
                                                                          "concepts_used": 12}]  # written before refits
    out = format_cbm(CbmResult(res.weight, res.scale, res.classes, res.concept_ids, res.concept_names, 1.0,
                               {**m, "lambda_path": older, "refit_l2": None}))
    assert "lambda 1        L1            val  89.8%      12 concepts  <- chosen" in out and "refit" not in out
    assert "points below" not in format_cbm(CbmResult(res.weight, res.scale, res.classes, res.concept_ids,
                                                       res.concept_names, 1.0, {**m, **_metrics(0.01)}))



def test_stratified_folds_partition_the_rows_and_hold_every_class():
    y = torch.tensor([0] * 23 + [1] * 11 + [2] * 5)
    fold = stratified_folds(y, 5, seed=3)
    assert fold.shape == y.shape and set(fold.tolist()) == set(range(5))
    for f in range(5):  # every fold holds every class; sizes differ by at most one row per class
        assert set(y[fold == f].tolist()) == {0, 1, 2}
    for c in range(3):
        counts = torch.bincount(fold[y == c], minlength=5)
        assert int(counts.max() - counts.min()) <= 1
    assert torch.equal(fold, stratified_folds(y, 5, seed=3)) and not torch.equal(fold, stratified_folds(y, 5, seed=4))
    with pytest.raises(ValueError, match="folds=1"):
        stratified_folds(y, 1)


def test_cross_validation_chooses_on_every_training_row_and_fits_on_them():
    concepts, labels, names, raw = _dataset(n=300, signal=0.3)  # weak enough that no fit is always right
    cfg = CbmConfig(lambdas=[0.01, 0.3, 3.0], grow_lambda=0, cv_folds=4)
    cv = train_cbm(concepts, labels, names, cfg, raw=raw)
    m = cv.metrics
    pooled = m["n_train"] + m["n_val"]
    assert m["cv_folds"] == 4 and m["n_fit"] == pooled
    # each fit's accuracy is counted over every pooled row once (one fold each), not over the validation split
    assert all(abs(p["val_accuracy"] * pooled - round(p["val_accuracy"] * pooled)) < 1e-3 for p in m["lambda_path"])
    assert m["probe_val_accuracy"] * pooled == pytest.approx(round(m["probe_val_accuracy"] * pooled), abs=1e-3)
    # above cv_max_rows: the one validation split, exactly as without folds
    single = train_cbm(concepts, labels, names, CbmConfig(lambdas=[0.01, 0.3, 3.0], grow_lambda=0, cv_folds=0),
                       raw=raw)  # fmt: skip
    capped = train_cbm(concepts, labels, names, CbmConfig(lambdas=[0.01, 0.3, 3.0], grow_lambda=0, cv_folds=4,
                                                          cv_max_rows=pooled - 1), raw=raw)  # fmt: skip
    assert capped.metrics["cv_folds"] == 0 and capped.metrics["n_fit"] == m["n_train"]
    assert torch.equal(capped.weight, single.weight) and capped.metrics["lambda_path"] == single.metrics["lambda_path"]
    assert [p["val_accuracy"] for p in m["lambda_path"]] != [p["val_accuracy"] for p in single.metrics["lambda_path"]]
    assert min(cv.metrics["accuracy"], single.metrics["accuracy"]) > 0.35  # chance is 0.25


def test_raw_probe_cross_validates_its_l2_and_fits_on_train_and_val():
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (240,), generator=gen)
    raw = torch.randn(240, 6, generator=gen) + 2.0 * torch.nn.functional.one_hot(y, 6).float()
    train, val, test = torch.arange(0, 150), torch.arange(150, 190), torch.arange(190, 240)
    probe = fit_raw_probe(raw, y, train, val, test, 3, [1e6, 0.0], folds=5)
    assert probe.l2 == 0.0 and probe.test_accuracy > 0.6  # a huge L2 loses every fold (chance: 1/3)
    # pooled over the 190 rows of train and val
    assert probe.val_accuracy * 190 == pytest.approx(round(probe.val_accuracy * 190), abs=1e-3)
    on_train = fit_raw_probe(raw, y, train, val, test, 3, [0.0])
    assert not torch.allclose(probe.weight, on_train.weight)  # fitted on the 190 rows, not the 150
