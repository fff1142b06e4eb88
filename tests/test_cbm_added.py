"""Concepts added where the classes need them (naming/bottleneck/added.py): which class pairs get a direction, the
direction itself, its two non-negative named halves, and the CBM that reads them (``CbmConfig.add_pairs``)."""

from __future__ import annotations

import json

import pytest
import torch
from conceptdict.naming.bottleneck.added import (
    AddedConcepts,
    Residual,
    add_needed_concepts,
    cbm_residual,
    confused_pairs,
    dictionary_residual,
    ridge_predictions,
)
from conceptdict.naming.bottleneck.baseline import fitting_rows
from conceptdict.naming.bottleneck.cbm import CbmConfig, train_cbm

pytestmark = pytest.mark.unit

CLASSES = ("alpha", "beta", "gamma")


def world(n: int = 600, seed: int = 0):
    """Three classes: alpha apart along raw dim 0, which the concepts read; beta and gamma apart only along raw dim 1,
    which no concept direction has (so the concepts confuse them and the residual carries it)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    raw = torch.randn(n, 8, generator=g)
    raw[:, 0] += 3.0 * (y == 0)
    raw[:, 1] += 2.0 * (y == 1) - 2.0 * (y == 2)
    dirs = torch.eye(8)[[0, 2, 3, 4, 5, 6, 7]]
    dirs = torch.cat([dirs, -dirs])  # ReLU concepts of both signs of every direction except dim 1
    concepts = (raw @ dirs.T).clamp_min(0)
    residual = raw - concepts @ dirs  # what the concepts do not reconstruct: dim 1 alone
    return raw, concepts, dirs, residual, y


def test_confused_pairs_counts_both_directions_and_sorts_most_confused_first():
    y = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    pred = torch.tensor([1, 0, 0, 2, 1, 2, 2])
    assert confused_pairs(pred, y, 3) == [(0, 1, 2), (1, 2, 2), (0, 2, 0)]


def test_ridge_predictions_are_out_of_fold_and_separate_a_linear_problem():
    x = torch.randn(200, 3, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long()
    pred = ridge_predictions(x, y, 2, torch.arange(200) % 4, l2=0.01)
    assert (pred == y).float().mean() > 0.9


def test_the_pair_the_concepts_confuse_gets_a_direction_of_the_residual_named_from_its_evidence():
    _, concepts, _, residual, y = world()
    fit = torch.arange(480)
    added = add_needed_concepts(concepts, residual, y, CLASSES, fit, pairs=1)
    assert added.pairs == (("beta", "gamma"),)
    assert added.names == ("beta rather than gamma", "gamma rather than beta")
    w = added.weight[0] / added.weight[0].norm()
    assert abs(float(w[1])) > 0.95  # the direction the concepts lack
    acts = added.activations(residual)
    assert acts.shape == (600, 2) and (acts >= 0).all()
    assert ((acts > 0).sum(1) <= 1).all()  # at most one half per row: a prediction counts one of them
    held = torch.arange(480, 600)
    bg = held[y[held] != 0]
    assert ((acts[bg, 0] > acts[bg, 1]) == (y[bg] == 1)).float().mean() > 0.9  # it separates unseen rows
    assert added.evidence[0]["auroc"] > 0.95 and added.evidence[0]["top_labels"][0] == "beta"
    assert added.directions().shape == (2, 8)


def test_the_fitting_rows_get_cross_fitted_activations():
    _, concepts, _, residual, y = world()
    fit = torch.arange(480)
    added = add_needed_concepts(concepts, residual, y, CLASSES, fit, pairs=1)
    full, cross = added.activations(residual), added.activations_for_fit(residual, fit)
    assert added.fitted.shape == (480, 2) and (cross >= 0).all()
    assert torch.equal(cross[480:], full[480:])  # rows the directions never saw: the direction fitted on all
    pair = fit[y[fit] != 0]
    assert not torch.allclose(cross[pair], full[pair])  # the pair's own rows: by the direction fitted without them
    assert torch.equal(cross[fit[y[fit] == 0]], full[fit[y[fit] == 0]])  # fitting rows outside the pair: unchanged


def test_added_concepts_are_fitted_on_the_fitting_rows_alone():
    _, concepts, _, residual, y = world()
    fit = torch.arange(480)
    a = add_needed_concepts(concepts, residual, y, CLASSES, fit, pairs=1)
    y2 = y.clone()
    y2[480:] = torch.randint(0, 3, (120,), generator=torch.Generator().manual_seed(5))  # other labels elsewhere
    b = add_needed_concepts(concepts, residual, y2, CLASSES, fit, pairs=1)
    assert torch.equal(a.weight, b.weight) and a.names == b.names


def test_nothing_is_added_without_pairs_or_confusions():
    _, concepts, _, residual, y = world()
    assert len(add_needed_concepts(concepts, residual, y, CLASSES, torch.arange(480), pairs=0)) == 0
    perfect = torch.nn.functional.one_hot(y, 3).float() * 5  # concepts that confuse nothing
    none = add_needed_concepts(perfect, residual, y, CLASSES, torch.arange(480), pairs=2)
    assert len(none) == 0 and none.activations(residual).shape == (600, 0)
    with pytest.raises(ValueError, match="pairs=-1"):
        add_needed_concepts(concepts, residual, y, CLASSES, torch.arange(480), pairs=-1)


def test_the_cbm_reads_the_added_concepts_and_reports_them_separately():
    raw, concepts, dirs, residual, y = world()
    labels = [CLASSES[i] for i in y.tolist()]
    names = [f"c{i}" for i in range(concepts.shape[1])]
    cheap = {"lambdas": [0.01, 0.1], "refit_l2": [1.0], "cv_folds": 0, "grow_lambda": 0, "max_iter": 500,
             "probe_l2": [1.0]}
    plain = train_cbm(concepts, labels, names, CbmConfig(**cheap), raw=raw, directions=dirs,
                      residual=Residual(residual, "error"))  # fmt: skip
    more = train_cbm(concepts, labels, names, CbmConfig(add_pairs=1, **cheap), raw=raw, directions=dirs,
                     residual=Residual(residual, "error"))  # fmt: skip
    assert "added_concepts" not in plain.metrics and len(plain.concept_names) == len(names)
    assert plain.metrics["accuracy"] < 0.8  # beta and gamma are a coin toss on the concepts alone
    assert more.metrics["accuracy"] > plain.metrics["accuracy"] + 0.2
    a = more.metrics["added_concepts"]
    assert a["n_added"] == 2 and a["pairs"] == [["beta", "gamma"]] and a["residual"] == "error"
    assert set(a["used"]) == {"beta rather than gamma", "gamma rather than beta"}
    assert 0 < a["contribution_share"] < 1 and a["predictions_share"] > 0.5
    assert more.concept_names[-2:] == ("beta rather than gamma", "gamma rather than beta")
    assert more.concept_ids[-2:] == (len(names), len(names) + 1) and more.weight.shape == (3, len(names) + 2)
    back = AddedConcepts.from_dict(json.loads(json.dumps(a)))  # as cbm.json keeps it
    full = torch.cat([concepts, back.activations(residual)], 1)
    with pytest.raises(ValueError, match="the last 2 added by --add-pairs"):
        more.logits(concepts)
    split, _, fit = fitting_rows(y, 0.15, 0.2, 0, 0, 4000)
    hits = more.logits(full[split.test]).argmax(1) == y[split.test]  # the saved form reproduces the test accuracy
    assert float(hits.float().mean()) == pytest.approx(more.metrics["accuracy"])
    assert set(fit.tolist()) == set(split.train.tolist())  # cv_folds 0: fitted on the training rows alone


def test_dictionary_residual_is_what_the_dictionary_does_not_reconstruct():
    class Coder:  # a decoder into the raw space: two unit directions, no bias
        spec = None

        def decoder_directions(self):
            return torch.eye(3)[:2]

        def encode(self, x):
            return x[:, :2].clamp_min(0)

        def decode(self, f):
            return f @ self.decoder_directions()

    x = torch.tensor([[1.0, -2.0, 3.0]])
    r = dictionary_residual(Coder(), x)
    assert r.kind == "raw"  # no spec: concept_directions cannot tell what it decodes into, so raw itself
    Coder.spec = type("Spec", (), {"transcodes": False})()
    r = dictionary_residual(Coder(), x)
    assert r.kind == "error" and r.values.tolist() == [[0.0, -2.0, 3.0]]
    assert cbm_residual(Coder(), x, "error").values.tolist() == [[0.0, -2.0, 3.0]]
    assert cbm_residual(Coder(), x, "raw") == (x, "raw")  # the default: the raw activations themselves
    with pytest.raises(ValueError, match="add_reads='pre'"):
        cbm_residual(Coder(), x, "pre")


def test_a_cbm_with_added_concepts_reads_new_inputs_through_concepts_of():
    """What ``steer --cbm`` and a notebook do with new inputs: the dictionary's activations and the added concepts',
    one call, equal to what the CBM was fitted and tested on."""
    raw, concepts, dirs, _, y = world()

    class Coder:  # the world's concepts as a dictionary's ReLU activations
        def dense_activations(self, x):
            return (x @ dirs.T).clamp_min(0)

    labels = [CLASSES[i] for i in y.tolist()]
    cheap = {"lambdas": [0.01, 0.1], "refit_l2": [1.0], "cv_folds": 0, "grow_lambda": 0, "max_iter": 500,
             "probe_l2": [1.0]}
    names = [f"c{i}" for i in range(concepts.shape[1])]
    plain = train_cbm(concepts, labels, names, CbmConfig(**cheap), raw=raw, directions=dirs)
    assert torch.equal(plain.concepts_of(Coder(), raw), concepts)  # nothing added: the dictionary's alone
    more = train_cbm(concepts, labels, names, CbmConfig(add_pairs=1, **cheap), raw=raw, directions=dirs,
                     residual=cbm_residual(Coder(), raw, "raw"))  # fmt: skip
    got = more.concepts_of(Coder(), raw)
    assert got.shape == (len(raw), len(names) + 2)
    assert torch.equal(got[:, :len(names)], concepts)
    split, _, _ = fitting_rows(y, 0.15, 0.2, 0, 0, 4000)
    hits = more.logits(got[split.test]).argmax(1) == y[split.test]
    assert float(hits.float().mean()) == pytest.approx(more.metrics["accuracy"])
