"""What a `train` process does besides its steps (issue 53 item 4): the dictionary is drawn once, the held-out
evaluation decodes the codes sparsely (no second [B, L] @ [L, D] matmul) and gives the dense computation's numbers,
no checkpoint is written where none is asked for, and the command does not import the naming stage to train."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from conceptdict.saes import SparseCoder, evaluate, train, train_config, training
from conceptdict.saes import checkpoint as checkpoint_module
from conceptdict.saes.evaluation import packed_code
from conceptdict.saes.flat import flat_for_kind
from golden.make_golden import SETTINGS, _batches

pytestmark = pytest.mark.unit

KINDS = ("topk", "batchtopk", "jumprelu", "relu", "matryoshka", "spade", "crosscoder", "transcoder",
         "skip-transcoder", "clt")


def _train(kind: str, **kw) -> SparseCoder:
    """A dictionary of ``kind`` after a few seeded steps on golden's planted rows (float32)."""
    out = kw.pop("out", None)
    settings = dict(SETTINGS, kind=kind, kernel_impl="torch", precision="float32", tokens=64 * 4) | kw
    return train(train_config(**flat_for_kind(settings, kind)), functools.partial(_batches, kind), out=out)


def test_training_draws_the_dictionary_once_from_its_seeded_generator(monkeypatch):
    drawn = []
    reset = SparseCoder.reset_parameters

    def counted(self, *a, **kw):
        reset(self, *a, **kw)
        drawn.append(self.W_dec.detach().clone())

    monkeypatch.setattr(SparseCoder, "reset_parameters", counted)
    _train("topk", seed=5)
    assert len(drawn) == 1, f"the dictionary was initialised {len(drawn)} times"
    ref = SparseCoder(16, 128, 4)
    reset(ref, generator=torch.Generator().manual_seed(5))
    assert torch.equal(drawn[0], ref.W_dec)


def test_packed_code_holds_each_rows_nonzeros_in_latent_order():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(7, 50, generator=g) * (torch.rand(7, 50, generator=g) < torch.linspace(0, 0.5, 7)[:, None])
    f[3] = 0  # a row with no latent
    values, indices = packed_code(f)
    counts = (f != 0).sum(1)
    assert values.shape == indices.shape == (7, int(counts.max()))
    assert torch.equal(torch.zeros_like(f).scatter_add(1, indices, values), f)
    for r in range(7):
        n = int(counts[r])
        assert torch.equal(indices[r, :n], f[r].nonzero().flatten()) and not values[r, n:].any()
    assert [t.shape for t in packed_code(f[:0])] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_the_sparse_evaluation_gives_the_dense_computations_numbers(kind, impl, monkeypatch):
    """FVU and every reconstruction number within 1e-5 (relative) of decoding the dense codes with one matmul, the
    code's numbers (L0, L1, densities) equal; the dense decode is never called."""
    model = _train(kind)
    model.kernel_impl = impl  # auto: numba on this CPU
    rows = next(_batches(kind, 0))
    with torch.no_grad():
        xf, target = model.split(model.flatten_batch(rows))
        f = model.codes(xf)
        x_hat = model.reconstruct(xf, f).double()
    t = target.double()
    fvu = float((t - x_hat).pow(2).sum() / (t - t.mean(0)).pow(2).sum())
    cos = float(torch.nn.functional.cosine_similarity(t, x_hat, dim=1).mean())

    def dense(*_):
        raise AssertionError("the evaluation decoded the dense codes")

    monkeypatch.setattr(SparseCoder, "dense_decode", dense)
    got = evaluate(model, [rows])
    assert got.fvu == pytest.approx(fvu, rel=1e-5) and got.cos_sim == pytest.approx(cos, rel=1e-5)
    assert got.l0 == float((f != 0).sum()) / f.shape[0]
    assert got.l1 == pytest.approx(float(f.double().sum()) / f.shape[0], rel=1e-12)
    assert got.density == tuple(((f != 0).double().sum(0) / f.shape[0]).float().tolist())


def test_no_checkpoint_is_written_when_none_is_asked_for(tmp_path, monkeypatch):
    writes = []
    save = checkpoint_module.save_sharded
    monkeypatch.setattr(training, "save_sharded", lambda *a, **kw: (writes.append(a[2]["step"]), save(*a, **kw))[1])
    _train("topk", checkpoint_every=0, out=tmp_path / "none")
    assert not (tmp_path / "none" / "checkpoint.pt").exists() and (tmp_path / "none" / "config.json").exists()
    assert writes == []
    _train("topk", checkpoint_every=3, out=tmp_path / "three")  # 4 steps: at 3, then the end
    _train("topk", checkpoint_every=2, out=tmp_path / "two")  # at 2 and 4, the end's written once
    assert writes == [3, 4, 2, 4]
    assert torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)["step"] == 4


def test_the_train_command_imports_no_naming_stage():
    code = "import sys, conceptdict.cli.train; print(sorted(m for m in sys.modules if m.startswith('conceptdict.nam')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

