"""BatchTopK's defaults of its own (``saes.config.KIND_DEFAULTS``): the TopK start (``TrainConfig.topk_start``)
and the shorter dead window with the stronger AuxK (docs/batchtopk.md, "BatchTopK starts
as TopK")."""

from __future__ import annotations

import pytest
import torch

from conceptdict.saes import SparseCoder, TrainConfig
from conceptdict.saes.checkpoint import TrainState
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.config import default_dead_tokens, resolve
from conceptdict.saes.model import row_scale
from conceptdict.saes.training import Run, make_optimizer, step


def _resolved(kind: str, total: int | None = 1000, **kw):
    cfg = TrainConfig(latents=2048, k=8, kind=kind, tokens=total * 1024 if total else None, batch_size=1024, **kw)
    return resolve(cfg, SparseCoder(128, 2048, 8, kind), total, 1024)


@pytest.mark.unit
def test_batchtopk_resolves_its_own_defaults_and_the_other_kinds_keep_theirs():
    bt, tk = _resolved("batchtopk"), _resolved("topk")
    assert (bt.aux_alpha, bt.topk_steps) == (0.25, 300)
    assert bt.dead_tokens == default_dead_tokens(2048, 8, 1000 * 1024, 1 / 64) == 16000
    assert (tk.aux_alpha, tk.topk_steps) == (1 / 32, 0)
    assert tk.dead_tokens == 102400  # a tenth of the run
    for kind in ("matryoshka", "jumprelu-relative", "crosscoder"):
        r = _resolved(kind)
        assert (r.aux_alpha, r.topk_steps) == (1 / 32, 0), kind
    # a value given wins; no length, no TopK start
    given = _resolved("batchtopk", aux_alpha=1 / 32, topk_start=0.5, dead_tokens=5000)
    assert (given.aux_alpha, given.topk_steps, given.dead_tokens) == (1 / 32, 500, 5000)
    assert _resolved("batchtopk", total=None).topk_steps == 0


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [("topk_start", 1.5), ("topk_start", -0.1), ("code_l1", -1.0),
                                         ("aux_alpha", -0.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(latents=64, k=4, kind="batchtopk", **{field: value})


@pytest.mark.unit
def test_per_row_selects_the_rows_own_top_k_of_the_relative_scores():
    torch.manual_seed(0)
    model = SparseCoder(16, 64, 4, "batchtopk", kernel_impl="torch")
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
    cfg = TrainConfig(latents=64, k=4, kind="batchtopk", tokens=10 * 32, batch_size=32, threshold_start_step=0,
                      topk_start=0.3, b_dec_init="zero")
    r = resolve(cfg, model, 10, 32)
    assert r.topk_steps == 3
    state = TrainState(since_fired=torch.zeros(64, dtype=torch.long))
    run = Run(model, torch.Generator(), make_optimizer(model, 1e-3), state, r)
    for i in range(10):
        step(run, torch.randn(32, 16), cfg, 1e-3)
        assert run.state.threshold_updates == max(0, i + 1 - 3)
