"""BatchTopK's defaults of its own (the ``defaults`` each kind declares in saes/kinds/): the TopK start (``TrainConfig.topk_start``)
the stronger tie-break, and the shorter dead window with the stronger AuxK (docs/results/batchtopk.md, "The TopK
start, AuxK weight and dead window"); JumpReLU's TopK start (docs/results/kinds.md, "The other JumpReLU defaults") and its share of batchtopk's AuxK
defaults (docs/results/kinds.md, "AuxK and the dead-threshold rule")."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import SparseCoder, TrainConfig, train_config
from conceptdict.saes.checkpoint import TrainState
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.config import default_dead_tokens, resolve
from conceptdict.saes.kinds.jumprelu import threshold_of
from conceptdict.saes.kinds.common import row_scale
from conceptdict.saes.training import make_optimizer, make_run, step


def _resolved(kind: str, total: int | None = 1000, **kw):
    cfg = TrainConfig(latents=2048, k=8, kind=kind, tokens=total * 1024 if total else None, batch_size=1024, **kw)
    return resolve(cfg, SparseCoder(128, 2048, 8, kind), total, 1024)


@pytest.mark.unit
def test_batchtopk_resolves_its_own_defaults_and_the_other_kinds_keep_theirs():
    tk = _resolved("topk")
    for kind in ("batchtopk", "matryoshka"):  # matryoshka is batchtopk with nested prefixes: the same defaults
        bt = _resolved(kind)
        assert (bt.code_l1, bt.aux_alpha, bt.topk_steps) == (0.15, 0.25, 300), kind
        assert bt.dead_tokens == default_dead_tokens(2048, 8, 1000 * 1024, 1 / 64) == 16000
    assert (tk.code_l1, tk.aux_alpha, tk.topk_steps) == (0.1, 1 / 32, 0)
    assert tk.dead_tokens == 102400  # a tenth of the run
    for kind in ("batchtopk-absolute", "matryoshka-absolute", "crosscoder"):
        r = _resolved(kind)
        assert (r.code_l1, r.aux_alpha, r.topk_steps) == (0.1, 1 / 32, 0), kind
    # jumprelu: batchtopk's AuxK, window and tie-break, and only the absolute rule starts as TopK
    for kind, start in (("jumprelu", 300), ("jumprelu-relative", 0)):
        jr = _resolved(kind)
        assert (jr.code_l1, jr.aux_alpha, jr.topk_steps, jr.dead_tokens) == (0.15, 0.25, start, 16000), kind
    # a value given wins; no length, no TopK start
    given = _resolved("batchtopk", code_l1=0.0, aux_alpha=1 / 32, topk_start=0.5, dead_tokens=5000)
    assert (given.code_l1, given.aux_alpha, given.topk_steps, given.dead_tokens) == (0.0, 1 / 32, 500, 5000)
    assert _resolved("batchtopk", total=None).topk_steps == 0


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [("topk_start", 1.5), ("topk_start", -0.1), ("code_l1", -1.0),
                                         ("aux_alpha", -0.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(latents=64, k=4, kind="batchtopk", **{field: value})


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["batchtopk", "matryoshka"])
def test_per_row_selects_the_rows_own_top_k_of_the_relative_scores(kind):
    torch.manual_seed(0)
    model = SparseCoder(16, 64, 4, kind, kernel_impl="torch")
    model.reset_parameters(generator=torch.Generator().manual_seed(0))
    x = torch.randn(32, 16) * torch.exp(torch.randn(32, 1))  # row norms over an order of magnitude
    per_row = model.spec.train_forward(model, x, local_inputs(x)._replace(per_row=True))
    batch = model.spec.train_forward(model, x, local_inputs(x))
    s = row_scale(model, x)
    pre = ((x - model.b_dec) / s) @ model.W_enc + model.b_enc
    top = pre.topk(4, dim=1)
    dense = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu() * s)
    torch.testing.assert_close(per_row.x_hat, dense @ model.W_dec + model.b_dec)
    assert per_row.smallest is None  # no threshold estimate while selecting per row
    counts = (dense > 0).sum(1)
    assert int(counts.max()) <= 4 and batch.smallest is not None
    assert not torch.allclose(batch.x_hat, per_row.x_hat)  # the batch's cut moves budget between rows


@pytest.mark.unit
def test_the_loop_selects_per_row_for_the_first_topk_steps_only():
    # the threshold estimate follows the batch's cut, so it counts the steps after the TopK start
    torch.manual_seed(0)
    model = SparseCoder(16, 64, 4, "batchtopk", kernel_impl="torch")
    model.reset_parameters(generator=torch.Generator().manual_seed(0))
    cfg = train_config(latents=64, k=4, kind="batchtopk", tokens=10 * 32, batch_size=32, threshold_start_step=0,
                      topk_start=0.3, b_dec_init="zero")
    r = resolve(cfg, model, 10, 32)
    assert r.topk_steps == 3
    state = TrainState(since_fired=torch.zeros(64, dtype=torch.long))
    run = make_run(cfg, model, torch.Generator(), make_optimizer(model, 1e-3), state, r)
    for i in range(10):
        step(run, torch.randn(32, 16), cfg, 1e-3)
        assert run.state.threshold_updates == max(0, i + 1 - 3)


def _kth_mean(pre: torch.Tensor, k: int) -> float:
    """Mean over rows of each row's k-th largest positive pre-activation (its smallest positive one if fewer)."""
    top = pre.detach().relu().topk(k, dim=1).values
    kth = top.masked_fill(top <= 0, float("inf")).min(dim=1).values
    return float(kth[torch.isfinite(kth)].mean())


def _jumprelu() -> SparseCoder:
    """A freshly initialised jumprelu (D=16, L=64, k=4) with its training parameters, torch's RNG at seed 0."""
    torch.manual_seed(0)
    model = SparseCoder(16, 64, 4, "jumprelu", kernel_impl="torch")
    model.reset_parameters(generator=torch.Generator().manual_seed(0))
    model.add_train_params()
    return model


def _theta(model: SparseCoder) -> float:
    """The common threshold of a jumprelu whose latents all share one (as the start sets them)."""
    theta = threshold_of(model).detach()
    assert torch.allclose(theta, theta[0].expand_as(theta)), "the start sets one threshold for every latent"
    return float(theta[0])


@pytest.mark.unit
def test_jumprelu_start_selects_per_row_and_sets_theta_where_the_rule_keeps_k():
    model = _jumprelu()
    x = torch.randn(32, 16) * torch.exp(torch.randn(32, 1))
    cfg = TrainConfig(latents=64, k=4, kind="jumprelu")
    out = model.spec.train_forward(model, x, local_inputs(x)._replace(per_row=True, settings=cfg.kind_settings, code_l1=0.1))
    pre = (x - model.b_dec) @ model.W_enc + model.b_enc
    top = pre.topk(4, dim=1)
    dense = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())
    torch.testing.assert_close(out.x_hat, dense @ model.W_dec + model.b_dec)
    assert _theta(model) == pytest.approx(_kth_mean(pre, 4), rel=1e-5)
    (x - out.x_hat).square().sum().add(out.sparsity_loss).backward()
    # the threshold is set, not trained, during the start: the loss does not reach it
    assert model.scaled_log_threshold.grad is None
    # the rule that takes over keeps about k per row on these rows at that theta
    after = model.spec.train_forward(model, x, local_inputs(x)._replace(settings=cfg.kind_settings))
    assert 2 <= float(after.l0) <= 8


@pytest.mark.unit
def test_the_loop_trains_jumprelus_threshold_after_its_start_only():
    model = _jumprelu()
    cfg = TrainConfig(latents=64, k=4, kind="jumprelu", tokens=10 * 32, batch_size=32, b_dec_init="zero")
    r = resolve(cfg, model, 10, 32)
    assert r.topk_steps == 3
    run = make_run(cfg, model, torch.Generator(), make_optimizer(model, 1e-3), TrainState(since_fired=torch.zeros(
        64, dtype=torch.long)), r)
    for i in range(10):
        x = torch.randn(32, 16)
        with torch.no_grad():
            expected = _kth_mean((x - model.b_dec) @ model.W_enc + model.b_enc, 4)
        step(run, x, cfg, 1e-3)
        if i < 3:
            assert _theta(model) == pytest.approx(expected, rel=1e-5), i
            # the loop gives the unreached threshold a zero gradient, as a sum over several processes does, so
            # Adam's state for it is the same in one process and in several
            assert torch.equal(model.scaled_log_threshold.grad, torch.zeros(64)), i
            assert torch.equal(run.opt.state[model.scaled_log_threshold]["exp_avg"], torch.zeros(64)), i
        else:  # trained by its estimator from here on: the latents' thresholds part
            assert threshold_of(model).detach().std() > 0, i
