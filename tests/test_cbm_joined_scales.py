"""bench/cbm_candidates.py's joined candidates (``own+pooledsuper@5``): each part keeps the probe scale it gets alone
under the CBM's one probe scale over the joined concepts, whatever the parts' units."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conceptdict.naming.bottleneck.baseline import RawProbe, concept_scale

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cbm_candidates import part_scales


@pytest.mark.unit
def test_each_part_is_scaled_as_it_is_alone():
    gen = torch.Generator().manual_seed(0)
    D, widths = 12, [5, 7]
    probe = RawProbe(torch.randn(3, D, generator=gen), torch.zeros(3), 1.0, 0.0, 0.0)
    dirs = torch.randn(sum(widths), D, generator=gen)
    x = torch.rand(40, sum(widths), generator=gen)
    x[:, widths[0]:] *= 30.0  # the second part in other units (token against sentence activations)
    rows = torch.arange(0, 40, 2)
    joined = part_scales(x, dirs, widths, probe, rows)
    scale, how = concept_scale(joined[rows], "probe", probe, dirs)
    assert how == "probe"
    at = 0
    for w in widths:
        alone, _ = concept_scale(x[rows, at:at + w], "probe", probe, dirs[at:at + w])
        torch.testing.assert_close(joined[:, at:at + w] * scale[at:at + w], x[:, at:at + w] * alone)
        at += w
    # without it the one normalisation favours the part in larger units
    plain, _ = concept_scale(x[rows], "probe", probe, dirs)
    assert not torch.allclose(x[:, :5] * plain[:5], x[:, :5] * concept_scale(x[rows, :5], "probe", probe, dirs[:5])[0])
    # std (no directions) is per concept already: nothing is divided
    assert part_scales(x, None, widths, probe, rows) is x
