"""In-memory stand-ins for an ActivationStore and a SparseCoder (docs/contracts.md), used by the naming tests,
so that stage 3 is tested on known tensors independently of stages 1 and 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conceptdict.activations import RowContext

pytestmark = pytest.mark.unit


class FakeStore:
    """Token-level (rows = tokens of contexts) or sequence-level (rows = inputs) in-memory store."""

    def __init__(self, x, contexts, *, level="token", hookpoint="hp", labels=None, model="fake-model"):
        self.path = Path("/fake/store")
        self.hookpoints = [hookpoint]
        self.level = level
        self._x = x.float()
        self.num_rows = x.shape[0]
        self.manifest = {"model": model, "level": level}
        self._labels = labels or {}
        self.row_calls = 0
        if level == "token":  # contexts: list of token lists; one row per token
            self._where = [(c, p) for c, toks in enumerate(contexts) for p in range(len(toks))]
        else:  # contexts: list of texts; one row per text
            self._where = [(c, 0) for c in range(len(contexts))]
        self._contexts = contexts
        assert len(self._where) == self.num_rows

    def d_in(self, hookpoint):
        return self._x.shape[1]

    def rows(self, hookpoint, start, stop):
        return self._x[start:stop]

    def iter_rows(self, hookpoint, chunk=8192):
        for s in range(0, self.num_rows, chunk):
            yield s, self._x[s : s + chunk]

    def row_context(self, row, before=8, after=4):
        self.row_calls += 1
        c, p = self._where[row]
        if self.level == "sequence":
            text = self._contexts[c]
            return RowContext(text.split(" "), -1, text, c, 0)
        toks = self._contexts[c]
        lo = max(0, p - before)
        window = toks[lo : p + after + 1]
        return RowContext(list(window), p - lo, "".join(window), c, p)

    def labels(self, key):
        return self._labels.get(key)


class FakeCoder(torch.nn.Module):
    """A TopK SAE with given decoder rows; encoder = decoder transpose."""

    def __init__(self, W_dec, k=2):
        super().__init__()
        self.W_dec = torch.nn.Parameter(W_dec.float())
        self.W_enc = torch.nn.Parameter(W_dec.float().T.clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(W_dec.shape[0]))
        self.b_dec = torch.nn.Parameter(torch.zeros(W_dec.shape[1]))
        self.k, self.kind, self.d_in, self.n_latents, self.n_sources = k, "topk", W_dec.shape[1], W_dec.shape[0], 1

    def flatten_input(self, x):
        return x

    @torch.no_grad()
    def dense_activations(self, x):
        return torch.relu((self.flatten_input(x) - self.b_dec) @ self.W_enc + self.b_enc)

    def encode(self, x):
        pre = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        top = pre.topk(self.k, dim=1)
        return torch.zeros_like(pre).scatter(1, top.indices, top.values)

    def decoder_directions(self):
        return self.W_dec.detach()


def random_token_store(n_ctx=30, ctx_len=12, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = ["the", " cat", " sat", " on", " mat", " dog", " ran", "<script>", " a", " big"]
    contexts = [
        [vocab[i] for i in torch.randint(0, len(vocab), (ctx_len,), generator=gen).tolist()] for _ in range(n_ctx)
    ]
    x = torch.randn(n_ctx * ctx_len, d, generator=gen)
    return FakeStore(x, contexts)


def test_fake_store_contract():
    store = random_token_store(n_ctx=3, ctx_len=5)
    ctx = store.row_context(7, before=2, after=1)
    assert ctx.context_index == 1 and ctx.position == 2
    assert ctx.tokens[ctx.marked] == store._contexts[1][2]
    assert sum(len(x) for _, x in store.iter_rows("hp", 4)) == store.num_rows


def test_fakes_and_the_real_stages_implement_the_naming_protocols(tmp_path):
    """naming.protocols writes down what the fakes implement; the real store and dictionary implement it too."""
    import numpy as np

    from conceptdict.activations import ActivationStore, ImportConfig, import_array
    from conceptdict.naming.protocols import Dictionary, Store
    from conceptdict.saes import SparseCoder

    assert isinstance(random_token_store(n_ctx=3, ctx_len=5), Store)
    assert isinstance(FakeCoder(torch.randn(6, 4)), Dictionary)
    np.save(tmp_path / "acts.npy", np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32))
    assert isinstance(ActivationStore(import_array(ImportConfig(array=tmp_path / "acts.npy", out=tmp_path / "s"))),
                      Store)
    assert isinstance(SparseCoder(4, 8, 2), Dictionary)
    assert not isinstance(object(), Store) and not isinstance(torch.nn.Linear(2, 2), Dictionary)
