"""Cross-layer transcoders (kind ``clt``): shapes, the causal decoder mask, the sparse step against a dense reference,
training through the one loop, exact resume, the artifact round trip."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from conceptdict.saes import KINDS, SparseCoder, evaluate, load_dictionary, train, train_config
from conceptdict.saes.comm import local_inputs
from conceptdict.saes.update import make_optimizer
from generators.synthetic import SyntheticSpec, synthetic_batch
from crashing import Crash, crashing

S, D = 3, 12
SPEC = SyntheticSpec(n_atoms=48, d=D, active=3, batch_size=64, n_batches=16, seed=5)
IMPLS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                                   reason="no numba"))]


def _maps():
    g = torch.Generator().manual_seed(21)
    return {(l, m): (torch.randn(D, 24, generator=g), torch.randn(24, D, generator=g) * 0.5)
            for m in range(S) for l in range(m + 1)}


MAPS = _maps()


def layer_batches(start: int = 0, n: int = SPEC.n_batches, scale: float = 1.0):
    """[B, 2S, D]: S layers' MLP inputs then outputs, where layer m's output sums sparse nonlinear maps of the inputs of
    layers l <= m (what a CLT represents and a per-layer transcoder cannot); deterministic per batch (seekable)."""
    for i in range(start, n):
        xs = [synthetic_batch(SPEC, i * S + l) * scale for l in range(S)]
        ys = [sum(torch.relu(xs[l] @ MAPS[l, m][0] - 1.5) @ MAPS[l, m][1] for l in range(m + 1)) for m in range(S)]
        yield torch.stack(xs + ys, dim=1)


def _cfg(**kw):
    base = dict(latents=3 * 32, k=3, kind="clt", eval_batches=2, log_every=2, checkpoint_every=3, device="cpu",
                init_rows=64, kernel_impl="reference")
    return train_config(**(base | kw))


KINDS_HERE = ("clt", "clt-batchtopk")


def _random_model(impl: str, masked: bool = True, kind: str = "clt") -> SparseCoder:
    g = torch.Generator().manual_seed(0)
    m = SparseCoder(D, S * 16, 4, kind, n_sources=S, kernel_impl=impl)
    m.reset_parameters(generator=g)
    assert not m.W_dec.any()  # a transcoder's decoder starts at zero
    with torch.no_grad():
        w = torch.randn(S * 16, S * D, generator=g)
        m.assign_decoder(w * m.decoder_mask() if masked else w)
        m.b_enc.copy_(torch.randn(S * 16, generator=g) * 0.1)
        m.b_dec.copy_(torch.randn(S * D, generator=g))
    return m


@pytest.mark.unit
def test_shapes_and_the_mask():
    m = _random_model("reference")
    assert tuple(m.W_enc.shape) == (D, S * 16) and tuple(m.W_dec.shape) == (S * 16, S * D)
    assert m.data_sources == 2 * S
    mask = m.decoder_mask()
    assert mask.sum() == 16 * D * (S + (S - 1) + 1)  # layer l's 16 latents reach S - l layers
    assert mask[0].all() and not mask[-1, : (S - 1) * D].any() and mask[-1, (S - 1) * D:].all()
    with torch.no_grad():
        m.b_enc.fill_(10.0)  # every pre-activation positive: TopK keeps exactly k of each layer's latents
    assert m.encode(torch.randn(5, S, D)).view(5, S, 16).ne(0).sum(2).eq(4).all()
    with pytest.raises(ValueError, match="not a multiple"):
        SparseCoder(D, 50, 4, "clt", n_sources=S)
    with pytest.raises(ValueError, match="per layer"):
        SparseCoder(D, S * 4, 4, "clt", n_sources=S)


@pytest.mark.unit
def test_the_decoder_is_held_as_its_triangle():
    """A CLT holds (and Adam steps) only its decoder's triangle: layer l's block [P, (S - l) D], P D S (S + 1) / 2
    floats in all, not the L S D of the whole matrix; ``W_dec``, ``state_dict`` and loading keep the whole
    [L, S*D] layout (zeros below), and a state loads back into the same blocks."""
    m = _random_model("reference")
    P = 16
    blocks = [p for name, p in m.named_parameters() if name.startswith("W_dec")]
    assert [tuple(b.shape) for b in blocks] == [(P, (S - l) * D) for l in range(S)]
    assert sum(b.numel() for b in blocks) == P * D * S * (S + 1) // 2 < m.n_latents * S * D
    opt = make_optimizer(m, lr=1e-3)
    for q in opt.params:
        q.grad = torch.ones_like(q)
    opt.step()
    held = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert held == 2 * sum(p.numel() for p in m.parameters())
    state = m.state_dict()
    assert tuple(state["W_dec"].shape) == (S * P, S * D) and not any(k.startswith("W_dec_") for k in state)
    assert state["W_dec"].equal(m.W_dec) and not m.W_dec.masked_select(~m.decoder_mask()).any()
    other = SparseCoder(D, S * P, 4, "clt", n_sources=S)
    other.load_state_dict(state)
    assert all(a.equal(b) for a, b in zip(blocks, [p for n, p in other.named_parameters() if n.startswith("W_dec")]))
    with pytest.raises(ValueError, match="W_dec has shape"):
        other.load_state_dict({**state, "W_dec": state["W_dec"][:, :D]})
    with torch.no_grad(), pytest.raises(RuntimeError, match="assign_decoder"):  # a write into the copy is refused
        other.W_dec.add_(1.0)


@pytest.mark.unit
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_layer_m_ignores_the_layers_after_it(impl):
    """Changing the inputs of layers > m leaves layer m's reconstruction as it was, in training and inference, even
    when the decoder is given entries from later layers' latents to layer m (only its triangle is held)."""
    m = _random_model(impl, masked=False)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, S * D, generator=g)
    for layer in range(S - 1):
        x2 = x.clone()
        x2[:, (layer + 1) * D:] += torch.randn(9, (S - layer - 1) * D, generator=g)
        keep = slice(0, (layer + 1) * D)
        for run in (lambda z: KINDS["clt"].train_forward(m, z, local_inputs(z)).x_hat,):
            a, b = run(x), run(x2)
            torch.testing.assert_close(a[:, keep], b[:, keep])
            assert not torch.allclose(a[:, keep.stop:], b[:, keep.stop:])
    m = _random_model(impl)
    for layer in range(S - 1):
        x2 = x.clone()
        x2[:, (layer + 1) * D:] += 1.0
        keep = slice(0, (layer + 1) * D)
        torch.testing.assert_close(m(x.view(9, S, D)).reshape(9, -1)[:, keep], m(x2.view(9, S, D)).reshape(9, -1)[:, keep])


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_the_sparse_step_equals_the_dense_reference(impl, kind):
    """x_hat and every gradient (main code and AuxK code) of the clt step equal a dense computation: per layer TopK per
    row (clt) or the top k*B entries of the batch (clt-batchtopk) of relu(x_l W_enc^l + b_enc^l), then
    codes @ (W_dec * mask) + b_dec; clt-batchtopk's threshold estimate is each layer's smallest kept value."""
    g = torch.Generator().manual_seed(1)
    B = 37
    x, y = torch.randn(B, S * D, generator=g), torch.randn(B, S * D, generator=g)
    dead = torch.zeros(S * 16, dtype=torch.bool)
    dead[::3] = True
    m = _random_model(impl, kind=kind)
    out = KINDS[kind].train_forward(m, x, local_inputs(y, dead=dead, k_aux=2))
    aux_hat = out.aux.values.unsqueeze(-1).mul(m.W_dec[out.aux.indices]).sum(1)
    ((y - out.x_hat).pow(2).sum() + (y - out.x_hat.detach() - aux_hat).pow(2).sum()).backward()
    got = [out.x_hat.detach()] + [p.grad.clone() for p in m.parameters()]

    ref = _random_model("reference", kind=kind)
    W_enc, b_enc = ref.W_enc, ref.b_enc
    codes, aux_codes, smallest = [], [], []
    for l in range(S):
        lat = slice(l * 16, (l + 1) * 16)
        pre = torch.relu(x[:, l * D:(l + 1) * D] @ W_enc[:, lat] + b_enc[lat])
        if kind == "clt":
            top = pre.topk(4, dim=1)
            codes.append(torch.zeros_like(pre).scatter(1, top.indices, top.values))
        else:
            top = pre.flatten().topk(4 * B)
            codes.append(torch.zeros_like(pre).flatten().scatter(0, top.indices, top.values).view_as(pre))
            smallest.append(top.values.min().detach())
        dead_pre = pre.masked_fill(~dead[lat], 0)
        top = dead_pre.topk(2, dim=1)
        aux_codes.append(torch.zeros_like(pre).scatter(1, top.indices, top.values))
    W = ref.W_dec * ref.decoder_mask()
    x_hat = torch.cat(codes, 1) @ W + ref.b_dec
    aux_hat = torch.cat(aux_codes, 1) @ W
    ((y - x_hat).pow(2).sum() + (y - x_hat.detach() - aux_hat).pow(2).sum()).backward()
    want = [x_hat.detach()] + [p.grad for p in ref.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    dense = torch.cat(codes, 1)
    assert float(out.l0) == pytest.approx(float(dense.ne(0).sum(1).float().mean()))
    assert out.fired.equal(dense.ne(0).any(0))
    if kind == "clt-batchtopk":
        torch.testing.assert_close(out.smallest, torch.stack(smallest).repeat_interleave(16))
    else:
        assert out.smallest is None


@pytest.mark.unit
def test_clt_batchtopk_calibrates_one_threshold_per_layer(tmp_path):
    """BatchTopK per layer trained, then JumpReLU inference with each layer's threshold calibrated on unseen rows:
    the thresholds differ by layer and each layer's mean L0 on the calibration rows is k."""
    batches = list(layer_batches(scale=30.0))
    model = train(_cfg(kind="clt-batchtopk", calibration_batches=2, threshold_start_step=2), batches, out=tmp_path)
    info = model.training_summary["threshold"]
    assert len(info["per_layer"]) == S and len(set(info["per_layer"])) == S and info["calibrated_on_rows"] == 128
    P = model.n_latents // S
    assert model.threshold.view(S, P).eq(torch.tensor(info["per_layer"])[:, None]).all()
    calibration = torch.cat(batches[2:4])  # the batches after the held-out ones
    f = model.encode(calibration[:, :S]).view(len(calibration), S, P)
    assert f.ne(0).sum(2).float().mean(0).tolist() == pytest.approx([model.k] * S, abs=0.05)
    loaded = load_dictionary(tmp_path)
    assert loaded.threshold.equal(model.threshold)


@pytest.mark.unit
def test_training_lowers_fvu_and_keeps_the_mask(tmp_path):
    """Through the one loop (AuxK on: every latent starts dead): held-out FVU well below the b_dec-only 1, each layer's
    FVU below 1, and the decoder entries to earlier layers still exactly zero after the AuxK steps touched them."""
    batches = list(layer_batches(n=40, scale=30.0))
    model = train(_cfg(dead_tokens=64), batches, out=tmp_path,
                  meta={"hookpoints": [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(S)]})
    held = json.loads((tmp_path / "config.json").read_text())["training"]["heldout_eval"]
    assert held["fvu"] < 0.7 and len(held["per_source_fvu"]) == S and max(held["per_source_fvu"]) < 0.8
    assert not model.W_dec.masked_select(~model.decoder_mask()).any()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["fvu"] < metrics[0]["fvu"] and max(m["aux"] for m in metrics) > 0


@pytest.mark.unit
def test_artifact_round_trip_in_raw_units(tmp_path):
    """Trained on raw scales (inputs x30), saved and loaded: the same tensors, and the loaded CLT maps raw inputs to
    raw outputs with the held-out FVU training recorded."""
    batches = list(layer_batches(scale=30.0))
    model = train(_cfg(), batches, out=tmp_path)
    loaded = load_dictionary(tmp_path)
    assert loaded.kind == "clt" and loaded.n_sources == S and loaded.n_latents == 3 * 32
    for name, t in model.state_dict().items():  # norm_scale is saved only by the row-relative kinds
        assert name == "norm_scale" or torch.equal(loaded.state_dict()[name], t), name
    result = evaluate(loaded, batches[:2])
    held = json.loads((tmp_path / "config.json").read_text())["training"]["heldout_eval"]
    assert result.fvu == pytest.approx(held["fvu"], rel=1e-6)
    rows = torch.cat(batches[:2])
    y = rows[:, S:].reshape(len(rows), -1)
    err = (loaded(rows[:, :S]).detach().reshape(len(rows), -1) - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()
    assert float(err) == pytest.approx(result.fvu, rel=1e-4)


@pytest.mark.unit
def test_loading_refuses_decoder_entries_to_earlier_layers(tmp_path):
    from safetensors.torch import load_file, save_file

    train(_cfg(), list(layer_batches()), out=tmp_path)
    t = load_file(tmp_path / "weights.safetensors")
    t["W_dec"][0, -1, 0] = 1.0  # target layer 0 from a latent of the last layer
    save_file(t, tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match="to a layer before its own"):
        load_dictionary(tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("kind", KINDS_HERE)
def test_resume_gives_bit_identical_weights(tmp_path, kind):
    cfg = _cfg(kind=kind, dead_tokens=64)
    full = train(cfg, layer_batches, out=tmp_path / "full")
    with pytest.raises(Crash):
        train(cfg, crashing(layer_batches, 10), out=tmp_path / "cut")
    resumed = train(cfg, layer_batches, out=tmp_path / "cut", resume=True)
    for name, t in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name


@pytest.mark.unit
def test_a_clt_needs_inputs_and_outputs():
    with pytest.raises(ValueError, match="needs each layer's MLP input and output"):
        train(_cfg(), [b[:, :3] for b in layer_batches()])


def kl_bound(max_logit_diff: float) -> float:
    """What KL(clean || spliced) can be when no logit moved by more than ``max_logit_diff``: at most
    max|d|^2 / 2 (Hoeffding's lemma: log E_p[e^d] - E_p[d] <= (max d - min d)^2 / 8), plus float64's rounding of the
    sums over the vocabulary (the KL is computed in float64, ``activations.losses.next_token_kl``)."""
    return max_logit_diff**2 / 2 + 1e-12


MLP = [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(2)]  # the tiny LM's 2 MLPs: inputs, outputs


@pytest.fixture(scope="module")
def mlp_store(tmp_path_factory, tiny_lm_dir):
    """The tiny LM's token-level store at MLP (both MLPs' inputs and outputs) over 60 documents: what the four
    tests on the tiny LM below train on. Read-only for its users."""
    from fixtures_models import build_tiny_lm_store

    return build_tiny_lm_store(tmp_path_factory.mktemp("mlp_store") / "store", tiny_lm_dir, n_docs=60, hookpoints=MLP)


@pytest.mark.integration
def test_replacement_model_on_a_tiny_lm(tmp_path, tiny_lm_dir, mlp_store, monkeypatch):
    """`train --kind clt` on both MLPs of the 2-layer tiny LM, then `eval --model`: every MLP replaced at once. With the
    error nodes kept the spliced model gives the clean logits (to float tolerance: the splice reads each layer's input
    and writes its output where the clean model does); without them, CE loss recovered and KL score of the
    replacement model; per-layer FVU / L0 / dead. Read lazily (CONCEPTDICT_LAZY=1, as a CLT too large for memory
    is) the same evaluation gives the same spliced losses."""
    import conceptdict as cd
    from conceptdict.cli.main import main

    store = mlp_store
    out = tmp_path / "clt"
    assert main(["train", "--kind", "clt", "--out", str(out), "--store", str(store), "--batch-size", "64",
                 "--eval-batches", "2", "--log-every", "50", "--latents", "128", "--k", "4", "--kernel-impl",
                 "reference", *[a for h in MLP for a in ("--hookpoint", h)]]) == 0
    ev = cd.evaluate(out, model=str(tiny_lm_dir), contexts=4)
    m, sp = ev.metrics, ev.metrics.splice
    assert ev.hookpoints == MLP and len(m.per_source_fvu) == 2 and len(m.per_layer_l0) == 2
    assert m.per_layer_l0 == pytest.approx((4.0, 4.0)) and len(m.per_layer_dead) == 2
    assert sp["max_logit_diff_with_errors"] < 1e-4 and sp["ce_with_errors"] == pytest.approx(sp["ce_clean"], abs=1e-5)
    assert sp["kl_with_errors"] <= kl_bound(sp["max_logit_diff_with_errors"]) < sp["kl_replaced"]
    assert sp["ce_zero"] != sp["ce_clean"] and m.ce_loss_recovered is not None and m.kl_score is not None
    record = json.loads((out / "eval.json").read_text())
    assert record["metrics"]["splice"]["max_logit_diff_with_errors"] == sp["max_logit_diff_with_errors"]
    assert "replacement with error nodes" in ev.format() and "layer 1" in ev.format()
    from conceptdict.saes.lazy import LAZY_ENV
    from conceptdict.saes.lazy_clt import LazyCLT

    monkeypatch.setenv(LAZY_ENV, "1")
    lazy = cd.evaluate(out, model=str(tiny_lm_dir), contexts=4, out=tmp_path / "lazy_eval.json")
    assert isinstance(lazy.dictionary, LazyCLT)
    assert lazy.metrics.splice == pytest.approx(sp, rel=1e-5, abs=1e-7)
    assert lazy.metrics.kl_score == pytest.approx(m.kl_score, rel=1e-5)


@pytest.mark.equivalence
@pytest.mark.integration
def test_layers_all_trains_one_transcoder_per_mlp_in_one_run(tmp_path, tiny_lm_dir, mlp_store):
    """`train --kind transcoder --layers all`: OUT/0 and OUT/1, each reading its own layer's MLP input and output, each
    equal to the transcoder trained alone on that pair (one read of the store for both); `--layers all` with a clt is
    one dictionary over both layers; other kinds are refused."""
    import conceptdict as cd

    store = mlp_store
    fast = dict(store=store, latents=32, k=4, batch_size=64, eval_batches=2, log_every=50, kernel_impl="reference")
    both = cd.train(kind="transcoder", layers="all", out=tmp_path / "plt", **fast)
    assert sorted(both) == ["0", "1"]
    for layer in (0, 1):
        pair = [f"blocks.{layer}.mlp.hook_in", f"blocks.{layer}.mlp.hook_out"]
        config = json.loads((tmp_path / "plt" / str(layer) / "config.json").read_text())
        assert config["hookpoints"] == pair and config["heldout"]["hookpoints"] == pair
        alone = cd.train(kind="transcoder", hookpoint=pair, out=tmp_path / f"alone{layer}", **fast)
        for name, t in alone.state_dict().items():
            assert torch.equal(both[str(layer)].state_dict()[name], t), (layer, name)
    ev = cd.evaluate(tmp_path / "plt", model=str(tiny_lm_dir), contexts=4)  # the set: both MLPs replaced at once
    m, sp = ev.metrics, ev.metrics.splice
    held = [json.loads((tmp_path / "plt" / str(layer) / "config.json").read_text())["training"]["heldout_eval"]
            for layer in (0, 1)]
    assert m.kind == "transcoder x 2 layers" and ev.hookpoints == MLP
    assert m.per_source_fvu == pytest.approx([h["fvu"] for h in held], rel=1e-6)
    assert m.per_layer_l0 == pytest.approx([h["l0"] for h in held]) and m.l0 == pytest.approx(sum(m.per_layer_l0))
    assert min(h["fvu"] for h in held) <= m.fvu <= max(h["fvu"] for h in held)
    assert sp["max_logit_diff_with_errors"] < 1e-4 and sp["kl_with_errors"] <= kl_bound(sp["max_logit_diff_with_errors"])
    assert sp["kl_with_errors"] < sp["kl_replaced"]
    assert (tmp_path / "plt" / "eval.json").exists()
    clt = cd.train(kind="clt", layers=["0", "1"], out=tmp_path / "clt", **(fast | {"latents": 64}))
    assert clt.n_sources == 2 and clt.config["hookpoints"] == MLP
    with pytest.raises(ValueError, match="--layers trains a transcoder per MLP"):
        cd.train(kind="topk", layers="all", out=tmp_path / "topk", **fast)
    with pytest.raises(ValueError, match=r"lacks the MLP input/output of layer\(s\) \[5\]"):
        cd.train(kind="transcoder", layers=["5"], out=tmp_path / "five", **fast)


@pytest.mark.integration
def test_compare_puts_plts_skip_plts_and_a_clt_side_by_side(tmp_path, tiny_lm_dir, mlp_store):
    """`compare` of a PLT set, a skip-PLT set (train --layers folders) and a CLT of the same total latents and L0: each
    a row whose numbers (replacement CE / KL with every MLP replaced at once, per-layer FVU / L0 / dead) equal
    `eval --model`'s of that replacement; the two sets' latents are matched layer by layer (a CLT's decoder spans
    every layer: matched with neither); a 2-layer CLT gets no crosscoder diff tags."""
    import conceptdict as cd

    store = mlp_store
    fast = dict(store=store, latents=32, k=4, batch_size=64, eval_batches=2, log_every=50, kernel_impl="reference")
    cd.train(kind="transcoder", layers="all", out=tmp_path / "plt", **fast)
    cd.train(kind="skip-transcoder", layers="all", out=tmp_path / "skip", **fast)
    cd.train(kind="clt", layers="all", out=tmp_path / "clt", **(fast | {"latents": 64}))
    names = ("plt", "skip", "clt")
    got = cd.compare([tmp_path / n for n in names], store=store, model=str(tiny_lm_dir), contexts=4,
                     out=tmp_path / "cmp")
    rows = {r["name"]: r for r in got.result["dictionaries"]}
    assert [rows[n]["kind"] for n in names] == ["transcoder x 2 layers", "skip-transcoder x 2 layers", "clt"]
    assert {(rows[n]["n_latents"], rows[n]["k"]) for n in names} == {(64, 4)}
    for n in names:
        alone = cd.evaluate(tmp_path / n, model=str(tiny_lm_dir), contexts=4, out=tmp_path / f"{n}.json").metrics
        m = rows[n]["metrics"]
        assert m["per_source_fvu"] == pytest.approx(list(alone.per_source_fvu), rel=1e-6) and len(m["per_source_fvu"]) == 2
        assert m["per_layer_l0"] == pytest.approx(list(alone.per_layer_l0)) and m["l0"] == pytest.approx(alone.l0)
        assert m["per_layer_dead"] == pytest.approx(list(alone.per_layer_dead)) and m["fvu"] == pytest.approx(alone.fvu)
        assert m["ce_loss_recovered"] == pytest.approx(alone.ce_loss_recovered, abs=1e-6)
        assert m["kl_score"] == pytest.approx(alone.kl_score, abs=1e-6)
        assert m["splice"]["max_logit_diff_with_errors"] < 1e-4 and "latent_tags" not in rows[n]
    assert set(got.result["matches"]["plt"]) == {"skip"} and 0.0 <= got.result["matches"]["plt"]["skip"] <= 1.0
    assert rows["plt"]["unique_latents"] is not None and rows["clt"]["unique_latents"] is None  # layer by layer
    assert 0.0 <= rows["skip"]["weights"]["split_fraction"] <= 1.0
    text = got.format()
    assert "plt: per layer 0: FVU" in text and "clt: per layer 0: FVU" in text
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["dictionaries"][1]["metrics"]["per_layer_l0"]
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "<h2>Per layer</h2>" in page and "<tr><td>skip</td><td>1</td>" in page and "<td>clt</td><td>1</td>" in page


@pytest.mark.integration
def test_naming_a_clt_reads_every_layers_input_and_shows_decoder_norms_per_layer(tmp_path, tiny_lm_dir, mlp_store):
    """`name` and `score` on a 2-layer clt: each feature's evidence is its code from both layers' MLP inputs (the top example's
    activation is the clt's code on that row), the logit lens reads its decoder to the last layer's MLP output, and
    concepts.json, the text card and the HTML report carry its layer and decoder norm per target layer (a 2-layer clt
    gets no crosscoder diff tags); `score` draws negatives where the feature is silent; a PLT layer names from its own
    input with the logit lens of its decoder."""
    import conceptdict as cd
    from conceptdict.activations import ActivationStore, load_model
    from conceptdict.naming.evidence import logit_lens
    from conceptdict.naming.reports.report_text import format_concept

    store = mlp_store
    clt = cd.train(kind="clt", layers="all", out=tmp_path / "clt", store=store, latents=16, k=2, batch_size=64,
                   eval_batches=2, log_every=50, kernel_impl="reference")
    named = cd.name(tmp_path / "clt", namer="logit-lens", model=str(tiny_lm_dir), top_k=3, logit_tokens=3,
                    out=tmp_path / "names")
    norms = clt.decoder_norms().detach()  # [target layer, L]
    assert len(named.concepts) == 16 and named.directions.shape == (16, 2, clt.d_in)
    rows = ActivationStore(store)
    firing = 0
    for c in named.concepts:
        assert c.extra["layer"] == c.id // 8 and "relative_norm" not in c.extra
        assert c.extra["decoder_norms"] == pytest.approx(norms[:, c.id].tolist(), abs=1e-4)
        assert c.extra["decoder_norms"][0] == 0.0 or c.id < 8  # layer 1's features write nothing to layer 0
        if c.top_examples:
            firing += 1
            row = c.top_examples[0].row
            x = torch.stack([rows.rows(h, row, row + 1).float() for h in MLP[:2]], dim=1)
            assert float(clt.encode(x)[0, c.id]) == pytest.approx(c.top_examples[0].activation, rel=1e-4)
    assert firing >= 8
    lm = load_model(str(tiny_lm_dir))
    lens = logit_lens(named.directions[:, 1], lm.unembed().cpu(), k=3)
    assert [c.logit_top for c in named.concepts] == [tuple(lm.decode(ids)) for ids in lens.top_ids.tolist()]
    assert "decoder norm per layer: 0: " in format_concept(named.concepts[0])
    saved = json.loads((tmp_path / "names" / "concepts.json").read_text())["concepts"]
    assert saved[9]["extra"]["decoder_norms"][0] == 0.0 and len(saved[9]["extra"]["decoder_norms"]) == 2
    assert "decoder norm per layer: 0: " in "".join(p.read_text() for p in (tmp_path / "names" / "report").glob("*.html"))
    from conceptdict.naming.scoring import SCORERS, register_scorer

    seen = {}

    def record(ctx, names):  # score: every negative drawn from rows where the clt's feature is silent
        seen.update(ctx.samples)
        return {j: {"score": 1.0} for j in names}

    register_scorer("clt-negatives", record)
    try:
        cd.score(tmp_path / "names", scorer=["clt-negatives"])
    finally:
        del SCORERS["clt-negatives"]
    negatives = [(j, e.row) for j, sample in seen.items() for e in sample.negatives]
    assert len(seen) >= 8 and negatives
    for j, row in negatives:
        x = torch.stack([rows.rows(h, row, row + 1).float() for h in MLP[:2]], dim=1)
        assert float(clt.encode(x)[0, j]) == 0.0
    plt = cd.train(kind="transcoder", layers="all", out=tmp_path / "plt", store=store, latents=8, k=2, batch_size=64,
                   eval_batches=2, log_every=50, kernel_impl="reference")["1"]  # a PLT: one layer folder at a time
    layer = cd.name(tmp_path / "plt" / "1", namer="logit-lens", model=str(tiny_lm_dir), top_k=3, logit_tokens=3)
    lens = logit_lens(plt.decoder_directions().float(), lm.unembed().cpu(), k=3)
    assert [c.logit_top for c in layer.concepts] == [tuple(lm.decode(ids)) for ids in lens.top_ids.tolist()]
    for c in layer.concepts:
        if c.top_examples:
            x = rows.rows("blocks.1.mlp.hook_in", c.top_examples[0].row, c.top_examples[0].row + 1).float()
            assert float(plt.encode(x)[0, c.id]) == pytest.approx(c.top_examples[0].activation, rel=1e-4)


def _named(kind: str, tmp, **kw):
    """A 3-layer dictionary trained on layer_batches, recorded at blocks.L.mlp.hook_in / hook_out."""
    return train(_cfg(kind=kind, calibration_batches=2, threshold_start_step=2, **kw) if kind == "clt-batchtopk"
                 else _cfg(kind=kind, **kw), list(layer_batches(scale=30.0)), out=tmp,
                 meta={"hookpoints": [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(S)]})


@pytest.mark.unit
def test_circuit_tracer_clt_round_trip_and_its_formulas(tmp_path):
    """export --format circuit-tracer of a clt-batchtopk: circuit-tracer's files (W_enc_l [P, D], W_dec_l [P, S-l, D],
    threshold_l) computed with circuit-tracer's formulas (JumpReLU x * (x > threshold) of x W_enc_l^T + b_enc_l; layer
    m's output sum_{l<=m} f_l W_dec_l[:, m-l] + b_dec_m) give our codes and reconstructions; reading the folder back
    gives the same dictionary."""
    import yaml
    from safetensors.torch import load_file

    import conceptdict as cd

    model = _named("clt-batchtopk", tmp_path / "clt")
    where = cd.export(tmp_path / "clt", format="circuit-tracer", out=tmp_path / "ct")
    config = yaml.safe_load((where / "config.yaml").read_text())
    assert config["model_kind"] == "cross_layer_transcoder"
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp.hook_in", "mlp.hook_out")
    rows = torch.cat(list(layer_batches(n=2, scale=30.0)))
    x = rows[:, :S]
    P = model.n_latents // S
    enc = [load_file(where / f"W_enc_{l}.safetensors") for l in range(S)]
    dec = [load_file(where / f"W_dec_{l}.safetensors")[f"W_dec_{l}"] for l in range(S)]
    assert [tuple(d.shape) for d in dec] == [(P, S - l, D) for l in range(S)]
    f = []
    for l in range(S):
        pre = x[:, l] @ enc[l][f"W_enc_{l}"].T + enc[l][f"b_enc_{l}"]
        f.append(pre * (pre > enc[l][f"threshold_{l}"]))
    torch.testing.assert_close(torch.cat(f, 1), model.encode(x).detach(), rtol=1e-5, atol=1e-5)
    recon = torch.stack([sum(f[l] @ dec[l][:, m - l] for l in range(m + 1)) + enc[m][f"b_dec_{m}"] for m in range(S)], 1)
    torch.testing.assert_close(recon, model(x).detach(), rtol=1e-4, atol=1e-3)
    back = cd.load(where)
    assert back.kind == "clt-batchtopk"
    for name, t in model.state_dict().items():
        if name != "norm_scale":
            torch.testing.assert_close(back.state_dict()[name], t, rtol=0, atol=0, msg=name)
    assert back.config["hookpoints"] == [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(S)]
    with pytest.raises(ValueError, match="train --kind clt-batchtopk"):
        cd.export(_named_dir(tmp_path), format="circuit-tracer", out=tmp_path / "ct2")


def _named_dir(tmp):
    _named("clt", tmp / "topk")
    return tmp / "topk"


@pytest.mark.unit
def test_circuit_tracer_transcoder_set_round_trip(tmp_path):
    """A set of per-layer transcoders (OUT/LAYER, as train --layers writes it) exported as circuit-tracer's
    transcoder_set: layer_l.safetensors each (W_enc [P, D], W_skip applied as x @ W_skip.T, k); each layer file reads
    back (cd.load DIR/layer_l.safetensors) as the same transcoder with its hookpoints; the folder alone is refused."""
    import yaml

    import conceptdict as cd

    batches = list(layer_batches(scale=30.0))
    models = []
    for l in range(S):
        pairs = [b[:, [l, S + l]] for b in batches]
        models.append(train(_cfg(kind="skip-transcoder", latents=32), pairs, out=tmp_path / "set" / str(l),
                            meta={"hookpoints": [f"blocks.{l}.mlp.hook_in", f"blocks.{l}.mlp.hook_out"]}))
    where = cd.export(tmp_path / "set", format="circuit-tracer", out=tmp_path / "ct")
    config = yaml.safe_load((where / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set" and config["activation"] == "topk" and config["k"] == 3
    for l, m in enumerate(models):
        back = cd.load(where / f"layer_{l}.safetensors")
        assert back.kind == "skip-transcoder" and back.config["hookpoints"] == [f"blocks.{l}.mlp.hook_in",
                                                                                 f"blocks.{l}.mlp.hook_out"]
        for name, t in m.state_dict().items():
            if name != "norm_scale":
                assert torch.equal(back.state_dict()[name], t), (l, name)
    with pytest.raises(Exception, match="transcoder set of 3 layers"):
        cd.load(where)


CT_FIXTURES = Path(__file__).parent / "fixtures" / "circuit_tracer"
CT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ct" / "bin" / "python"


@pytest.mark.unit
def test_reads_a_clt_written_by_circuit_tracer():
    """The fixture circuit-tracer wrote (tests/fixtures/circuit_tracer/make_fixtures.py): read by cd.load as a
    clt-batchtopk, its codes and reconstructions equal circuit-tracer's own on the same inputs."""
    from safetensors.torch import load_file

    import conceptdict as cd

    ref = load_file(CT_FIXTURES / "reference.safetensors")
    model = cd.load(CT_FIXTURES / "clt")
    assert model.kind == "clt-batchtopk" and model.n_sources == 3 and model.n_latents == 24
    assert model.config["hookpoints"] == [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(3)]
    x = ref["x"].transpose(0, 1)  # [layers, N, D] -> [N, layers, D]
    torch.testing.assert_close(model.encode(x), ref["codes"].transpose(0, 1).reshape(len(x), -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x), ref["recon"].transpose(0, 1), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_circuit_tracer_loads_our_exports(tmp_path):
    """In the side environment (.venv-ct, see the fixtures script), circuit-tracer's own loaders read our exports: a
    clt-batchtopk's features and reconstructions equal ours; a transcoder set's pre-activations and decodes (W_skip
    orientation included) equal ours (circuit-tracer 0.5's set loader applies ReLU/JumpReLU, not TopK)."""
    import subprocess

    from safetensors.torch import load_file, save_file

    import conceptdict as cd

    if not CT_PYTHON.exists():
        pytest.skip("no .venv-ct (see tests/fixtures/circuit_tracer/make_fixtures.py for how to make it)")
    clt = _named("clt-batchtopk", tmp_path / "clt")
    cd.export(tmp_path / "clt", format="circuit-tracer", out=tmp_path / "clt-ct")
    rows = torch.cat(list(layer_batches(n=1, scale=30.0)))[:, :S]  # [N, S, D]
    save_file({"x": rows.transpose(0, 1).contiguous()}, str(tmp_path / "x.safetensors"))

    def run(export):
        proc = subprocess.run([str(CT_PYTHON), str(CT_FIXTURES / "make_fixtures.py"), "--check", str(export),
                               str(tmp_path / "x.safetensors"), str(tmp_path / "got.safetensors")],
                              capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return load_file(tmp_path / "got.safetensors")

    got = run(tmp_path / "clt-ct")
    torch.testing.assert_close(got["codes"].transpose(0, 1).reshape(len(rows), -1), clt.encode(rows).detach(),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got["recon"].transpose(0, 1), clt(rows).detach(), rtol=1e-5, atol=1e-3)
    batches = list(layer_batches(scale=30.0))
    tcs = [train(_cfg(kind="skip-transcoder", latents=32), [b[:, [l, S + l]] for b in batches],
                 out=tmp_path / "set" / str(l), meta={"hookpoints": [f"blocks.{l}.mlp.hook_in",
                                                                     f"blocks.{l}.mlp.hook_out"]}) for l in range(S)]
    cd.export(tmp_path / "set", format="circuit-tracer", out=tmp_path / "set-ct")
    got = run(tmp_path / "set-ct")
    for l, tc in enumerate(tcs):
        x = rows[:, l]
        pre = x @ tc.W_enc + tc.b_enc
        torch.testing.assert_close(got[f"pre/{l}"], pre.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[f"decode/{l}"], tc.reconstruct(x, torch.relu(pre)).detach(), rtol=1e-5,
                                   atol=1e-3)


@pytest.mark.integration
def test_layers_all_from_a_models_forward(tmp_path, tiny_lm_dir):
    """`train --model M --layers all`: the model's MLP pairs found among its hookpoints, one forward per batch feeding
    a transcoder per layer (OUT/0, OUT/1, each recording its own pair), or one clt over both layers."""
    from fixtures_models import tiny_corpus

    from conceptdict.cli.main import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(120)))
    def common(latents: int) -> list[str]:
        return ["--model", str(tiny_lm_dir), "--dataset", str(docs), "--context-length", "32", "--forward-batch-size",
                "4", "--latents", str(latents), "--k", "4", "--batch-size", "32", "--tokens", str(32 * 12),
                "--eval-batches", "2", "--buffer-rows", "160", "--kernel-impl", "torch", "--layers", "all"]

    assert main(["train", "--kind", "transcoder", "--out", str(tmp_path / "plt"), *common(32)]) == 0
    for layer in (0, 1):
        config = json.loads((tmp_path / "plt" / str(layer) / "config.json").read_text())
        assert config["hookpoints"] == [f"blocks.{layer}.mlp.hook_in", f"blocks.{layer}.mlp.hook_out"]
        assert config["training"]["heldout_eval"]["fvu"] < 1.0
    assert main(["train", "--kind", "clt", "--out", str(tmp_path / "clt"), *common(64)]) == 0
    assert json.loads((tmp_path / "clt" / "config.json").read_text())["hookpoints"] == MLP


@pytest.mark.unit
def test_hub_names_read_circuit_tracer_layouts_from_the_cache_offline(tmp_path, monkeypatch):
    """`hf:` names of circuit-tracer's layouts, read from a local Hugging Face cache with the hub off: a CLT repo (its
    root, or a folder of it) and one layer of a transcoder set (`hf:REPO/layer_N.safetensors`, which needs the
    set's config.yaml beside it) load as the same dictionaries as the local folders."""
    from huggingface_hub import constants
    from test_foreign_formats import _fake_hub_cache

    from conceptdict.saes.formats import FormatError
    from conceptdict.saes.formats.circuit_tracer import write_set

    clt_dir = Path(__file__).parent / "fixtures" / "circuit_tracer" / "clt"
    g = torch.Generator().manual_seed(3)
    tcs = []
    for kind in ("transcoder", "skip-transcoder"):
        tc = SparseCoder(D, 16, 4, kind)
        tc.reset_parameters(generator=g)
        with torch.no_grad():
            tc.W_dec.copy_(torch.randn(16, D, generator=g))
        tcs.append(tc)
    set_dir = write_set(tcs, [[f"blocks.{l}.mlp.hook_in", f"blocks.{l}.mlp.hook_out"] for l in range(2)],
                        tmp_path / "set", None)
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "someone/tiny-clt", "d" * 40,
                    {**{f.name: f for f in clt_dir.iterdir()}, **{f"clt/{f.name}": f for f in clt_dir.iterdir()}})
    _fake_hub_cache(cache, "someone/tiny-plt", "e" * 40, {f.name: f for f in set_dir.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    local = load_dictionary(clt_dir)
    for name in ("hf:someone/tiny-clt", "hf:someone/tiny-clt/clt"):
        hub = load_dictionary(name)
        assert hub.kind == "clt-batchtopk" and hub.n_sources == local.n_sources
        for key, t in local.state_dict().items():
            assert torch.equal(hub.state_dict()[key], t), (name, key)
    layer = load_dictionary("hf:someone/tiny-plt/layer_1.safetensors")
    assert torch.equal(layer.W_dec, load_dictionary(set_dir / "layer_1.safetensors").W_dec) and layer.spec.skip
    with pytest.raises(FormatError, match="layer_7.safetensors"):
        load_dictionary("hf:someone/tiny-plt/layer_7.safetensors")
