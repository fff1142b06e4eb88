"""Transcoders and skip transcoders: kernels against the reference, folding, exact resume, artifacts, export, CLI."""

from __future__ import annotations

import functools
import importlib
import json

import pytest
import torch

from conceptdict.saes import KINDS, SparseCoder, TrainConfig, evaluate, load_dictionary, train
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.formats import open_dictionary
from conceptdict.saes.formats.export import export_dictionary
from generators.synthetic import SyntheticSpec, synthetic_batch
from crashing import Crash, crashing

KINDS_HERE = ("transcoder", "skip-transcoder")
SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=14, seed=3)
IMPLS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                                   reason="no numba"))]


def _mlp(x: torch.Tensor) -> torch.Tensor:
    """A fixed planted 'MLP' from D=12 to D=12: a linear part plus a sparse nonlinear part."""
    g = torch.Generator().manual_seed(11)
    A, B, C = torch.randn(12, 12, generator=g), torch.randn(12, 40, generator=g), torch.randn(40, 12, generator=g)
    return 0.5 * x @ A + torch.relu(x @ B - 2.0) @ C


def pair_batches(start: int = 0, n: int = SPEC.n_batches, scale: float = 1.0):
    """(input, output) pairs [B, 2, 12] of the planted MLP, deterministic per batch index (seekable)."""
    for i in range(start, n):
        x = synthetic_batch(SPEC, i) * scale
        yield torch.stack([x, _mlp(x) * 3.0], dim=1)


def _cfg(**kw):
    base = dict(latents=32, k=3, kind="transcoder", eval_batches=2, log_every=2, checkpoint_every=3, device="cpu",
                init_rows=64, kernel_impl="reference")
    return TrainConfig(**(base | kw))


def _random_model(kind: str, impl: str) -> SparseCoder:
    g = torch.Generator().manual_seed(0)
    m = SparseCoder(19, 53, 5, kind, kernel_impl=impl)
    m.reset_parameters(generator=g)
    assert not m.W_dec.any()  # a transcoder's decoder starts at zero (sparsify's initialisation)
    with torch.no_grad():
        m.W_dec.copy_(torch.nn.functional.normalize(torch.randn(53, 19, generator=g), dim=1))
        m.b_enc.copy_(torch.randn(53, generator=g) * 0.1)
        m.b_dec.copy_(torch.randn(19, generator=g))
        if m.spec.skip:
            m.W_skip.copy_(torch.randn(19, 19, generator=g) * 0.1)
    return m


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
@pytest.mark.parametrize("impl", IMPLS)
def test_training_forward_matches_the_reference_kernels(kind, impl):
    """Values and gradients of the transcoder step (main code, AuxK code, skip path) equal the reference kernels."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(37, 19, generator=g), torch.randn(37, 19, generator=g)
    dead = torch.zeros(53, dtype=torch.bool)
    dead[::4] = True
    outs = {}
    for name in ("reference", impl):
        m = _random_model(kind, name)
        out = KINDS[kind].train_forward(m, x, local_inputs(y, dead=dead, k_aux=6))
        aux_hat = out.aux.values.unsqueeze(-1).mul(m.W_dec[out.aux.indices]).sum(1)
        loss = (y - out.x_hat).pow(2).sum() + (y - out.x_hat - aux_hat).pow(2).sum()
        loss.backward()
        outs[name] = [out.x_hat.detach(), out.fired, out.l0] + [p.grad for p in m.parameters()]
    for a, b in zip(outs[impl], outs["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_the_step_encodes_the_input_and_reconstructs_the_output():
    m = _random_model("skip-transcoder", "reference")
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 19, generator=g), torch.randn(8, 19, generator=g)
    out = KINDS["skip-transcoder"].train_forward(m, x, local_inputs(y))
    pre = torch.relu(x @ m.W_enc + m.b_enc)  # uncentred: b_dec is the output's bias
    top = pre.topk(5, dim=1)
    f = torch.zeros_like(pre).scatter_(1, top.indices, top.values)
    torch.testing.assert_close(out.x_hat, f @ m.W_dec + m.b_dec + x @ m.W_skip)
    torch.testing.assert_close(m(x), out.x_hat.detach())
    assert m.split(torch.cat([x, y], 1))[1].equal(y)


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
def test_folding_the_scales_keeps_the_prediction(kind):
    """Trained on (c_in x, c_out y), the folded model maps raw x to raw y: prediction / c_out, same codes."""
    m = _random_model(kind, "reference")
    x = torch.randn(10, 19, generator=torch.Generator().manual_seed(3))
    c_in, c_out = 3.0, 0.25
    before_f, before = m.encode(x * c_in), m(x * c_in)
    m.fold_input_scale(torch.tensor([c_in, c_out]))
    torch.testing.assert_close(m.encode(x), before_f)
    torch.testing.assert_close(m(x), before / c_out, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_a_transcoder_needs_input_and_output_pairs():
    with pytest.raises(ValueError, match="needs two hookpoints, the component's input then its output"):
        train(_cfg(), [b[:, 0] for b in pair_batches()])


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
def test_resume_gives_bit_identical_weights(tmp_path, kind):
    cfg = _cfg(kind=kind)
    full = train(cfg, pair_batches, out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(pair_batches, 10), out=tmp_path / "cut")
    resumed = train(cfg, pair_batches, out=tmp_path / "cut", resume=True)
    assert set(full.state_dict()) >= ({"W_skip"} if kind == "skip-transcoder" else set())
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
def test_artifact_round_trip_and_fvu_against_the_output(tmp_path, kind):
    """Raw scales (input x40, output further x3): the saved transcoder predicts raw outputs; FVU is the output's."""
    batches = list(pair_batches(scale=40.0))
    model = train(_cfg(kind=kind, latents=48, k=4), batches, out=tmp_path,
                  meta={"hookpoints": ["blocks.0.mlp.hook_in", "blocks.0.mlp.hook_out"]})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["input_hookpoint"], cfg["output_hookpoint"]) == ("blocks.0.mlp.hook_in", "blocks.0.mlp.hook_out")
    loaded = load_dictionary(tmp_path)
    for name, t in model.state_dict().items():  # norm_scale is saved only by the row-relative kinds
        assert name == "norm_scale" or torch.equal(loaded.state_dict()[name], t), name
    result = evaluate(loaded, batches[:2])
    assert result.fvu == pytest.approx(cfg["training"]["heldout_eval"]["fvu"], rel=1e-6) and result.fvu < 0.8
    x, y = torch.cat(batches[:2])[:, 0], torch.cat(batches[:2])[:, 1]
    err = (loaded(x).detach() - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()
    assert float(err) == pytest.approx(result.fvu, rel=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
def test_sparsify_export_holds_transcoders_and_other_layouts_refuse(tmp_path, kind):
    m = _random_model(kind, "reference")
    config = {"hookpoints": ["blocks.0.mlp.hook_in", "blocks.0.mlp.hook_out"], "input_hookpoint":
              "blocks.0.mlp.hook_in", "output_hookpoint": "blocks.0.mlp.hook_out"}
    where = export_dictionary(m, config, "sparsify", tmp_path / "sp", model_name="tiny")
    cfg = json.loads((where / "cfg.json").read_text())
    assert cfg["transcode"] is True and cfg["skip_connection"] is (kind == "skip-transcoder")
    back = open_dictionary(where)
    assert back.model.kind == kind and back.config["hookpoints"] == config["hookpoints"]
    for name, t in m.state_dict().items():
        assert torch.equal(back.model.state_dict()[name], t), name
    for fmt in ("saelens", "dictionary-learning"):
        with pytest.raises(ValueError, match=f"has no {fmt} layout here; export it with --format sparsify"):
            export_dictionary(m, config, fmt, tmp_path / fmt)


@pytest.mark.integration
def test_cli_trains_and_evaluates_a_transcoder_beside_an_sae(tmp_path, tiny_lm_dir, capsys):
    """`conceptdict train --kind transcoder --hookpoint IN --hookpoint OUT` on the tiny LM's MLP, then `eval
    --model`: FVU against the MLP output, spliced KL with the output replaced by transcoder(input); the same
    numbers as training's held-out evaluation."""
    from fixtures_models import build_tiny_lm_store

    from conceptdict.cli.main import main

    mlp = ["blocks.0.mlp.hook_in", "blocks.0.mlp.hook_out"]
    store = build_tiny_lm_store(tmp_path / "store", tiny_lm_dir, n_docs=60, hookpoints=mlp)
    fast = ["--batch-size", "64", "--eval-batches", "2", "--log-every", "50", "--latents", "64", "--k", "4",
            "--kernel-impl", "reference", "--store", str(store)]
    runs = {"transcoder": mlp, "skip-transcoder": mlp, "topk": mlp[1:]}
    for kind, hps in runs.items():
        out = tmp_path / kind
        assert main(["train", "--kind", kind, "--out", str(out), *fast,
                     *[a for h in hps for a in ("--hookpoint", h)]]) == 0
        assert main(["eval", str(out), "--model", str(tiny_lm_dir), "--contexts", "4"]) == 0
        record = json.loads((out / "eval.json").read_text())
        held = json.loads((out / "config.json").read_text())["training"]["heldout_eval"]
        assert record["hookpoints"] == hps
        assert record["metrics"]["fvu"] == pytest.approx(held["fvu"], rel=1e-6)
        assert record["metrics"]["kl_score"] is not None and record["metrics"]["splice"]["kl_replaced"] >= 0
    assert "blocks.0.mlp.hook_in -> blocks.0.mlp.hook_out" in capsys.readouterr().out
    with pytest.raises(ValueError, match="drop --hookpoint"):
        main(["eval", str(tmp_path / "transcoder"), "--hookpoint", mlp[0], "--debug"])
