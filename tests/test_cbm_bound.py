"""The bound on concepts added by ``--add-pairs`` (naming/bottleneck/bound.py): on two classes an added pair is the
supervised discriminant itself, and without the bound the CBM keeps it and nothing else (a linear probe under
another name); with it, no chosen fit takes more than ``add_max_share`` of the contribution from added concepts or
has more added than dictionary concepts in a class's explanation, else the added concepts are refused."""

from __future__ import annotations

import pytest
import torch
from conceptdict.naming.bottleneck.added import Residual
from conceptdict.naming.bottleneck.bound import (
    AddedBound,
    added_share,
    capped_scale,
    row_shares,
)
from conceptdict.naming.bottleneck.cbm import CbmConfig, train_cbm
from conceptdict.naming.bottleneck.path import choose_lambda
from conceptdict.naming.reports.report_text import format_cbm

pytestmark = pytest.mark.unit

CHEAP = {"lambdas": [0.1, 1.0, 3.0, 10.0, 30.0], "refit_l2": [1.0], "cv_folds": 0, "grow_lambda": 0,
         "max_iter": 500, "probe_l2": [1.0]}


def two_classes(n: int = 600, seed: int = 0):
    """man2's shape: two classes apart along a direction spread over all 8 raw dimensions, each ReLU concept (an axis,
    both signs) carrying a little of it: the pair's discriminant carries all of it in one added concept pair."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    raw = torch.randn(n, 8, generator=g) + torch.outer(2.0 * y - 1.0, torch.full((8,), 0.6))
    dirs = torch.cat([torch.eye(8), -torch.eye(8)])
    concepts = (raw @ dirs.T).clamp_min(0)
    return raw, concepts, dirs, [("no", "yes")[i] for i in y.tolist()]


def fit(add_pairs: int, **kw):
    raw, concepts, dirs, labels = two_classes()
    names = [f"c{i}" for i in range(concepts.shape[1])]
    return train_cbm(concepts, labels, names, CbmConfig(add_pairs=add_pairs, **CHEAP, **kw), raw=raw,
                     directions=dirs, residual=Residual(raw, "raw"))  # fmt: skip


def test_row_shares_count_the_added_columns_of_each_prediction():
    contrib = torch.tensor([[1.0, -1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    assert row_shares(contrib, 1).tolist() == [0.5, 0.0, 0.0]  # |2| of |1| + |-1| + |2|; no contribution: 0
    assert added_share(contrib, 1) == pytest.approx(1 / 6)
    assert added_share(contrib, 0) == 0.0 and added_share(contrib[:0], 1) == 0.0


def test_the_bound_names_the_share_or_the_class_it_breaks():
    bound = AddedBound(n_added=2, max_share=0.5)
    W = torch.tensor([[1.0, 0.5, 0.2, 0.0], [0.3, 0.0, 0.0, 0.7]])  # class 1: one dictionary concept, one added
    assert bound.class_counts(W) == ([2, 1], [1, 1])
    assert bound.breach(0.5, W) is None
    assert bound.breach(0.0, torch.zeros_like(W)) == "no concepts"  # keeps the share, but is no CBM
    assert "added share 60.0%" in bound.breach(0.6, W)
    W[1, 2] = 0.4  # class 1 now explained by two added concepts against one of the dictionary's
    assert bound.breach(0.1, W, ("a", "b")) == "class b: 2 added concepts against 1 of the dictionary's"


def test_added_concepts_are_never_cheaper_than_the_dictionarys_under_the_penalty():
    assert capped_scale(torch.tensor([1.0, 3.0, 2.0, 200.0, 0.5]), 2).tolist() == [1.0, 3.0, 2.0, 3.0, 0.5]
    assert capped_scale(torch.tensor([4.0, 5.0]), 0).tolist() == [4.0, 5.0]
    more = fit(1, add_max_share=1.0)  # a share bound that never binds: the scale is what is tested
    assert "added_concepts" in more.metrics
    assert "% of the |contribution| (bound 100%)" in format_cbm(more)
    assert float(more.scale[-2:].max()) <= float(more.scale[:-2].max())


def test_choose_lambda_never_picks_a_fit_that_breaks_the_bound():
    path = [{"lambda": 0.1, "l2": None, "val_accuracy": 0.90, "concepts_used": 40},
            {"lambda": 1.0, "l2": None, "val_accuracy": 0.95, "concepts_used": 2, "breach": "added share 99%"}]
    assert choose_lambda(path, 0.005)["lambda"] == 0.1  # the breaking fit neither wins nor sets the best
    assert choose_lambda(path[1:], 0.005) is None


def test_on_two_classes_the_discriminant_does_not_take_over_the_cbm():
    plain, more = fit(0), fit(1)
    assert more.metrics["concepts_used"] > 2  # not the pair's two halves and nothing else
    assert more.metrics["concepts_per_prediction"]["nonzero"] > 2
    bound = more.metrics["added_bound"]
    assert bound["max_share"] == 0.5
    if bound["refused"]:  # no fit kept the bound: the CBM of the dictionary's concepts alone
        assert "added share" in bound["refused"] and bound["path"]
        assert torch.equal(more.weight, plain.weight) and more.concept_names == plain.concept_names
        assert "added_concepts" not in more.metrics and more.metrics["added_share"] == 0.0
        assert "added concepts      refused: no fit on the lambda path kept the bound" in format_cbm(more)
    else:
        chosen = next(p for p in more.metrics["lambda_path"] if p["chosen"])
        assert chosen["added_share"] <= 0.5 and not chosen.get("breach")
        d, a = AddedBound(2, 0.5).class_counts(more.weight)
        assert all(x >= y for x, y in zip(d, a))


def test_without_the_bound_the_pair_alone_would_be_chosen():
    """The defect the bound prevents, on the same data: with the added concepts' scale the probe's own and the choice
    unchecked, the sparsest fit within tolerance of the best uses the two added concepts and nothing else."""
    more = fit(1, add_scale="probe")
    curve = more.metrics["added_bound"]["path"] or more.metrics["lambda_path"]
    unbounded = choose_lambda([{k: v for k, v in p.items() if k != "breach"} for p in curve], 0.005)
    assert unbounded["concepts_used"] == 2 and unbounded["added_share"] > 0.9


def test_the_bound_is_checked_on_its_settings():
    with pytest.raises(ValueError, match="add_max_share=1.5"):
        CbmConfig(add_max_share=1.5)
    assert fit(0).metrics.get("added_bound") is None  # nothing added: nothing bounded
