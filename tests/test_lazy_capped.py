"""Issue 55's check: a block artifact larger than a process's memory cap is evaluated, exported, named and compared
with another one in one process under the cap (tests/lazy_capped.py runs it: eval, export, name and compare choose to
read it lazily because it does not fit; name writes its concepts a block at a time, compare matches decoders block
against block).

The cap is ``RLIMIT_AS`` set to the process's VmSize after a warm-up (torch alone maps over a GiB of address space
it never touches, so an absolute cap would measure torch) plus a budget of half the artifact's weights; loading the
artifact whole under the same cap fails, which shows that the cap bites. glibc is told to return every allocation
of 64 KiB or more to the system when freed (``MALLOC_MMAP_THRESHOLD_``): with its default, freed 16 MiB blocks stay
in the heap and the address space grows with fragmentation rather than with what is alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]

D, L, PARTS, K = 512, 65536, 16, 32
"""256 MiB of weights in 16 files of 16 MiB."""
MIB = 2 ** 20


def _blocks(where: Path, latents: int, parts: int, store: Path) -> Path:
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part
    from conceptdict.saes.model import SparseCoder

    for i in range(parts):
        torch.manual_seed(i)
        part = SparseCoder(D, latents // parts, K, "topk")
        save_dictionary_part(part, where, i, parts)
    finish_parts(part, where, parts, extra={"stores": [str(store)], "hookpoints": ["hp"]})
    return where


def _capped(tmp_path: Path, spec: dict, timeout: int = 900) -> dict:
    """tests/lazy_capped.py run on ``spec`` in a fresh process (glibc returning freed blocks of 64 KiB or more) on one
    thread: its JSON record. The budget is one thread's: with two (this file run alone on a 2-core machine, not
    under `make test-slow`'s two workers, which give each one) the compare's parallel regions' scratch took the
    address space past the cap (8-16 MiB allocations refused)."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = Path(__file__).with_name("lazy_capped.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "spec.json")], capture_output=True, text=True,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_block_artifact_larger_than_the_cap_is_evaluated_exported_named_and_compared_under_it(tmp_path):
    """eval, export (saelens and dictionary-learning), name, score and compare in one process under the cap."""
    import conceptdict as cd
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.naming import embed_vocabulary, load_concepts, vocab_names

    g = torch.Generator().manual_seed(0)
    save_file({"hp": torch.randn(2048, D, generator=g)}, str(tmp_path / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp_path / "acts.safetensors", out=tmp_path / "store"))
    big = _blocks(tmp_path / "big", L, PARTS, store)
    weights = sum(p.stat().st_size for p in big.glob("weights-*.safetensors"))
    words = [f"word{i}" for i in range(64)]
    (tmp_path / "words.txt").write_text("\n".join(words) + "\n")
    vocab = embed_vocabulary(words, "planted", "hp", lambda t: torch.randn(len(t), D, generator=g), tmp_path / "cache")
    spec = {"artifact": str(big), "warmup": str(_blocks(tmp_path / "warm", 256, 2, store)), "store": str(store),
            "hookpoint": "hp", "out": str(tmp_path / "out"), "budget_mib": weights / 2 / MIB,
            "vocab": str(tmp_path / "words.txt"), "cache": str(tmp_path / "cache"),
            "compare_with": {"warmup": str(_blocks(tmp_path / "warm2", 256, 2, store)),
                             "big": str(_blocks(tmp_path / "small", 256, 2, store))}}
    got = _capped(tmp_path, spec, timeout=1800)
    added, peak = got["vmpeak"] - got["base_vmsize"], got["vmhwm"] - got["base_rss"]
    print(f"weights {weights / MIB:.0f} MiB, cap +{(got['cap'] - got['base_vmsize']) / MIB:.0f} MiB: address space "
          f"+{added / MIB:.1f} MiB, resident peak (VmHWM) +{peak / MIB:.1f} MiB")
    compared = got["compare_vmhwm"] - got["compare_base_rss"]
    print(f"compare of two: resident peak (VmHWM) +{compared / MIB:.1f} MiB over its start, {got['compare_s']:.0f} s")
    dictlearn_peak = got["dictlearn_vmhwm"] - got["dictlearn_base_rss"]
    print(f"export --format dictionary-learning: resident peak (VmHWM) +{dictlearn_peak / MIB:.1f} MiB over its start, "
          f"{got['dictlearn_s']:.0f} s")
    named = got["name_vmhwm"] - got["name_base_rss"]
    print(f"name: resident peak (VmHWM) +{named / MIB:.1f} MiB over its start, {got['name_s']:.0f} s")
    scored = got["score_vmhwm"] - got["score_base_rss"]
    print(f"score: resident peak (VmHWM) +{scored / MIB:.1f} MiB over its start, {got['score_s']:.0f} s")
    assert got["whole_load"].startswith("failed"), "the cap must be too small for the whole dictionary"
    assert got["export_exit"] == 0 and got["name_exit"] == 0 and peak < weights / 2
    whole = cd.load(big)  # here, without a cap: the reference
    ref = cd.evaluate(whole, store=store, hookpoint="hp", contexts=0, batch_size=512, out=tmp_path / "whole.json")
    assert got["fvu"] == pytest.approx(ref.metrics.fvu, rel=1e-6) and got["l0"] == ref.metrics.l0 == K
    exported = load_file(tmp_path / "out" / "big-saelens" / "sae_weights.safetensors")
    assert torch.equal(exported["W_dec"], whole.W_dec) and torch.equal(exported["W_enc"], whole.W_enc)
    assert got["dictlearn_exit"] == 0 and dictlearn_peak < weights / 2
    ae = torch.load(tmp_path / "out" / "big-dictlearn" / "ae.pt", weights_only=True)  # torch.save's archive
    assert torch.equal(ae["decoder.weight"], whole.W_dec.T) and torch.equal(ae["encoder.weight"], whole.W_enc.T)
    del ae
    concepts = load_concepts(tmp_path / "out" / "big-named")  # every latent named, as the whole decoder names it
    assert len(concepts) == L and torch.equal(concepts.directions, whole.decoder_directions())
    want = vocab_names(whole.decoder_directions(), vocab.embeddings, words, n_runner_ups=4)
    assert concepts.names == [r.name for r in want] and [c.score for c in concepts.concepts] == [r.score for r in want]
    assert (tmp_path / "out" / "big-named" / "report" / "index.html").exists()
    assert got["score_exit"] == 0 and scored < weights / 2  # concepts.json read and written a block at a time
    scoring = json.loads((tmp_path / "out" / "big-named" / "concepts.json").read_text())["meta"]["scoring"]
    assert scoring["scored_latents"] > 0 and scoring["summary"]["(chosen)"]["positive-share"]["n"] > 0
    assert (tmp_path / "out" / "big-named" / "report" / "scores.html").exists()
    cmp = json.loads(Path(got["compare_json"]).read_text())  # big (read lazily) beside a small one (whole)
    assert set(cmp["matches"]) == {"big", "small"} and 0 <= cmp["matches"]["big"]["small"] <= 1
    assert compared < weights / 2
    row = cmp["dictionaries"][0]
    assert (row["name"], row["n_latents"], row["metrics"]["l0"], row["metrics"]["n_tokens"]) == ("big", L, K, 2048)
    assert row["metrics"]["fvu"] == pytest.approx(got["fvu"], rel=1e-6), "compare's evaluation is eval's"
    assert 0 <= row["weights"]["decoder_max_cosine_mean"] < 1 and row["unique_latents"] is not None


S_CLT, D_CLT, P_CLT, K_CLT = 4, 256, 12288, 32
"""A clt-batchtopk of 4 layers, 12,288 latents each (49,152 in all) in 16 files of 15 MiB: 240 MiB of weights (its
decoder stored whole, the triangle's zeros included)."""


def _clt_blocks(where: Path, per_layer: int, parts: int, store: Path) -> Path:
    """A clt-batchtopk saved as ``parts`` latent shards (file i: slice i of every layer's latents), random weights,
    its thresholds at 3 (about 16 of a layer's 12,288 latents fire on a row of unit-variance inputs)."""
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part
    from conceptdict.saes.model import SparseCoder

    for i in range(parts):
        torch.manual_seed(i)
        part = SparseCoder(D_CLT, S_CLT * per_layer // parts, K_CLT, "clt-batchtopk", n_sources=S_CLT)
        part.threshold.fill_(3.0)
        save_dictionary_part(part, where, i, parts)
    hookpoints = ([f"blocks.{l}.mlp.hook_in" for l in range(S_CLT)] +
                  [f"blocks.{l}.mlp.hook_out" for l in range(S_CLT)])
    finish_parts(part, where, parts, extra={"stores": [str(store)], "hookpoints": hookpoints})
    return where


def test_a_clt_block_artifact_larger_than_the_cap_is_evaluated_exported_and_named_under_it(tmp_path, monkeypatch):
    """Issue 55's check for a cross-layer transcoder: a 240 MiB clt-batchtopk block artifact is evaluated, exported
    to circuit-tracer and named in one process capped at half its weights (the commands read it lazily because it
    does not fit; name goes layer by layer, each block's latents of one layer read alone); the FVU, the exported
    files and the names are the whole CLT's, and loading it whole under the cap fails."""
    import conceptdict as cd
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.cli.main import main
    from conceptdict.naming import embed_vocabulary, load_concepts, vocab_names
    from conceptdict.saes.lazy import LAZY_ENV

    g = torch.Generator().manual_seed(0)
    hookpoints = [f"blocks.{l}.mlp.hook_{io}" for io in ("in", "out") for l in range(S_CLT)]
    save_file({h: torch.randn(2048, D_CLT, generator=g) for h in hookpoints}, str(tmp_path / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp_path / "acts.safetensors", out=tmp_path / "store"))
    big = _clt_blocks(tmp_path / "big", P_CLT, PARTS, store)
    weights = sum(p.stat().st_size for p in big.glob("weights-*.safetensors"))
    words = [f"word{i}" for i in range(64)]
    (tmp_path / "words.txt").write_text("\n".join(words) + "\n")
    vocab = embed_vocabulary(words, "planted", hookpoints[0], lambda t: torch.randn(len(t), D_CLT, generator=g),
                             tmp_path / "cache")
    spec = {"artifact": str(big), "warmup": str(_clt_blocks(tmp_path / "warm", 128, 2, store)), "store": str(store),
            "out": str(tmp_path / "out"), "budget_mib": weights / 2 / MIB, "export": "circuit-tracer",
            "vocab": str(tmp_path / "words.txt"), "cache": str(tmp_path / "cache")}
    got = _capped(tmp_path, spec, timeout=1500)
    added, peak = got["vmpeak"] - got["base_vmsize"], got["vmhwm"] - got["base_rss"]
    own = {c: got[f"{c}_vmhwm"] - (got["base_rss"] if c == "eval" else got[f"{c}_base_rss"])
           for c in ("eval", "export", "name")}
    print(f"weights {weights / MIB:.0f} MiB, cap +{(got['cap'] - got['base_vmsize']) / MIB:.0f} MiB: address space "
          f"+{added / MIB:.1f} MiB; resident peak (VmHWM) over each command's start: " +
          ", ".join(f"{c} +{v / MIB:.1f} MiB in {got[c + '_s']:.0f} s" for c, v in own.items()))
    assert got["whole_load"].startswith("failed"), "the cap must be too small for the whole CLT"
    assert got["export_exit"] == 0 and got["name_exit"] == 0 and max(peak, *own.values()) < weights / 2
    monkeypatch.setenv(LAZY_ENV, "0")  # here, without a cap: the reference
    whole = cd.load(big)
    ref = cd.evaluate(whole, store=store, contexts=0, batch_size=512, out=tmp_path / "whole.json")
    assert got["fvu"] == pytest.approx(ref.metrics.fvu, rel=1e-6) and got["l0"] == ref.metrics.l0
    assert main(["export", str(big), "--format", "circuit-tracer", "--out", str(tmp_path / "whole-ct")]) == 0
    files = sorted(p.name for p in (tmp_path / "whole-ct").glob("*.safetensors"))
    assert len(files) == 2 * S_CLT
    for name in files:
        want, lazy = load_file(tmp_path / "whole-ct" / name), load_file(tmp_path / "out" / "big-circuit-tracer" / name)
        assert sorted(lazy) == sorted(want) and all(torch.equal(lazy[n], want[n]) for n in want), name
    concepts = load_concepts(tmp_path / "out" / "big-named")  # every latent named, as the whole CLT's decoder names it
    directions = whole.decoder_directions()
    assert len(concepts) == S_CLT * P_CLT and torch.equal(concepts.directions, directions)
    want = vocab_names(directions[:, -1], vocab.embeddings, words, n_runner_ups=4)
    assert concepts.names == [r.name for r in want] and [c.score for c in concepts.concepts] == [r.score for r in want]
    assert [c.extra["layer"] for c in concepts.concepts[:: P_CLT]] == list(range(S_CLT))
    assert (tmp_path / "out" / "big-named" / "report" / "index.html").exists()
