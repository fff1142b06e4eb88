"""diff ranks latents by how much their decoder changes between the models (``LatentDiff.changed``), so a
direction model B adds on top of an existing feature is reported even though Delta (decoder norms only) tags the
latent that absorbed it "other" or "shared" and no latent is B-only."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import train, train_config
from conceptdict.saes.diffing import DiffAnalysisConfig, decoder_change, diff_crosscoder, training_directions
from conceptdict.saes.flat import flat_for_kind
from generators.synthetic import planted_codes, planted_pair

TOPIC = (0, 1)
"""Atoms whose rows ("one topic's tokens") get the planted direction in model B."""


def _added_on_top(n_batches: int, seed: int, batch: int = 256, d: int = 16, n_atoms: int = 24):
    """(batches [B, 2, D], planted unit direction [D], fraction of rows changed): A's rows are sparse codes through
    unit atoms (planted_pair with every atom shared); B's are the same rows plus the planted direction on the rows
    where a TOPIC atom fires. Atoms come from planted_pair's own seed, rows and direction from ``seed``."""
    atoms = planted_pair(d, n_shared=n_atoms, n_b_only=0, n_scaled=0, n_rotated=0, seed=0).atoms_a
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=torch.Generator().manual_seed(123))
    v = v / v.norm()
    out, changed = [], 0
    for _ in range(n_batches):
        codes = planted_codes(batch, n_atoms, 0.08, gen)
        a = codes @ atoms + 0.01 * torch.randn(batch, d, generator=gen)
        topic = (codes[:, list(TOPIC)] > 0).any(dim=1)
        changed += int(topic.sum())
        out.append(torch.stack([a, a + topic[:, None].float() * v], dim=1))
    return out, v, changed / (n_batches * batch)


def test_decoder_change_formula():
    d_a = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    d_b = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    assert decoder_change(d_a, d_b).tolist() == pytest.approx([0.0, 1.0, 1.0 / 2 ** 0.5, 0.0])


@pytest.mark.integration
def test_direction_added_on_top_of_existing_features_is_among_the_top_changed_latents():
    train_batches, v, fraction = _added_on_top(160, seed=1)
    held_out, _, _ = _added_on_top(4, seed=2)
    assert 0.1 < fraction < 0.2  # ~15% of rows carry the planted direction in B
    cfg = train_config(**flat_for_kind(dict(latents=64, k=3, kind="crosscoder", batch_size=256, eval_batches=0,
                                            seed=0, log_every=10**9, checkpoint_every=0, device="cpu"), "crosscoder"))
    model = train(cfg, train_batches)
    table = diff_crosscoder(model, held_out, DiffAnalysisConfig())
    directions = training_directions(model).double()
    diff_dirs = directions[:, 1] - directions[:, 0]
    cos = torch.nn.functional.normalize(diff_dirs, dim=-1) @ v.double()
    top = table.changed(5)
    assert [r["change"] for r in top] == sorted((r["change"] for r in top), reverse=True)
    hits = [(rank, r) for rank, r in enumerate(top) if cos[r["latent"]] > 0.9]
    assert hits, [(r["latent"], r["tag"], round(r["change"], 3), round(float(cos[r["latent"]]), 3)) for r in top]
    rank, hit = hits[0]
    print(f"planted direction: rank {rank}, latent {hit['latent']}, cosine {float(cos[hit['latent']]):.4f}, "
          f"change {hit['change']:.3f}, tag {hit['tag']}, delta {hit['delta']:.3f}; tags {table.counts()}")
    assert hit["tag"] != "B-only"  # Delta alone does not point at it: that is what the ranking is for
