"""``conceptdict compare`` of block artifacts read lazily (saes/lazy_compare.py): the same compare.json as the
dictionaries loaded whole, the weight metrics and the matching computed block against block."""

from __future__ import annotations

import json

import pytest
import torch
from conceptdict.saes import SparseCoder
from conceptdict.saes.compare import max_other_cosine, split_fraction
from conceptdict.saes.lazy import LAZY_ENV, LazyDictionary, open_lazy
from conceptdict.saes.lazy_compare import Firing, parts_of, self_cosines
from test_lazy import _saved_in_blocks

pytestmark = pytest.mark.integration

D, L, K = 16, 96, 3


def _pair(tmp_path, store) -> list:
    """Two topk dictionaries over the planted store, saved as 3 files each: b shares half of a's decoder rows (so
    matches are neither 0 nor 1) and a has near-duplicate and exclusive-firing partners (so the split fraction and
    the near-duplicate share are not 0)."""
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = SparseCoder(D, L, K, "topk").requires_grad_(False)
        with torch.no_grad():
            m.W_dec.copy_(torch.randn(L, D))
            if seed == 1:
                m.W_dec[: L // 2] = out[0][1].W_dec[: L // 2] + 0.3 * torch.randn(L // 2, D)
            m.W_dec[1::8] = m.W_dec[0::8] + 0.05 * torch.randn(L // 8, D)  # near-duplicates
            m.W_enc.copy_(m.W_dec.T + 0.5 * torch.randn(D, L))
        where = _saved_in_blocks(m, tmp_path / f"d{seed}")
        cfg = json.loads((where / "config.json").read_text())
        cfg["stores"], cfg["hookpoints"] = [str(store)], ["acts"]
        (where / "config.json").write_text(json.dumps(cfg))
        out.append((where, m))
    return out


def test_a_lazy_compare_writes_the_whole_compare_json(tmp_path, planted_store, monkeypatch):
    """compare.json of two sharded dictionaries read lazily (CONCEPTDICT_LAZY=1) equals the one loaded whole
    (CONCEPTDICT_LAZY=0): every number within 1e-6 relative, the matched shares and unique counts identical."""
    import conceptdict as cd

    pair = _pair(tmp_path, planted_store)
    results, reads = {}, []
    block = LazyDictionary.latents
    monkeypatch.setattr(LazyDictionary, "latents", lambda self, a, b: reads.append((a, b)) or block(self, a, b))
    for pin in ("0", "1"):
        monkeypatch.setenv(LAZY_ENV, pin)
        assert not reads or pin == "1", "loaded whole: no block read"
        results[pin] = cd.compare([str(w) for w, _ in pair], store=planted_store, out=tmp_path / f"cmp{pin}",
                                  contexts=0, rows=1024, batch_size=256).result
    whole, lazy = results["0"], results["1"]
    assert {b for b in reads} == {(0, 32), (32, 64), (64, 96)}, "read lazily: the blocks, one file each"
    assert lazy["matches"] == whole["matches"] and lazy["frontier"] == whole["frontier"]
    assert 0 < whole["matches"]["d0"]["d1"] < 1
    for w, z in zip(whole["dictionaries"], lazy["dictionaries"]):
        assert z["unique_latents"] == w["unique_latents"] and z["live_latents"] == w["live_latents"]
        assert w["weights"]["near_duplicate_fraction"] > 0 and w["weights"]["split_fraction"] > 0
        for key, value in w["weights"].items():
            assert z["weights"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        for key in ("n_tokens", "l0", "fvu", "mse", "dead_fraction", "density_histogram"):
            assert z["metrics"][key] == pytest.approx(w["metrics"][key], rel=1e-6), key


def test_self_cosines_block_against_block_equal_the_whole_decoders(tmp_path):
    """Each latent's best other cosine and split flag, over blocks of 10 latents in chunks of 7, equal
    ``max_other_cosine`` / ``split_fraction`` of the whole decoder and firing matrix."""
    torch.manual_seed(0)
    m = SparseCoder(D, L, K, "topk").requires_grad_(False)
    with torch.no_grad():
        m.W_dec[1::4] = m.W_dec[0::4] + 0.01 * torch.randn(L // 4, D)
    lazy = open_lazy(_saved_in_blocks(m, tmp_path), block_latents=10)
    fires = torch.zeros(50, L, dtype=torch.bool)
    fires[torch.arange(50)[:, None], torch.randint(0, L, (50, 4))] = True
    fires[:, 1::4] &= ~fires[:, 0::4]  # the duplicates never fire with their originals
    r, c = fires.nonzero(as_tuple=True)
    best, split = self_cosines(parts_of(lazy), L, Firing(c, r, 50, L), chunk=7)
    torch.testing.assert_close(best, max_other_cosine(m.W_dec)[0], rtol=1e-6, atol=1e-6)
    live = fires.any(0)
    want = split_fraction(m.W_dec, fires)
    assert want > 0 and float(split[live].float().mean()) == pytest.approx(want, rel=1e-6)


def test_eval_metrics_core_is_measured_lazily_and_the_others_refused(tmp_path, planted_store, monkeypatch):
    """``eval --metrics core`` of a block artifact read lazily: the whole dictionary's numbers (the max encoder and
    decoder cosines block against block); a metric that needs the whole dictionary is refused, saying what to do."""
    import conceptdict as cd
    from conceptdict.settings import ConfigError

    where, _ = _pair(tmp_path, planted_store)[0]
    got = {}
    for pin in ("0", "1"):
        monkeypatch.setenv(LAZY_ENV, pin)
        e = cd.evaluate(str(where), store=planted_store, metrics="core", contexts=0, rows=512, batch_size=128,
                        out=tmp_path / f"eval{pin}.json")
        assert isinstance(e.dictionary, LazyDictionary) == (pin == "1")
        got[pin] = e.yardsticks.results["core"]
    whole, lazy = got["0"], got["1"]
    assert whole["summary"]["average_max_decoder_cosine_sim"] > 0.5  # the near-duplicates
    assert lazy["summary"].keys() == whole["summary"].keys()
    for key, value in whole["summary"].items():
        assert lazy["summary"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for key in ("max_decoder_cosine_sim", "max_encoder_cosine_sim"):
        assert lazy["details"][key] == pytest.approx(whole["details"][key], rel=1e-6, abs=1e-7), key
    with pytest.raises(ConfigError, match="only core is measured so.*pass --metrics core, or CONCEPTDICT_LAZY=0"):
        cd.evaluate(str(where), store=planted_store, metrics="core,absorption", contexts=0, rows=512,
                    out=tmp_path / "eval2.json")
