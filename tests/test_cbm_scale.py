"""The CBM's per-concept scale: 1 / std, or how strongly the raw probe reads each concept's decoder direction (an
adaptive lasso); and the raw probe it comes from, returned in raw units."""

from __future__ import annotations

import pytest
import torch

from conceptdict.naming.bottleneck.baseline import concept_scale, fit_raw_probe
from conceptdict.naming.bottleneck.cbm import CbmConfig, stratified_split, train_cbm
from conceptdict.naming.bottleneck.features import concept_directions
from conceptdict.saes.model import SparseCoder

pytestmark = pytest.mark.unit


def planted(n=800, L=400, D=16, seed=0):
    """Sparse non-negative concepts a [n, L] with unit decoder directions [L, D]; raw = a @ directions; the label
    is the side of a random raw direction: every concept carries a little of it, in proportion to d_j . u."""
    g = torch.Generator().manual_seed(seed)
    a = torch.relu(torch.randn(n, L, generator=g)) * (torch.rand(n, L, generator=g) < 0.1)
    dirs = torch.nn.functional.normalize(torch.randn(L, D, generator=g), dim=1)
    raw = a @ dirs + 0.05 * torch.randn(n, D, generator=g)
    s = raw @ torch.randn(D, generator=g)
    y = (s > s.median()).long()
    return a, [f"class{int(v)}" for v in y], [f"c{i}" for i in range(L)], raw, dirs


def test_the_raw_probe_is_returned_in_raw_units_and_takes_the_best_validation_l2():
    a, labels, _, raw, _ = planted(n=400)
    y = torch.tensor([int(v[-1]) for v in labels])
    split = stratified_split(y, 0.15, 0.2, 0)
    probe = fit_raw_probe(raw, y, *split, 2, [0.0, 10.0, 1e6])
    logits = raw @ probe.weight.T + probe.bias
    assert probe.test_accuracy == float((logits[split.test].argmax(1) == y[split.test]).float().mean())
    assert probe.val_accuracy == float((logits[split.val].argmax(1) == y[split.val]).float().mean())
    assert probe.l2 != 1e6 and probe.test_accuracy > 0.85  # a huge L2 flattens the probe: never the best


def test_the_probe_scale_follows_the_probe_and_keeps_the_std_scales_size():
    D = 4
    dirs = torch.eye(D)  # concept j writes raw dimension j
    g = torch.Generator().manual_seed(0)
    a = torch.rand(200, D, generator=g)
    probe = fit_raw_probe(a, (a[:, 0] > 0.5).long(), torch.arange(0, 120), torch.arange(120, 160),
                          torch.arange(160, 200), 2, [1.0])  # fmt: skip
    scale, how = concept_scale(a[:120], "probe", probe, dirs)
    assert how == "probe" and int(scale.argmax()) == 0 and scale[0] > 5 * scale[1:].max()
    assert float((a[:120] * scale).std(0).mean()) == pytest.approx(1.0)
    std, how = concept_scale(a[:120], "std", probe, dirs)
    assert how == "std" and torch.allclose(std, 1 / a[:120].std(0))
    assert concept_scale(a[:120], "probe", probe, None)[1] == "std"  # no decoder: falls back
    assert concept_scale(a[:120], "probe", None, dirs)[1] == "std"  # no probe: falls back
    with pytest.raises(ValueError, match=r"decoder directions \(3, 4\) do not match 4 concepts"):
        concept_scale(a[:120], "probe", probe, dirs[:3])


def test_with_many_concepts_that_each_carry_a_little_of_the_label_the_probe_scale_beats_the_std_scale():
    gains = []
    for seed in range(3):
        a, labels, names, raw, dirs = planted(seed=seed)
        by = {how: train_cbm(a, labels, names, CbmConfig(scale=how), raw=raw, directions=dirs)
              for how in ("std", "probe")}
        assert by["std"].metrics["scale"] == "std" and by["probe"].metrics["scale"] == "probe"
        assert by["std"].metrics["probe_accuracy"] == by["probe"].metrics["probe_accuracy"]  # the same baseline
        gains.append(by["probe"].metrics["accuracy"] - by["std"].metrics["accuracy"])
    assert min(gains) >= 0 and sum(gains) / 3 > 0.04, gains
    # without directions the default falls back to 1 / std, and says so
    fallback = train_cbm(a, labels, names, CbmConfig(), raw=raw)
    assert fallback.metrics["scale"] == "std" and fallback.metrics["accuracy"] == by["std"].metrics["accuracy"]


def test_concept_directions_are_the_decoder_rows_where_they_live_in_the_inputs_space():
    sae = SparseCoder(d_in=8, n_latents=32, kind="topk", k=4)
    assert torch.equal(concept_directions(sae, 8), sae.W_dec.detach())
    assert concept_directions(sae, 16) is None  # inputs of another width
    transcoder = SparseCoder(d_in=8, n_latents=32, kind="transcoder", k=4)
    assert concept_directions(transcoder, 8) is None  # its decoder writes the output, not the input
