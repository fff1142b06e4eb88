"""`eval` and `compare` on every store a user can make: a packed store of short documents (its contexts rebuilt
around the separators it leaves out), a dictionary trained from a live model (no store), and dictionaries whose
recorded stores differ."""

from __future__ import annotations

import pytest

import conceptdict as cd
from conceptdict.activations import ActivationStore, load_model, spliced_losses
from conceptdict.activations import data as data_mod
from conceptdict.activations.cache import CacheConfig, cache_activations
from conceptdict.activations.tokens import pad_sequences, rebuild_contexts, separator_id
from conceptdict.cli.main import main
from fixtures_models import tiny_corpus

pytestmark = pytest.mark.integration

HP = "blocks.0.hook_out"


def _short_docs(n: int = 120, seed: int = 0) -> list[dict]:
    """Documents of a few words: every packed context of 32 tokens holds several, so every one has gaps."""
    return [{"text": " ".join(d["text"].split()[:5])} for d in tiny_corpus(n, seed=seed)]


def _train(store, out):
    return cd.train(store=store, out=out, latents=32, k=4, batch_size=64, tokens=64 * 10, eval_batches=2,
                    checkpoint_every=0, seed=0, device="cpu")


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_lm_dir):
    """(store, dictionary trained on it, model dir): a default (packed) store of short documents."""
    root = tmp_path_factory.mktemp("packed")
    store = cache_activations(CacheConfig(model=str(tiny_lm_dir), hookpoints=[HP], dataset="", out=root / "store",
                                          context_length=32, batch_size=8, progress=False), records=_short_docs())
    _train(store, root / "sae")
    return store, root / "sae", tiny_lm_dir


def test_a_packed_store_of_short_documents_rebuilds_the_contexts_the_cache_ran(packed):
    store, _, model_dir = packed
    lm = load_model(str(model_dir))
    ran = list(data_mod.iter_contexts(_short_docs(), lm.tokenizer, context_length=32, packing=True))
    ids, mask = rebuild_contexts(ActivationStore(store), 6, *lm.bos_pad_ids(), separator_id(lm))
    assert ids.shape[0] == 6
    for row, m, context in zip(ids, mask, ran):
        n = int(m.sum())
        assert n >= 31 and row[:n].tolist() == context.ids[:n]  # up to the last stored row (a trailing separator)
    assert sum(row.tolist().count(separator_id(lm)) for row in ids) >= 6  # separators put back between documents


def test_eval_on_a_packed_store_reports_the_spliced_losses_of_the_model_on_those_contexts(packed, tmp_path, capsys):
    store, sae_dir, model_dir = packed
    assert main(["eval", str(sae_dir), "--contexts", "4", "--out", str(tmp_path / "eval.json")]) == 0
    assert "CE loss recovered" in capsys.readouterr().out
    ev = cd.evaluate(sae_dir, contexts=4, out=tmp_path / "e.json")
    # the same contexts evaluated directly: the model's own forward on the packed contexts, the dictionary spliced in
    lm = load_model(str(model_dir))
    ran = list(data_mod.iter_contexts(_short_docs(), lm.tokenizer, context_length=32, packing=True))[:4]
    stored = ActivationStore(store)
    last = [int(stored.position(0, stored.num_rows)[stored.context_index(0, stored.num_rows) == c].max())
            for c in range(4)]
    ids, mask = pad_sequences([c.ids[:n + 1] for c, n in zip(ran, last)], lm.bos_pad_ids()[1])
    sae = cd.load(sae_dir)
    direct = spliced_losses(lm, HP, ids, lambda x: sae(x), attention_mask=mask)
    got = ev.metrics.splice
    assert got["ce_clean"] == pytest.approx(direct.ce_clean, rel=1e-5)
    assert got["ce_replaced"] == pytest.approx(direct.ce_replaced, rel=1e-5)
    assert got["kl_replaced"] == pytest.approx(direct.kl_replaced, rel=1e-5)
    assert ev.metrics.kl_score is not None and ev.metrics.ce_loss_recovered is not None
