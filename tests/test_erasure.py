"""The guarantees of the closed-form erasers and steerers (naming/interventions/erasure.py) on synthetic data with known
structure, and LEACE against EleutherAI's concept-erasure package when it is installed."""

from __future__ import annotations

import pytest
import torch

from conceptdict.naming.bottleneck.probes import ProbeConfig, linear_probe, majority_rate, mlp_probe
from conceptdict.naming.interventions.erasure import (
    cross_covariance,
    fit_leace,
    fit_leace_switch,
    fit_midsteer,
    fit_splince,
    load_eraser,
    one_hot,
    save_eraser,
)

pytestmark = pytest.mark.unit

D = 12


def planted(n: int = 3000, seed: int = 0):
    """x = correlated noise + a concept c (3 classes) along two directions + a target y (2 classes) that shares
    part of its direction with c and is correlated with c (P(y=1) depends on c)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5 + torch.eye(D, dtype=torch.float64)
    noise = torch.randn(n, D, generator=g, dtype=torch.float64) @ mix
    c = torch.randint(0, 3, (n,), generator=g)
    y = (torch.rand(n, generator=g) < torch.tensor([0.2, 0.5, 0.8])[c]).long()
    dirs = torch.randn(4, D, generator=g, dtype=torch.float64)
    x = noise + 2.0 * one_hot(c, 3)[:, :2] @ dirs[:2] + 1.5 * y[:, None].double() * (dirs[2] + 0.5 * dirs[0])
    return x, c, y


def split(x, *labels, n_train=2000):
    return (x[:n_train], x[n_train:]), *[(t[:n_train], t[n_train:]) for t in labels]


def test_leace_removes_every_linear_signal_and_probes_fall_to_chance():
    x, c, _ = planted()
    (xtr, xte), (ctr, cte) = split(x, c)
    eraser = fit_leace(xtr, ctr)
    erased = eraser(xtr)
    assert cross_covariance(erased, one_hot(ctr, 3)).abs().max() < 1e-10
    before = linear_probe(xtr, ctr, xte, cte, 3).accuracy
    after = linear_probe(erased, ctr, eraser(xte), cte, 3).accuracy
    chance = majority_rate(ctr, cte)
    sigma = (chance * (1 - chance) / len(cte)) ** 0.5
    assert before > 0.8
    assert after < chance + 3 * sigma


def test_leace_matches_concept_erasure_package():
    ce = pytest.importorskip("concept_erasure")
    x, c, _ = planted()
    ours = fit_leace(x, c)
    fitter = ce.LeaceFitter(D, 3, dtype=torch.float64, shrinkage=False, constrain_cov_trace=False)
    fitter.update(x, one_hot(c, 3))
    theirs = fitter.eraser(x)
    assert torch.allclose(ours(x), theirs, atol=1e-9)
    assert torch.isclose(ours.displacement(x).mean(), (theirs - x).square().sum(-1).mean(), rtol=1e-9)


def test_splince_keeps_target_covariance_exactly_and_erases_the_concept():
    x, c, y = planted()
    (xtr, xte), (ctr, cte), (ytr, yte) = split(x, c, y)
    eraser = fit_splince(xtr, ctr, ytr)
    erased = eraser(xtr)
    before_y = cross_covariance(xtr, one_hot(ytr, 2))
    assert (cross_covariance(erased, one_hot(ytr, 2)) - before_y).norm() / before_y.norm() < 1e-10
    assert cross_covariance(erased, one_hot(ctr, 3)).abs().max() < 1e-10
    after = linear_probe(erased, ctr, eraser(xte), cte, 3).accuracy
    chance = majority_rate(ctr, cte)
    assert after < chance + 3 * (chance * (1 - chance) / len(cte)) ** 0.5
    # LEACE (fewer constraints) moves the rows less, and it does change Cov(x, Y)
    leace = fit_leace(xtr, ctr)
    assert leace.displacement(xtr).mean() < eraser.displacement(xtr).mean()
    assert (cross_covariance(leace(xtr), one_hot(ytr, 2)) - before_y).norm() / before_y.norm() > 0.05


def test_splince_is_the_least_displacement_map_with_both_guarantees():
    x, c, y = planted(n=1500)
    eraser = fit_splince(x, c, y)
    A = eraser.left @ eraser.right  # x' = x - A (x - mu)
    C = torch.cat([cross_covariance(x, one_hot(c, 3)), cross_covariance(x, one_hot(y, 2))], dim=1)
    free = torch.eye(D, dtype=torch.float64) - C @ torch.linalg.pinv(C)  # G = R free keeps both constraints
    centred = x - x.mean(0)
    best = (centred @ A.T).square().sum(-1).mean()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        G = 0.05 * torch.randn(D, D, generator=g, dtype=torch.float64) @ free
        other = centred @ (A + G).T
        assert cross_covariance(x - other, one_hot(y, 2)).sub(cross_covariance(x, one_hot(y, 2))).abs().max() < 1e-9
        assert other.square().sum(-1).mean() > best


def test_splince_refuses_a_target_inside_the_concept_span():
    x, c, _ = planted()
    with pytest.raises(ValueError, match="lies in the concept's span"):
        fit_splince(x, c, c)


def test_leace_switch_reflects_the_class_means_and_negates_the_covariance():
    x, c, _ = planted()
    switched = fit_leace_switch(x, c)(x)
    z = one_hot(c, 3)
    assert torch.allclose(cross_covariance(switched, z), -cross_covariance(x, z), atol=1e-10)
    mu = x.mean(0)
    for k in range(3):
        assert torch.allclose(switched[c == k].mean(0) - mu, -(x[c == k].mean(0) - mu), atol=1e-9)


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_midsteer_moves_the_source_mean_to_the_target_with_the_papers_displacement(strength):
    x, c, _ = planted()
    steer = fit_midsteer(x, c, source=0, target=2, strength=strength)
    out = steer(x)
    mu, m_s, m_t = x.mean(0), x[c == 0].mean(0), x[c == 2].mean(0)
    assert torch.allclose(out[c == 0].mean(0), m_s + strength * (m_t - m_s), atol=1e-9)
    # x' - x = beta (m_t - m_s) (m_s - mu)^T S^-1 (x - mu) / (m_s - mu)^T S^-1 (m_s - mu), S = Cov(x)
    S = torch.cov(x.T, correction=0)
    a = torch.linalg.solve(S, m_s - mu)
    expected = strength * ((x - mu) @ a / ((m_s - mu) @ a))[:, None] * (m_t - m_s)
    assert torch.allclose(out - x, expected, atol=1e-8)
    assert torch.isclose(steer.displacement(x).mean(), expected.square().sum(-1).mean(), rtol=1e-8)


def test_mlp_probe_reads_what_a_linear_eraser_leaves():
    """A concept carried by the norm (xor-like, no mean difference) has nothing for LEACE to remove."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    c = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64) * (0.3 + 1.7 * c[:, None].double())
    x[:, 0] += 1e-3 * c  # a sliver of linear signal so LEACE has a subspace to fit
    (xtr, xte), (ctr, cte) = split(x, c, n_train=1400)
    eraser = fit_leace(xtr, ctr)
    cfg = ProbeConfig(mlp_epochs=200)
    assert linear_probe(eraser(xtr), ctr, eraser(xte), cte, 2, cfg).accuracy < 0.6
    assert mlp_probe(eraser(xtr), ctr, eraser(xte), cte, 2, cfg).accuracy > 0.8


def test_eraser_round_trips_and_refuses_bad_input(tmp_path):
    x, c, _ = planted(n=500)
    eraser = fit_midsteer(x, c, 1, 0)
    back = load_eraser(save_eraser(eraser, tmp_path / "e"))
    assert back.method == "midsteer" and back.meta["source"] == 1
    assert torch.equal(back(x), eraser(x))
    with pytest.raises(ValueError, match="one class"):
        fit_leace(x, torch.zeros(len(x), dtype=torch.long))
    with pytest.raises(ValueError, match="same class"):
        fit_midsteer(x, c, 1, 1)
    with pytest.raises(FileNotFoundError, match="eraser.json"):
        load_eraser(tmp_path)
