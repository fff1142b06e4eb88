"""JumpReLU's dead-latent rule (saes/kinds/jumprelu.py, docs/results/kinds.md "AuxK and the dead-threshold rule"): both rules take the AuxK loss
over the loop's dead latents, and a dead latent's threshold comes down to the largest pre-activation it reaches on
the batch, so that AuxK can bring it back."""

from __future__ import annotations

import math

import pytest
import torch

from conceptdict.saes import SparseCoder, TrainConfig
from conceptdict.saes.checkpoint import TrainState
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.config import resolve
from conceptdict.saes.kinds.jumprelu import DEAD_MARGIN, THRESHOLD_RATE, lower_dead_thresholds, threshold_of
from conceptdict.saes.kinds.common import row_scale
from conceptdict.saes.training import make_optimizer, make_run, step

pytestmark = pytest.mark.unit

KINDS = ["jumprelu", "jumprelu-relative"]


def _model(kind: str, seed: int = 0) -> SparseCoder:
    torch.manual_seed(seed)
    model = SparseCoder(16, 64, 4, kind, kernel_impl="torch")
    model.reset_parameters(generator=torch.Generator().manual_seed(seed))
    model.add_train_params()
    return model


def _scaled(model: SparseCoder, x: torch.Tensor) -> torch.Tensor:
    """The rows on the kind's scale, as its training forward compares them with the thresholds."""
    return (x - model.b_dec) / row_scale(model, x) if model.spec.relative else x - model.b_dec


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_latents_threshold_drops_just_below_its_largest_pre_activation_and_never_rises(kind):
    model = _model(kind)
    x = torch.randn(40, 16) * torch.exp(torch.randn(40, 1))
    with torch.no_grad():
        model.scaled_log_threshold.fill_(math.log(0.5) / THRESHOLD_RATE)
        model.scaled_log_threshold[:8] = math.log(50.0) / THRESHOLD_RATE  # far above every pre-activation
        model.scaled_log_threshold[8:12] = math.log(1e-4) / THRESHOLD_RATE  # below them: must stay
        pre = _scaled(model, x) @ model.W_enc + model.b_enc
    dead = torch.zeros(64, dtype=torch.bool)
    dead[:12] = True
    before = threshold_of(model).detach().clone()
    lower_dead_thresholds(model, _scaled(model, x), local_inputs(x, dead=dead))
    after = threshold_of(model).detach()
    best = pre.max(dim=0).values
    assert bool((best[:8] > 0).all())  # random encoders at this size reach positive values on 40 rows
    torch.testing.assert_close(after[:8], best[:8] * (1 - DEAD_MARGIN), rtol=1e-5, atol=0)
    assert bool((after[:8] < best[:8]).all())  # just below: the best row fires whatever the rounding
    torch.testing.assert_close(after[8:], before[8:], rtol=0, atol=0)  # the alive and the low ones are untouched


@pytest.mark.parametrize("kind", KINDS)
def test_the_training_forward_returns_the_auxk_code_over_the_dead_latents(kind):
    model = _model(kind)
    x = torch.randn(32, 16) * torch.exp(torch.randn(32, 1))
    dead = torch.zeros(64, dtype=torch.bool)
    dead[::5] = True
    out = model.spec.train_forward(model, x, local_inputs(x, dead=dead, k_aux=3))
    assert out.aux is not None and out.aux.values.shape == (32, 3)
    assert bool(dead[out.aux.indices].all())
    # the values are the dead latents' top ReLU pre-activations on the kind's scale, in the rows' units
    pre = (_scaled(model, x) @ model.W_enc + model.b_enc).relu()
    top = pre.masked_fill(~dead, -1.0).topk(3, dim=1).values.clamp_min(0)
    unit = row_scale(model, x) if model.spec.relative else 1.0
    torch.testing.assert_close(out.aux.values.detach().sort(dim=1).values, (top * unit).sort(dim=1).values)
    assert model.spec.train_forward(model, x, local_inputs(x)).aux is None  # no dead latents handed over: none


@pytest.mark.parametrize("kind", KINDS)
def test_the_loop_revives_latents_whose_thresholds_were_left_above_their_rows(kind):
    # 8 latents get thresholds far above anything they reach: without the rule they could never fire again (the
    # estimators only reach entries within eps / 2 of a threshold); the loop flags them dead after the window, the
    # thresholds come down and the latents fire
    model = _model(kind, seed=1)
    cfg = TrainConfig(latents=64, k=4, kind=kind, tokens=60 * 64, batch_size=64, b_dec_init="zero", topk_start=0.0,
                      dead_tokens=128)
    r = resolve(cfg, model, 60, 64)
    gen = torch.Generator().manual_seed(2)
    atoms = torch.nn.functional.normalize(torch.randn(32, 16, generator=gen), dim=1)

    def batch():
        c = torch.rand(64, 32, generator=gen) * (torch.rand(64, 32, generator=gen) < 0.1)
        return c @ atoms * math.sqrt(16) + 0.01 * torch.randn(64, 16, generator=gen)

    x0 = batch()
    with torch.no_grad():
        pre = _scaled(model, x0) @ model.W_enc + model.b_enc
        kth = float(pre.relu().flatten().topk(64 * 4).values.min())
        model.scaled_log_threshold.fill_(math.log(kth) / THRESHOLD_RATE)
        model.scaled_log_threshold[:8] = math.log(1e3 * kth) / THRESHOLD_RATE
    state = TrainState(since_fired=torch.zeros(64, dtype=torch.long))
    run = make_run(cfg, model, torch.Generator(), make_optimizer(model, 1e-3), state, r)
    for _ in range(40):
        step(run, batch(), cfg, 1e-3)
    assert float(threshold_of(model).detach()[:8].max()) < 10 * kth  # they came down from 1000x
    assert int((run.state.since_fired[:8] < 128).sum()) >= 4, run.state.since_fired[:8]  # and most fire again
