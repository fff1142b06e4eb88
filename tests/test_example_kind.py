"""Adding a kind touches only its module and one registry line: the example kind of tests/fixtures_kind.py,
registered through the public registry API, gets its flat setting, its defaults and trains through saes.train."""

from __future__ import annotations

import functools

import pytest

from conceptdict import saes
from generators.synthetic import SyntheticSpec, synthetic_batches

from fixtures_kind import KINDS, TopkL1Settings

pytestmark = pytest.mark.unit

SPEC = SyntheticSpec(n_atoms=32, d=12, active=3, batch_size=64, n_batches=8, seed=1)


@pytest.fixture
def example_kind():
    (spec,) = KINDS
    saes.register(spec)
    try:
        yield spec
    finally:
        saes.unregister(spec.name)


class _Record:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, record: dict) -> None:
        self.rows.append(record)

    def close(self) -> None:
        pass


def test_a_registered_kind_has_its_flat_setting_and_trains(example_kind):
    fields = {f.name: f for f in saes.flat_train_fields()}
    assert fields["topk_l1_coeff"].kinds == ("topk-l1",) and fields["topk_l1_coeff"].default == 0.01
    with pytest.raises(ValueError, match="topk_l1_coeff is a setting of topk-l1; kind 'topk' does not read it"):
        saes.train_config(latents=32, k=3, topk_l1_coeff=0.5)
    cfg = saes.train_config(latents=32, k=3, kind="topk-l1", topk_l1_coeff=0.5, eval_batches=1, init_rows=64,
                            log_every=1, checkpoint_every=0, device="cpu", kernel_impl="reference", lr=1e-2)
    assert cfg.settings == TopkL1Settings(topk_l1_coeff=0.5)
    assert saes.train_config(**saes.to_flat(cfg)) == cfg
    sink = _Record()
    model = saes.train(cfg, functools.partial(synthetic_batches, SPEC), sink=sink)
    summary = model.training_summary
    assert summary["steps"] == 7 and summary["config"]["topk_l1_coeff"] == 0.5
    assert summary["resolved"]["aux_alpha"] == 1 / 16  # the kind's default for a shared field
    # the kind's penalty is in the loss: loss = fvu + aux_alpha * aux + the L1 term (> 0 while codes are kept)
    assert all(r["loss"] - r["fvu"] - r["aux"] / 16 > 1e-4 for r in sink.rows)
    assert all(r["l0"] == pytest.approx(3.0) for r in sink.rows)


def test_unregister_removes_an_added_kind_but_not_a_built_in_one(example_kind):
    assert saes.kind_spec("topk-l1") is example_kind
    saes.unregister("topk-l1")
    with pytest.raises(ValueError, match="unknown dictionary kind 'topk-l1'"):
        saes.kind_spec("topk-l1")
    with pytest.raises(ValueError, match="built in"):
        saes.unregister("topk")
    with pytest.raises(ValueError, match="already registered"):
        saes.register(saes.kind_spec("topk"))
