"""Golden training numbers: every trainable kind, a seeded few-step run with the reference kernels, per-step
FVU / L0 / AuxK (and loss, learning rate, the final threshold, the held-out FVU) against the numbers checked
in at tests/golden/training.json. The other numeric tests are relative (resumed against uninterrupted, two
ranks against one, kernel against reference); this one catches a change to the schedule, a loss weight, the
dead-latent rule or the threshold update. Regenerate ONLY as tests/golden/make_golden.py's docstring says."""

from __future__ import annotations

import json

import pytest

from golden.make_golden import BF16_KINDS, GOLDEN, compare, golden_run, trainable_kinds

from conceptdict.saes import KINDS

pytestmark = [pytest.mark.unit, pytest.mark.equivalence]  # the same numbers under every CPU capability

WANT = json.loads(GOLDEN.read_text())


def test_every_trainable_kind_has_golden_numbers():
    assert sorted(WANT["kinds"]) == trainable_kinds(), (
        "a kind was added or removed: run tests/golden/make_golden.py and check that only its entry changed")


@pytest.mark.parametrize("kind", sorted(WANT["kinds"]))
def test_training_matches_golden_numbers(kind):
    want = WANT["kinds"][kind]
    assert len(want["fvu"]) == WANT["steps"] and any(want["aux"]) == KINDS[kind].uses_aux
    bad = compare(golden_run(kind), want)
    assert not bad, f"{kind} trains differently from tests/golden/training.json:\n" + "\n".join(bad[:12])


def test_bf16_runs_are_pinned():
    assert sorted(WANT["bf16"]) == sorted(BF16_KINDS)


@pytest.mark.parametrize("kind", sorted(WANT["bf16"]))
def test_bf16_training_matches_golden_numbers(kind):
    """precision="bf16": the latents chosen by a bf16 matmul, their values, the loss and Adam in float32."""
    bad = compare(golden_run(kind, "bf16"), WANT["bf16"][kind])
    assert not bad, f"{kind} (bf16) trains differently from tests/golden/training.json:\n" + "\n".join(bad[:12])
