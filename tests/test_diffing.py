"""Per-latent diffing analysis and Latent Scaling (saes/diffing.py) on hand-built decoders and data."""

from __future__ import annotations

import math

import pytest
import torch

from conceptdict.saes.diffing import (
    DiffAnalysisConfig,
    LatentScaling,
    analyse_latents,
    decoder_cosine,
    histogram,
    latent_scaling,
    relative_norm_difference,
    scaling_flags,
    scaling_from_sums,
    scaling_sums,
    tag_latents,
)
from generators.synthetic import planted_batches, planted_pair

pytestmark = pytest.mark.unit


def test_relative_norm_difference_formula_and_edges():
    norm_a = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 3.0])
    norm_b = torch.tensor([0.5, 1.0, 0.0, 0.0, 1.0, 3.0])
    delta = relative_norm_difference(norm_a, norm_b)
    # (0.5 - 1)/1 -> 0.25; only B -> 1; only A -> 0; both zero -> 1/2 (no evidence); equal -> 1/2
    assert delta.tolist() == pytest.approx([0.25, 1.0, 0.0, 0.5, 0.5, 0.5])
    assert torch.isfinite(delta).all()
    # symmetric: swapping the models mirrors Delta around 1/2
    assert (relative_norm_difference(norm_b, norm_a) + delta).tolist() == pytest.approx([1.0] * 6)


def test_tags_follow_thresholds_and_zero_decoders_are_other():
    cfg = DiffAnalysisConfig()
    delta = torch.tensor([0.95, 0.91, 0.9, 0.05, 0.1, 0.5, 0.59, 0.61, 0.5])
    norm_a = torch.ones(9)
    norm_b = torch.ones(9)
    norm_a[-1] = norm_b[-1] = 0.0
    tags = tag_latents(delta, norm_a, norm_b, cfg)
    assert tags == ["B-only", "B-only", "other", "A-only", "other", "shared", "shared", "other", "other"]
    strict = DiffAnalysisConfig(b_only=0.94)
    assert tag_latents(delta[:2], norm_a[:2], norm_b[:2], strict) == ["B-only", "other"]


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="b_only=1.5"):
        DiffAnalysisConfig(b_only=1.5)
    with pytest.raises(ValueError, match="a_only=0.95"):
        DiffAnalysisConfig(a_only=0.95)
    with pytest.raises(ValueError, match="source_a=1"):
        DiffAnalysisConfig(source_a=1, source_b=1)


def test_decoder_cosine_handles_zero_rows():
    d_a = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    d_b = torch.tensor([[0.0, 3.0], [1.0, 0.0], [2.0, 2.0], [-1.0, 0.0]])
    assert decoder_cosine(d_a, d_b).tolist() == pytest.approx([0.0, 0.0, 1.0, -1.0])


def _orthogonal_setup(n_batches=3, batch=64, seed=0):
    """D=8, L=4 latents along e_0..e_3 with planted scales. Decoder B has norms nb, decoder A norms na;
    the data of model m carries latent j with true magnitude true_m[j]."""
    gen = torch.Generator().manual_seed(seed)
    L, D = 4, 8
    nb = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    na = torch.tensor([0.0, 1.0, 0.5, 0.2], dtype=torch.float64)  # decoder A (possibly shrunk)
    true_b = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    true_a = torch.tensor([0.0, 0.7, 0.5, 0.9], dtype=torch.float64)  # what A really carries
    eye = torch.eye(D, dtype=torch.float64)[:L]
    directions = torch.stack([eye * na[:, None], eye * nb[:, None]], dim=1)  # [L, 2, D]
    batches = []
    for _ in range(n_batches):
        f = (torch.rand(batch, L, generator=gen) < 0.3) * torch.rand(batch, L, generator=gen).double() * 2
        x_a = (f * true_a) @ eye + 0.1 * torch.randn(batch, D, generator=gen).double() * (1 - eye.sum(0))
        x_b = (f * true_b) @ eye
        batches.append(torch.stack([x_a, x_b], dim=1))

    def encode(x):  # exact on this data: latent j's coefficient in model B, over B's decoder norm
        return x[:, 1, :L] / nb

    def decode(f):
        return torch.einsum("bl,lsd->bsd", f, directions)

    return directions, batches, encode, decode, true_a, true_b, na, nb


def test_latent_scaling_recovers_planted_scales_exactly():
    directions, batches, encode, decode, true_a, true_b, na, nb = _orthogonal_setup()
    res = latent_scaling(iter(batches), encode, decode, directions)
    # the encoder gives f_j = true_b[j]/nb[j] * c; the error target of A then holds f true_a/true_b*nb along d
    expected_eps_a = true_a / true_b
    assert res.beta_eps_a.tolist() == pytest.approx(expected_eps_a.tolist(), abs=1e-12)
    assert res.beta_eps_b.tolist() == pytest.approx([1.0] * 4, abs=1e-12)
    # reconstruction target: x_hat^A = f d^A, so beta_r_A = na / nb; x_hat^B = f d^B -> 1
    assert res.beta_r_a.tolist() == pytest.approx((na / nb).tolist(), abs=1e-12)
    assert res.beta_r_b.tolist() == pytest.approx([1.0] * 4, abs=1e-12)
    assert res.nu_eps.tolist() == pytest.approx(expected_eps_a.tolist(), abs=1e-12)
    assert res.nu_r.tolist() == pytest.approx((na / nb).tolist(), abs=1e-12)


def test_streaming_equals_one_big_batch():
    directions, batches, encode, decode, *_ = _orthogonal_setup(n_batches=4, batch=17)
    streamed = latent_scaling(iter(batches), encode, decode, directions)
    x = torch.cat(batches)
    f = encode(x)
    whole = scaling_from_sums(scaling_sums(f, x, decode(f), directions), directions)
    for a, b in zip(streamed, whole):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert int(streamed.fires.sum()) == int((f > 0).sum())


def test_latent_that_never_fires_gets_nan_and_no_flag():
    directions, batches, encode, decode, *_ = _orthogonal_setup()

    def encode_dead0(x):
        f = encode(x).clone()
        f[:, 0] = 0.0
        return f

    res = latent_scaling(iter(batches), encode_dead0, decode, directions)
    assert math.isnan(res.beta_eps_b[0].item()) and math.isnan(res.nu_r[0].item())
    assert res.fires[0].item() == 0
    table = analyse_latents(directions, DiffAnalysisConfig(), res)
    assert table.tags[0] == "B-only"
    assert not any(table.flags[name][0].item() for name in table.flags)
    rec = table.records()[0]
    assert rec["nu_r"] is None and rec["beta_eps_b"] is None and rec["tag"] == "B-only"


def test_flags_on_b_only_latents():
    cfg = DiffAnalysisConfig()
    delta = torch.tensor([0.95, 0.95, 0.95, 0.95, 0.5], dtype=torch.float64)
    nu_eps = torch.tensor([0.1, 0.6, 0.1, 0.6, 0.0], dtype=torch.float64)
    nu_r = torch.tensor([0.1, 0.1, 0.7, 0.8, 0.0], dtype=torch.float64)
    one = torch.ones(5, dtype=torch.float64)
    scaling = LatentScaling(one, one, one, one, nu_r, nu_eps, one)
    flags = scaling_flags(delta, scaling, cfg)
    assert flags["model_specific"].tolist() == [True, False, False, False, False]
    assert flags["complete_shrinkage"].tolist() == [False, True, False, True, False]
    assert flags["latent_decoupling"].tolist() == [False, False, True, True, False]
    loose = scaling_flags(delta, scaling, DiffAnalysisConfig(nu_eps_max=0.7, nu_r_max=0.9))
    assert loose["model_specific"].tolist() == [True, True, True, True, False]


def test_analyse_latents_table_and_counts():
    directions, batches, encode, decode, *_ = _orthogonal_setup()
    cfg = DiffAnalysisConfig()
    table = analyse_latents(directions, cfg, latent_scaling(iter(batches), encode, decode, directions))
    # norms: A [0, 1, 0.5, 0.2], B [1, 2, 0.5, 1.5]
    assert table.delta.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.5 * (1.3 / 1.5 + 1)])
    assert table.tags == ["B-only", "other", "shared", "B-only"]
    assert table.cosine.tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])
    counts = table.counts()
    assert counts["B-only"] == 2 and counts["shared"] == 1 and counts["other"] == 1 and counts["A-only"] == 0
    # latent 0 is B-only and A carries none of it: genuinely B-specific. Latent 3 looks B-only from its
    # decoder (A's norm shrunk to 0.2) but A's data carries it at 0.9/1.5: complete shrinkage.
    assert table.flags["model_specific"].tolist() == [True, False, False, False]
    assert table.flags["complete_shrinkage"].tolist() == [False, False, False, True]
    assert counts["complete_shrinkage"] == 1 and counts["model_specific"] == 1
    recs = table.records()
    assert [r["latent"] for r in recs] == [0, 1, 2, 3] and recs[0]["model_specific"] is True
    with pytest.raises(ValueError, match="S=2"):
        analyse_latents(directions, DiffAnalysisConfig(source_b=2))


def test_histogram_counts_finite_values():
    assert histogram(torch.tensor([0.0, 0.5, 1.0, math.nan, 2.0]), bins=2) == [1, 3]
    assert histogram(torch.tensor([-1.0, 0.9]), bins=4, lo=-1.0, hi=1.0) == [1, 0, 0, 1]


def test_planted_pair_ground_truth():
    pair = planted_pair(16, n_shared=3, n_b_only=2, n_scaled=2, n_rotated=2, n_a_only=1, scale=0.3, angle_deg=60)
    assert pair.kinds == ["shared"] * 3 + ["b_only"] * 2 + ["scaled"] * 2 + ["rotated"] * 2 + ["a_only"]
    na, nb = pair.atoms_a.norm(dim=-1), pair.atoms_b.norm(dim=-1)
    assert na.tolist() == pytest.approx([1, 1, 1, 0, 0, 0.3, 0.3, 1, 1, 1], abs=1e-6)
    assert nb.tolist() == pytest.approx([1] * 9 + [0], abs=1e-6)
    cos = decoder_cosine(pair.atoms_a, pair.atoms_b)
    assert cos[7:9].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    x = next(planted_batches(pair, batch_size=32, n_batches=1, noise=0.0))
    assert x.shape == (32, 2, 16)
    again = next(planted_batches(pair, batch_size=32, n_batches=1, noise=0.0))
    assert torch.equal(x, again)
    with pytest.raises(ValueError, match="scale=1.5"):
        planted_pair(8, 1, 1, 1, 1, scale=1.5)


def test_float32_inputs_accumulate_in_float64():
    directions, batches, encode, decode, *_ = _orthogonal_setup(n_batches=2)
    exact = latent_scaling(iter(batches), encode, decode, directions)
    d32 = directions.float()
    single = latent_scaling((x.float() for x in batches), lambda x: encode(x.double()).float(),
                            lambda f: decode(f.double()).float(), d32)
    assert single.beta_eps_a.dtype == torch.float64
    assert torch.allclose(single.beta_eps_a, exact.beta_eps_a, rtol=1e-5, atol=1e-6)
    assert torch.allclose(single.nu_r, exact.nu_r, rtol=1e-5, atol=1e-6)


def test_decoder_table_is_the_diff_without_latent_scaling():
    """decoder_table (what naming shows per latent) tags exactly as diff_crosscoder does, in training units."""
    from conceptdict.saes import SparseCoder
    from conceptdict.saes.diffing import TAGS, decoder_table, diff_crosscoder

    torch.manual_seed(0)
    model = SparseCoder(d_in=4, n_latents=6, k=2, kind="crosscoder", n_sources=2)
    with torch.no_grad():
        model.W_dec.view(6, 2, 4)[0, 0] = 0.0  # latent 0 only in B
        model.W_dec.view(6, 2, 4)[1, 1] = 0.0  # latent 1 only in A
    model.training_summary = {"normalisation": {"scale_per_source": [1.0, 2.0], "folded_into_weights": True}}
    table = decoder_table(model)
    assert table.tags == diff_crosscoder(model, [], DiffAnalysisConfig(), max_batches=0).tags
    assert table.tags[:2] == ["B-only", "A-only"] and set(table.tags) <= set(TAGS)
