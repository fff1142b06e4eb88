"""Concept bottleneck models: pooling, the sparse probe (no bias, mean |W| penalty), splits, coverage,
explanations, interventions and the saved format."""

from __future__ import annotations

import pytest
import torch
from test_naming_fakes import FakeCoder, FakeStore

from conceptdict.naming.bottleneck import features as cbm_mod
from conceptdict.naming.bottleneck.solvers import fit_linear
from conceptdict.naming.bottleneck.cbm import (
    CbmConfig,
    class_concepts,
    coverage,
    explain_input,
    intervene,
    load_cbm,
    per_prediction,
    pool_codes,
    save_cbm,
    store_features,
    stratified_split,
    train_cbm,
)

pytestmark = pytest.mark.unit


def test_pooling_mean_max_and_superactivator():
    codes = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 5.0], [0.0, 1.0], [4.0, 0.0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    assert torch.allclose(pool_codes(codes, groups, "mean"), torch.tensor([[2.0, 5 / 3], [2.0, 0.5]]))
    assert pool_codes(codes, groups, "max").tolist() == [[3.0, 5.0], [4.0, 1.0]]
    # quantile 0.5 of 3 rows -> top 2 per concept; of 2 rows -> top 1
    assert pool_codes(codes, groups, "super", 0.5).tolist() == [[2.5, 2.5], [4.0, 1.0]]
    # quantile 1.0 is mean pooling
    assert torch.allclose(pool_codes(codes, groups, "super", 1.0), pool_codes(codes, groups, "mean"))
    with pytest.raises(ValueError, match="pooling"):
        pool_codes(codes, groups, "median")


def test_probe_has_no_bias_and_penalty_is_mean_abs_weight(monkeypatch):
    """A CBM input of all zeros gives all-zero logits (no bias); the loss adds lambda * mean |W|."""
    seen = []
    real_mean = torch.Tensor.mean

    def spy_mean(self, *a, **k):
        out = real_mean(self, *a, **k)
        seen.append((tuple(self.shape), float(out.detach())))
        return out

    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    monkeypatch.setattr(torch.Tensor, "mean", spy_mean)
    fit = fit_linear(x, y, 3, bias=False, l1=0.5, max_iter=3)
    monkeypatch.undo()
    assert fit.bias is None and fit.weight.shape == (3, 6)
    assert (3, 6) in [s for s, _ in seen]  # |W| of the full [C, L] matrix is averaged, not summed
    # and the objective matches CE + lam * mean|W| exactly
    W = torch.randn(3, 6, requires_grad=True)
    ce = torch.nn.functional.cross_entropy(x @ W.T, y)
    assert float((ce + 0.5 * W.abs().mean()).detach()) == pytest.approx(float((ce + 0.5 * W.abs().sum() / 18).detach()))
    res = train_cbm(torch.rand(60, 4), [i % 2 for i in range(60)], list("abcd"), CbmConfig(lambdas=[0.1]))
    assert torch.equal(res.logits(torch.zeros(1, 4)), torch.zeros(1, 2))


def test_sparsity_penalty_zeroes_weights():
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (200,), generator=gen)
    x = torch.randn(200, 10, generator=gen)
    x[:, 0] += 4 * y - 2  # only concept 0 is informative
    dense = fit_linear(x, y, 2, bias=False, l1=0.0, l2=0.1)
    sparse = fit_linear(x, y, 2, bias=False, l1=1.0)
    assert sparse.weight[:, 1:].abs().mean() < 0.2 * dense.weight[:, 1:].abs().mean()
    assert (sparse.weight[:, 1:] == 0).float().mean() > 0.5 and (sparse.weight[:, 0] != 0).all()


def test_stratified_split_is_disjoint_and_covers_every_class():
    y = torch.tensor([0] * 20 + [1] * 10 + [2] * 7)
    s = stratified_split(y, 0.2, 0.2, seed=1)
    all_idx = torch.cat([s.train, s.val, s.test])
    assert sorted(all_idx.tolist()) == list(range(len(y)))
    for part in s:
        assert set(y[part].tolist()) == {0, 1, 2}


def test_coverage_counts_concepts_to_reach_each_share():
    contrib = torch.tensor([[5.0, 3.0, 1.0, 1.0, -4.0], [10.0, 0.0, 0.0, 0.0, 0.0]])
    cov = coverage(contrib)
    # row 0: positives 5,3,1,1 of 10 -> 90% needs 3 (9/10), 95% and 99% need 4; row 1: 1 each
    assert cov == {"90": 2.0, "95": 2.5, "99": 2.5}


def test_per_prediction_is_the_median_over_inputs_of_contributing_concepts():
    contrib = torch.tensor([[5.0, 3.0, 1.0, 1.0, -4.0], [10.0, 0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0, 0.0]])
    # contributing (either sign): 5, 1, 2 -> median 2; making up 90% of the positive part: 3, 1, 2 -> median 2
    assert per_prediction(contrib) == {"nonzero": 2.0, "90": 2.0}
    assert per_prediction(contrib[:1]) == {"nonzero": 5.0, "90": 3.0}
    assert per_prediction(torch.zeros(2, 3)) == {"nonzero": 0.0, "90": 0.0}  # nothing positive: no concept needed


def _planted_dataset(n=300, L=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=gen)
    concepts = torch.rand(n, L, generator=gen) * 0.2
    concepts[torch.arange(n), y] += 1.0  # concept c signals class c
    raw = concepts @ torch.randn(L, 8, generator=gen)
    names = [f"c{i}" for i in range(L)]
    return concepts, [f"class{int(v)}" for v in y], names, raw


def test_train_cbm_learns_planted_concepts_and_reports_baseline():
    concepts, labels, names, raw = _planted_dataset()
    res = train_cbm(concepts, labels, names, CbmConfig(lambdas=[0.01, 0.1]), raw=raw)
    m = res.metrics
    assert m["accuracy"] > 0.9 and m["probe_accuracy"] > 0.8
    # 0.1 keeps the planted concepts, so larger lambdas are tried (grow_lambda) and a sparser one may win
    assert list(m["val_accuracy_by_lambda"])[:2] == ["0.01", "0.1"] and str(res.lam) in m["val_accuracy_by_lambda"]
    assert m["zero_weights"] > 0 and m["n_weights"] == 3 * 12
    assert 1 <= m["coverage"]["90"] <= m["coverage"]["95"] <= m["coverage"]["99"]
    assert m["n_train"] + m["n_val"] + m["n_test"] == 300
    for c, cls in enumerate(res.classes):
        assert class_concepts(res, cls, top=1)[0].name == f"c{c}"
    x = concepts[labels.index("class2")]
    top = explain_input(res, x, top=3)
    assert top[0].name == "c2" and top[0].value > 0


def test_interventions_change_predictions():
    concepts, labels, names, _ = _planted_dataset()
    res = train_cbm(concepts, labels, names, CbmConfig(lambdas=[0.01]))
    x = concepts[[i for i, lab in enumerate(labels) if lab == "class0"][:10]]
    out = intervene(res, x, set_to={"c1": 3.0}, remove=["c0"])
    assert (out.before == 0).all() and (out.after == 1).all() and out.logits_after.shape == (10, 3)
    with pytest.raises(KeyError, match="nope"):
        intervene(res, x, remove=["nope"])


def test_cbm_round_trip(tmp_path):
    concepts, labels, names, raw = _planted_dataset(n=90)
    res = train_cbm(concepts, labels, names, CbmConfig(lambdas=[0.1]), raw=raw)
    back = load_cbm(save_cbm(res, tmp_path))
    assert torch.equal(back.weight, res.weight) and torch.equal(back.scale, res.scale)
    assert back.classes == res.classes and back.concept_names == res.concept_names and back.metrics == res.metrics


def test_rare_classes_are_dropped_and_two_are_needed():
    with pytest.raises(ValueError, match="at least 2 classes"):
        train_cbm(torch.rand(10, 3), ["a"] * 9 + ["b"], ["x", "y", "z"], CbmConfig())


def test_store_features_pool_token_rows_per_input():
    contexts = [["a", "b", "c"], ["d", "e"]]
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 5.0]])
    store = FakeStore(x, contexts, labels={"y": ["p", "p", "p", "q", "q"]})
    feats = store_features(FakeCoder(torch.eye(2), k=1), store, "hp", "y", pooling="max")
    assert feats.concepts.tolist() == [[3.0, 0.0], [0.0, 5.0]] and feats.labels == ["p", "q"]
    assert feats.raw.tolist() == [[2.0, 0.0], [0.0, 3.0]]
    with pytest.raises(ValueError, match="label column"):
        store_features(FakeCoder(torch.eye(2), k=1), store, "hp", "nope")
    assert cbm_mod.row_inputs(store).tolist() == [0, 0, 0, 1, 1]


def test_concept_activations_relu_keeps_what_topk_drops():
    coder = FakeCoder(torch.eye(3), k=1)
    x = torch.tensor([[2.0, 1.0, -1.0]])
    assert cbm_mod.concept_activations(coder, x, "sparse").tolist() == [[2.0, 0.0, 0.0]]
    assert cbm_mod.concept_activations(coder, x, "relu").tolist() == [[2.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="codes 'dense'"):
        cbm_mod.concept_activations(coder, x, "dense")
