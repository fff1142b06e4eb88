"""The planted generator's hierarchical setting (parents and the children that imply them) and the absorption
measure bench/synthetic_recovery.py reports on it."""

from __future__ import annotations

import pytest
import torch

from generators.synthetic import (SyntheticSpec, absorption, atom_probabilities, planted_atoms, synthetic_batch,
                                        synthetic_batch_and_atoms)

FAMILIES = SyntheticSpec(n_atoms=64, d=32, active=3.0, batch_size=4096, seed=2, coef_sigma=0.5, children=3,
                         child_prob=0.5)


@pytest.mark.unit
def test_a_child_is_only_active_with_its_parent_and_one_child_at_most():
    x, mask = synthetic_batch_and_atoms(FAMILIES, 0)
    P = FAMILIES.n_parents
    assert P == 16 and mask.shape == (4096, 64)
    parents, kids = mask[:, :P], mask[:, P:].reshape(-1, P, 3)
    assert not (kids.any(dim=2) & ~parents).any()
    assert int(kids.sum(dim=2).max()) == 1
    # an active parent holds a child half the time, and a row holds `active` atoms on average
    assert float(kids.any(dim=2)[parents].float().mean()) == pytest.approx(0.5, abs=0.03)
    assert float(mask.sum(dim=1).float().mean()) == pytest.approx(3.0, rel=0.05)
    assert atom_probabilities(FAMILIES).shape == (P,)
    torch.testing.assert_close(x, synthetic_batch(FAMILIES, 0))


@pytest.mark.unit
def test_absorption_counts_the_parent_latent_silent_on_rows_with_a_child():
    _, mask = synthetic_batch_and_atoms(FAMILIES, 1)
    atoms = planted_atoms(FAMILIES)
    exact = absorption(FAMILIES, atoms, mask, mask)
    assert exact == (0.0, 0.0, 1.0, 1.0)
    # a dictionary that folds each parent into its children: the parent latent fires only without a child
    P = FAMILIES.n_parents
    folded = mask.clone()
    folded[:, :P] &= ~mask[:, P:].reshape(-1, P, 3).any(dim=2)
    assert absorption(FAMILIES, atoms, folded, mask)[:2] == (1.0, 0.0)
    # child latents that blend in the parent direction no longer match their atoms
    blended = atoms.clone()
    blended[P:] += atoms[:P].repeat_interleave(3, dim=0)
    got = absorption(FAMILIES, blended, folded, mask)
    assert got.parent_recovery == 1.0 and got.child_recovery == 0.0


@pytest.mark.unit
def test_bad_family_settings_name_the_value():
    with pytest.raises(ValueError, match="children=3 .* n_atoms=30"):
        SyntheticSpec(n_atoms=30, children=3)
    with pytest.raises(ValueError, match="child_prob=1.5"):
        SyntheticSpec(n_atoms=32, children=3, child_prob=1.5)
    flat = SyntheticSpec(n_atoms=32, d=16, batch_size=64)
    x, mask = synthetic_batch_and_atoms(flat, 0)
    with pytest.raises(ValueError, match="children"):
        absorption(flat, planted_atoms(flat), mask, mask)
