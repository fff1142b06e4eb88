"""The planted concept-geometry data (generators.geometry, bench/concept_geometry.py): the concepts, the rows, the
separation from a dictionary's initialisation, and the recovery criterion on hand-built dictionaries."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import SparseCoder
from generators.geometry import GeometrySpec, active_per_type, concept_batch, plant, score_concepts

pytestmark = pytest.mark.unit

SPEC = GeometrySpec(d=32, rays=8, subspaces=4, regions=4, seed=3)


def test_concepts_are_orthogonal_and_typed():
    c = plant(SPEC)
    assert c.types == ["ray"] * 8 + ["subspace"] * 4 + ["core", "shell"] * 4
    assert [b.shape[0] for b in c.bases[8:12]] == [2, 3, 2, 3]
    rows = torch.cat([b for t, b in zip(c.types, c.bases) if t != "shell"]
                     + [m[None] / m.norm() for t, m in zip(c.types, c.centres) if t == "core"])
    torch.testing.assert_close(rows @ rows.T, torch.eye(rows.shape[0]), atol=1e-5, rtol=0)
    j = c.types.index("core")
    assert torch.equal(c.centres[j], c.centres[j + 1]) and torch.equal(c.bases[j], c.bases[j + 1])
    assert torch.equal(plant(SPEC).bases[0], c.bases[0])
    assert not torch.equal(plant(GeometrySpec(d=32, rays=8, subspaces=4, regions=4, seed=4)).bases[0], c.bases[0])


def test_the_concepts_are_not_where_a_dictionary_seeded_like_the_data_starts():
    c = plant(SPEC)
    model = SparseCoder(SPEC.d, 128, 4)
    model.reset_parameters(generator=torch.Generator().manual_seed(SPEC.seed))
    d = torch.nn.functional.normalize(model.decoder_directions(), dim=1)
    best = torch.stack([(d @ c.bases[j][0]).abs().max() for j in range(8)])
    assert float(best.mean()) < 0.6, best  # chance level for 128 random directions in D=32 is ~0.5


def test_rows_hold_their_concepts():
    c = plant(SPEC)
    x, held = concept_batch(SPEC, c, 0, 400)
    x2, held2 = concept_batch(SPEC, c, 0, 400)
    assert torch.equal(x, x2) and torch.equal(held, held2)
    assert bool((held.sum(dim=1) == 1).all())
    for j, t in enumerate(c.types):
        r = x[held[:, j]]
        if t in ("core", "shell"):
            off = r - c.centres[j]
            ring = (off @ c.bases[j].T).norm(dim=1)
            if t == "shell":
                torch.testing.assert_close(ring, torch.full_like(ring, SPEC.radius), atol=0.2, rtol=0)
            else:
                assert float(ring.max()) < SPEC.radius
        else:
            outside = r - (r @ c.bases[j].T) @ c.bases[j]  # only the noise, norm ~0.02 sqrt(32)
            assert float(outside.norm(dim=1).max()) < 0.25
    two = GeometrySpec(d=32, rays=8, subspaces=4, regions=4, per_row=2)
    assert bool((concept_batch(two, plant(two), 1, 50)[1].sum(dim=1) == 2).all())


def test_bad_specs_say_what_to_change():
    with pytest.raises(ValueError, match="do not fit in d=16"):
        GeometrySpec(d=16, rays=8, subspaces=4, regions=4)
    with pytest.raises(ValueError, match="per_row=0"):
        GeometrySpec(d=32, rays=8, subspaces=4, regions=4, per_row=0)


def _oracle(c, held, per_subspace_dir=True):
    """Decoder rows and codes of an ideal dictionary: each ray and each +-basis vector of each subspace a latent
    firing exactly on its concept's rows, and one latent per region firing exactly on that region's rows."""
    dirs, fire = [], []
    for j, t in enumerate(c.types):
        if t == "ray":
            dirs.append(c.bases[j][0]); fire.append(held[:, j])
        elif t == "subspace":
            for b in (c.bases[j] if per_subspace_dir else c.bases[j][:1]):
                dirs += [b, -b]; fire += [held[:, j], held[:, j]]
        else:
            dirs.append(c.centres[j]); fire.append(held[:, j])
    return torch.stack(dirs), torch.stack(fire, dim=1).float()


def test_an_ideal_dictionary_recovers_every_concept():
    c = plant(SPEC)
    _, held = concept_batch(SPEC, c, 0, 2000)
    dirs, codes = _oracle(c, held)
    scores = score_concepts(c, dirs, codes, held)
    assert all(s.recovered for s in scores), scores
    assert [s.dims for s in scores[8:12]] == [2, 3, 2, 3]
    active = active_per_type(c, codes, held)
    assert active["ray"] == 1.0 and active["core"] == 1.0
    assert active["subspace"] == pytest.approx(5.0, abs=0.5)  # 4 latents (+-) on 2-d rows, 6 on 3-d rows


def test_one_direction_does_not_recover_a_subspace_and_an_unselective_latent_recovers_nothing():
    c = plant(SPEC)
    _, held = concept_batch(SPEC, c, 0, 2000)
    dirs, codes = _oracle(c, held, per_subspace_dir=False)
    scores = score_concepts(c, dirs, codes, held)
    assert not any(s.recovered for s in scores[8:12]) and all(s.f1 == 1.0 for s in scores[8:12])
    assert all(s.recovered for s in scores[:8])
    # every latent also fires on 20% of the other rows: precision < 0.9, no concept latent anywhere
    noisy = torch.maximum(codes, (torch.rand(codes.shape, generator=torch.Generator().manual_seed(0)) < 0.2).float())
    assert not any(s.recovered for s in score_concepts(c, dirs, noisy, held))
    # a ray latent whose decoder points elsewhere is not that ray's, however it fires
    moved = dirs.clone()
    moved[0] = c.bases[1][0]
    assert not score_concepts(c, moved, codes, held)[0].recovered
