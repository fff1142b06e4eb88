"""A dictionary behaves like a module (issue 51): encode / decode / sae(x) on any leading shape and float dtype, numpy
in and out, one-line errors, ``.cfg`` / ``.device`` / ``.dtype`` / ``.to``, and one-line reprs of a dictionary, a
store, a concept and a concept dictionary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import conceptdict as cd
from conceptdict.naming import Concept, ConceptDictionary, Example
from conceptdict.saes import SparseCoder, save_dictionary

pytestmark = pytest.mark.unit

KINDS = ["topk", "batchtopk", "relu", "jumprelu", "matryoshka", "spade", "transcoder"]


def _model(kind="topk", S=1, D=6, L=12, k=3):
    m = SparseCoder(D, L, k, kind, n_sources=S)
    m.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.b_enc.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        m.b_dec.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        m.assign_decoder(m.W_dec + 0.1)  # a transcoder's decoder starts at 0: give every kind a non-trivial one
        m.threshold.fill_(0.05)
    return m.requires_grad_(False)


@pytest.mark.parametrize("kind", [*KINDS, "crosscoder", "clt"])
def test_float32_rows_are_the_kind_rule_bit_for_bit(kind):
    """[B, D] float32 input: exactly the kind's inference rule on the rows (the numbers training and the golden files
    see), the decode and the reconstruction exactly their formulas."""
    S = 2 if kind in ("crosscoder", "clt") else 1
    m = _model(kind, S=S, L=12)
    x = torch.randn(9, 6) if S == 1 else torch.randn(9, S, 6)
    rows = x.reshape(9, -1)
    f = m.spec.encode(m, rows)
    assert torch.equal(m.encode(x), f)
    want = (f @ m.W_dec + m.b_dec).view(x.shape)
    if m.spec.layered:  # a CLT decodes block by block (its triangle): the same sum in another order
        torch.testing.assert_close(m.decode(f), want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(m.decode(f), want)
    assert torch.equal(m(x), m.reconstruct(rows, f).view(x.shape))


@pytest.mark.parametrize("kind", KINDS)
def test_any_leading_shape_is_the_rows_of_its_last_dimension(kind):
    m = _model(kind)
    x = torch.randn(2, 7, 6)
    f = m.encode(x)
    assert f.shape == (2, 7, 12) and torch.equal(f, m.encode(x.reshape(14, 6)).view(2, 7, 12))
    assert m.decode(f).shape == (2, 7, 6) and m(x).shape == (2, 7, 6)
    assert m.dense_activations(x).shape == (2, 7, 12)
    assert torch.equal(m.encode(x[0, 0]), m.encode(x[0, :1])[0])  # one vector [D] -> codes [L]
    assert m.encode(torch.randn(0, 6)).shape == (0, 12)


def test_a_crosscoder_reads_its_sources_in_the_second_to_last_dimension():
    m = _model("crosscoder", S=2)
    x = torch.randn(3, 5, 2, 6)
    f = m.encode(x)
    assert f.shape == (3, 5, 12) and torch.equal(f, m.encode(x.reshape(15, 2, 6)).view(3, 5, 12))
    assert m(x).shape == x.shape and m.decode(f).shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_is_computed_in_the_dictionarys_and_returned_in_its_own(dtype):
    m = _model("batchtopk")
    x = torch.randn(4, 3, 6).to(dtype)
    for fn in (m.encode, m, m.dense_activations):
        out = fn(x)
        assert out.dtype == dtype and torch.equal(out, fn(x.float()).to(dtype))
    f = m.encode(x)
    assert m.decode(f).dtype == dtype and torch.equal(m.decode(f), m.decode(f.float()).to(dtype))
    half = _model("batchtopk").to(torch.bfloat16)  # a bf16 dictionary computes in bf16, float32 in and out
    assert half.dtype == torch.bfloat16 and half.encode(x.float()).dtype == torch.float32


def test_numpy_in_numpy_out():
    m = _model()
    x = np.random.default_rng(0).standard_normal((2, 4, 6))
    f = m.encode(x)
    assert isinstance(f, np.ndarray) and f.dtype == np.float64 and f.shape == (2, 4, 12)
    np.testing.assert_array_equal(f, m.encode(torch.from_numpy(x)).numpy())
    assert isinstance(m.decode(f), np.ndarray) and m(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("call,value,message", [
    ("encode", torch.randn(2, 7, 5), "encode expects [..., 6] (d_in of this dictionary), got [2, 7, 5]"),
    ("encode", torch.ones(2, 6, dtype=torch.long),
     ("encode expects floating-point values [..., 6] (d_in of this dictionary), got int64 [2, 6]; convert it "
      "with .float()")),
    ("encode", np.ones((2, 6), dtype=np.int32),
     ("encode expects floating-point values [..., 6] (d_in of this dictionary), got int32 [2, 6]; convert it "
      "with .float()")),
    ("encode", [[0.0] * 6], "encode expects a tensor or numpy array [..., 6] (d_in of this dictionary), got list"),
    ("encode", torch.tensor(1.0), "encode expects [..., 6] (d_in of this dictionary), got []"),
    ("decode", torch.randn(3, 9), "decode expects [..., 12] (the latents of this dictionary), got [3, 9]"),
    ("__call__", torch.randn(3, 12), "sae(x) expects [..., 6] (d_in of this dictionary), got [3, 12]"),
])
def test_a_wrong_input_is_one_line_saying_what_was_expected_and_given(call, value, message):
    with pytest.raises((TypeError, ValueError)) as e:
        getattr(_model(), call)(value)
    assert str(e.value) == message


def test_a_crosscoders_error_names_its_sources():
    with pytest.raises(ValueError, match=r"^encode expects \[\.\.\., 2, 6\] \(2 sources x d_in 6 of this "
                                         r"dictionary\), got \[3, 12\]$"):
        _model("crosscoder", S=2).encode(torch.randn(3, 12))


def test_cfg_config_device_dtype_and_to(tmp_path):
    hookpoints = [f"blocks.{i}.hook_resid_post" for i in range(2)]
    save_dictionary(_model("crosscoder", S=2), tmp_path / "sae",
                    extra={"hookpoints": hookpoints, "stores": ["runs/a", "runs/b"], "level": "token",
                           "model": {"id": "gpt2", "loader": "transformer_lens"}})
    sae = cd.load(tmp_path / "sae")
    assert sae.config["hookpoints"] == hookpoints  # the config.json dict, as before
    c = sae.cfg
    assert (c.kind, c.d_in, c.latents, c.k, c.sources) == ("crosscoder", 6, 12, 3, 2)
    assert c.hookpoints == tuple(hookpoints) and c.stores == ("runs/a", "runs/b")
    assert (c.model, c.level) == ("gpt2", "token")
    assert json.loads(json.dumps(c.to_dict()))["hookpoints"] == hookpoints
    assert sae.device == torch.device("cpu") and sae.dtype == torch.float32
    assert sae.to(torch.float64) is sae and sae.dtype == torch.float64 and sae.W_enc.dtype == torch.float64
    x = torch.randn(4, 2, 6)
    assert sae.encode(x).dtype == torch.float32 and sae.cfg.latents == 12
    assert SparseCoder(4, 8, 2).cfg.hookpoints == ()  # built in Python: no config.json


def _concept(j: int, name: str) -> Concept:
    ex = Example(row=j, activation=1.0, tokens=tuple(f"tok{i}" for i in range(64)), marked=3, text="x " * 400)
    return Concept(j, name, 0.4123, runner_ups=tuple(f"r{i}" for i in range(20)), runner_up_scores=(0.1,) * 20,
                   namer="vocab", frequency=0.0125, stats={"max": 3.0, "mean": 0.1}, top_examples=(ex,) * 20,
                   quantile_examples=(ex,) * 10, scores={"embedding": {"auroc": 0.8, "score": 0.7}},
                   names={"vocab": {"name": name, "score": 0.41}}, confidence=0.66)


def test_reprs_are_one_short_line(planted_store):
    long_hooks = [f"blocks.{i}.attn.hook_z_with_a_rather_long_suffix" for i in range(30)]
    sae = _model()
    sae.config = {"hookpoints": long_hooks[:1]}
    assert repr(sae) == ("SparseCoder(topk, d_in=6, latents=12, k=3, "
                         "hookpoint='blocks.0.attn.hook_z_with_a_rather_lo...', float32, cpu)")
    crosscoder = _model("crosscoder", S=2)
    crosscoder.config = {"hookpoints": long_hooks}
    concept = _concept(7, "error handling " * 20)
    concepts = ConceptDictionary(tuple(_concept(j, f"name {j}") for j in range(300)), torch.randn(300, 384),
                                 {"sae_dir": "/very/long/path/" * 10 + "sae", "hookpoint": "h", "namer": "vocab"})
    store = cd.open_store(planted_store)
    wide = cd.open_store(planted_store)
    wide.path, wide.hookpoints = Path("/a/very/deep/folder" * 10) / "store", long_hooks  # as a 30-hookpoint store
    for obj in (sae, crosscoder, concept, concepts, store, wide):
        text = repr(obj)
        assert "\n" not in text and len(text) < 200, text
    assert repr(concept) == ("Concept(7, 'error handling error handling error handling error handli...', "
                             "score=0.4123, frequency=0.0125, namer='vocab', confidence=0.66)")
    assert repr(concepts) == ("ConceptDictionary(300 concepts (300 named), directions [300, 384], namer='vocab', "
                              "hookpoint='h', sae_dir='...ng/path//very/long/path/sae')")
    assert repr(store).startswith("ActivationStore('") and \
        repr(store).endswith("', rows=3072, token, float32, hookpoints=['acts'])")
    assert repr(wide) == ("ActivationStore('.../deep/folder/a/very/deep/folder/store', rows=3072, token, float32, "
                          "hookpoints=['blocks.0.attn.hook_z_with_a_r...', 'blocks.1.attn.hook_z_with_a_r...', "
                          "+28 more])")
    assert repr(crosscoder) == ("SparseCoder(crosscoder, sources=2, d_in=6, latents=12, k=3, "
                                "hookpoints=['blocks.0.attn.hook_z_with_a...', 'blocks.1.attn.hook_z_with_a...', "
                                "+28 more], float32, cpu)")
