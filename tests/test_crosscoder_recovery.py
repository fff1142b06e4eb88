"""Model diffing on planted two-model data through the real training loop (small; bench/crosscoder_diff.py is
the larger run): the BatchTopK crosscoder + Latent Scaling finds exactly the B-only atoms and tags shared atoms
shared; the L1 crosscoder read by Delta alone misattributes atoms scaled down in A as B-only (complete
shrinkage), which Latent Scaling then flags."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import evaluate, load_dictionary, save_dictionary, train, train_config
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.kinds.crosscoder import input_scale
from conceptdict.saes.diffing import DiffAnalysisConfig, diff_crosscoder
from generators.synthetic import planted_batches, planted_pair, score_b_only

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def planted():
    pair = planted_pair(16, n_shared=8, n_b_only=4, n_scaled=4, n_rotated=2, n_a_only=4, scale=0.3, seed=0)
    p_fire = 2.5 / len(pair.kinds)
    train_batches = list(planted_batches(pair, 256, 220, p_fire=p_fire, seed=1))
    held_out = list(planted_batches(pair, 256, 4, p_fire=p_fire, seed=2))
    return pair, train_batches, held_out


def _run(kind, planted):
    pair, train_batches, held_out = planted
    cfg = train_config(**flat_for_kind(dict(latents=64, k=3, kind=kind, batch_size=256, eval_batches=0, l1_coeff=1.5, seed=0,
                                            log_every=10**9, checkpoint_every=0, device="cpu"), kind))
    model = train(cfg, train_batches)
    table = diff_crosscoder(model, held_out, DiffAnalysisConfig())
    directions = model.decoder_directions() * input_scale(model)[None, :, None]
    by_delta = torch.tensor([t == "B-only" for t in table.tags])
    return model, table, directions, (score_b_only(table, directions, pair, by_delta),
                                      score_b_only(table, directions, pair, table.flags["model_specific"]))


@pytest.mark.parametrize("kind", ["crosscoder-absolute", "crosscoder"])
def test_batchtopk_crosscoder_with_latent_scaling_recovers_b_only_atoms(planted, tmp_path, kind):
    """Both BatchTopK crosscoders find every B-only atom on this easy problem (uniform magnitudes) and call
    nothing else B-only."""
    pair, _, held_out = planted
    model, table, directions, (by_delta, by_scaling) = _run(kind, planted)
    assert evaluate(model, held_out).fvu < 0.1
    assert by_scaling.recall == 1.0, by_scaling
    assert by_scaling.precision == 1.0, by_scaling
    assert by_scaling.shared_tagged_shared >= 0.75, by_scaling
    assert by_delta.misattributed.get("scaled", 0) == 0, by_delta
    # A-only atoms come out A-only
    cos = torch.nn.functional.normalize(directions[:, 0], dim=-1) @ torch.nn.functional.normalize(
        pair.atoms_a, dim=-1).T
    a_only = [n for n, kind in enumerate(pair.kinds) if kind == "a_only"]
    assert all(table.tags[int(cos[:, n].argmax())] == "A-only" for n in a_only)
    # the artifact round-trips with the crosscoder's inference rule (folded normalisation included)
    again = load_dictionary(save_dictionary(model, tmp_path / "cc"))
    x = held_out[0]
    assert torch.allclose(again.encode(x), model.encode(x), atol=1e-5)
    table2 = diff_crosscoder(again, held_out, DiffAnalysisConfig())
    assert table2.tags == table.tags and torch.equal(table2.flags["model_specific"], table.flags["model_specific"])


def test_l1_crosscoder_misattributes_shrunk_atoms_and_latent_scaling_flags_them(planted):
    _, table, _, (by_delta, by_scaling) = _run("crosscoder-l1", planted)
    assert by_delta.misattributed.get("scaled", 0) >= 2, by_delta
    assert by_scaling.misattributed.get("scaled", 0) == 0, by_scaling
    assert by_scaling.precision > by_delta.precision
    assert by_scaling.recall == 1.0
    assert table.counts()["complete_shrinkage"] >= by_delta.misattributed["scaled"]
