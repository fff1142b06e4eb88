"""A saved dictionary read lazily (saes/lazy.py): a block of latents at a time, with the whole dictionary's codes,
reconstructions, evaluation and exported files."""

from __future__ import annotations

import dataclasses

import conceptdict as cd
import pytest
import torch
from conceptdict.saes import SparseCoder, evaluate, save_dictionary
from conceptdict.saes.artifact import finish_parts, save_dictionary_part
from conceptdict.saes.formats import FormatError, saelens, sparsify
from conceptdict.saes.lazy import LOAD_FACTOR, WeightsFile, open_lazy, reads_lazily
from safetensors.torch import load_file
from test_distributed_shards import blocks_of

pytestmark = pytest.mark.unit

D, L, K = 12, 96, 4


def _whole(kind: str, sources: int = 1, seed: int = 0) -> SparseCoder:
    """A dictionary of ``kind`` with every weight random (thresholds and norm scales positive)."""
    torch.manual_seed(seed)
    whole = SparseCoder(D, L, K, kind, n_sources=sources)
    with torch.no_grad():
        for name, t in whole.state_dict().items():
            t.copy_(torch.rand_like(t) * 0.3 + 0.1 if name in ("threshold", "norm_scale") else torch.randn_like(t))
    return whole.requires_grad_(False)


def _saved_in_blocks(whole: SparseCoder, where, parts: int = 3):
    blocks = blocks_of(whole, parts)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, where, i, parts)
    finish_parts(blocks[0], where, parts, extra={"hookpoints": ["a"]})
    return where


def _rows(sources: int, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, *((sources, D) if sources > 1 else (D,)), generator=g) * 2


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-6 of the values' scale (a block's matmul sums in another order than the whole one's)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("kind, sources", [("topk", 1), ("batchtopk", 1), ("batchtopk-absolute", 1), ("relu", 1),
                                           ("jumprelu", 1), ("crosscoder", 2)])
@pytest.mark.parametrize("layout", ["blocks", "one file"])
def test_lazy_codes_and_reconstructions_are_the_whole_dictionarys(tmp_path, kind, sources, layout):
    """encode / decode / sae(x) over blocks of 10 latents (several per file, the last one of each file joined to the
    one before when it would hold k latents or fewer) equal the whole dictionary's; TopK keeps each row's k largest
    over every block, not k per block."""
    whole = _whole(kind, sources)
    where = _saved_in_blocks(whole, tmp_path) if layout == "blocks" else save_dictionary(whole, tmp_path)
    lazy = open_lazy(where, block_latents=10)
    assert len(lazy.blocks) > 3 and all(b - a > K for a, b in lazy.blocks)
    assert lazy.blocks[0][0] == 0 and lazy.blocks[-1][1] == L
    x = _rows(sources)
    f = whole.encode(x)
    got = lazy.encode(x)
    _close(got, f)
    if kind == "topk":
        assert ((got != 0).sum(dim=1) == K).all(), "per-row TopK over the whole dictionary: k codes per row"
    _close(lazy.decode(f), whole.decode(f))
    _close(lazy(x), whole(x))
    assert (lazy.cfg.kind, lazy.cfg.latents, lazy.cfg.sources) == (kind, L, sources)


def test_latents_is_the_in_memory_dictionary_of_the_range_across_files(tmp_path):
    """``latents(start, stop)`` is a SparseCoder of exactly those latents, also across two files; shared tensors
    (b_dec, norm_scale) are the whole one's."""
    whole = _whole("batchtopk")
    lazy = open_lazy(_saved_in_blocks(whole, tmp_path))  # files of 32 latents
    part = lazy.latents(20, 50)
    assert isinstance(part, SparseCoder) and part.n_latents == 30 and part.kind == "batchtopk"
    assert torch.equal(part.W_enc, whole.W_enc[:, 20:50]) and torch.equal(part.W_dec, whole.W_dec[20:50])
    for name in ("b_enc", "threshold"):
        assert torch.equal(getattr(part, name), getattr(whole, name)[20:50])
    assert torch.equal(part.b_dec, whole.b_dec) and torch.equal(part.norm_scale, whole.norm_scale)
    assert part.W_enc.t().is_contiguous(), "latent-major like every SparseCoder's encoder"
    assert torch.equal(lazy.whole().W_dec, whole.W_dec)
    assert torch.equal(lazy.decoder_directions(), whole.decoder_directions())
    with pytest.raises(ValueError, match="more than k=4 latents"):
        lazy.latents(0, 4)


def test_a_lazy_evaluation_is_the_whole_ones(tmp_path):
    """``saes.evaluate`` block by block: the same FVU, L0 and densities as the whole dictionary, and the same
    command-line record (``cd.evaluate`` reads a block artifact lazily)."""
    for kind in ("topk", "batchtopk"):
        whole = _whole(kind)
        lazy = open_lazy(_saved_in_blocks(whole, tmp_path / kind), block_latents=10)
        batches = [_rows(1, 30), _rows(1, 25)]
        one, blocks = evaluate(whole, batches), evaluate(lazy, batches)
        assert blocks.n_tokens == one.n_tokens == 55 and blocks.n_latents == L
        assert blocks.fvu == pytest.approx(one.fvu, rel=1e-6) and blocks.l0 == one.l0
        assert blocks.density == one.density and blocks.l1 == pytest.approx(one.l1, rel=1e-6)


@pytest.mark.parametrize("kind", ["topk", "batchtopk-absolute", "relu"])
def test_a_lazy_dictionary_exports_the_whole_ones_tensors(tmp_path, kind):
    """SAELens (and sparsify for TopK) files written a block at a time hold the whole dictionary's tensors, bit for
    bit, and read back."""
    whole = _whole(kind)
    lazy = open_lazy(_saved_in_blocks(whole, tmp_path / "blocks"), block_latents=10)
    writers = [(saelens.write, saelens.WEIGHTS, ())] + ([(sparsify.write, f"hp/{sparsify.WEIGHTS}", ("hp",))]
                                                        if kind == "topk" else [])
    for write, weights, args in writers:
        write(whole, tmp_path / "one", *args)
        write(lazy, tmp_path / "lazy", *args)
        want, got = load_file(tmp_path / "one" / weights), load_file(tmp_path / "lazy" / weights)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), weights
    assert torch.equal(cd.load(tmp_path / "lazy").W_enc, whole.W_enc)


def test_weights_file_reads_a_range_along_any_axis(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.arange(60.0).view(3, 4, 5), "s": torch.tensor(2.5), "h": torch.arange(6, dtype=torch.bfloat16)}
    save_file(t, str(tmp_path / "w.safetensors"), metadata={"x": "y"})
    f = WeightsFile(tmp_path / "w.safetensors")
    assert torch.equal(f.read("a"), t["a"]) and torch.equal(f.read("s"), t["s"]) and torch.equal(f.read("h"), t["h"])
    for axis in range(3):
        assert torch.equal(f.read("a", axis, 1, 3), t["a"].narrow(axis, 1, 2))


def test_what_is_not_read_lazily_says_how_to_load_it(tmp_path):
    with pytest.raises(ValueError, match=r"not read in blocks of latents .*load it whole: cd.load"):
        open_lazy(save_dictionary(SparseCoder(D, L, K, "matryoshka"), tmp_path / "m"))
    assert not reads_lazily(tmp_path / "m", available=1)  # the commands load it whole
    with pytest.raises(ValueError, match="block_latents=4 must exceed k=4"):
        open_lazy(save_dictionary(SparseCoder(D, L, K, "topk"), tmp_path / "t"), block_latents=4)
    saelens.write(SparseCoder(D, L, K, "topk"), tmp_path / "sl")
    with pytest.raises(FormatError, match="only conceptdict's own layout is read lazily"):
        cd.load(tmp_path / "sl", lazy=True)
    lazy = cd.load(tmp_path / "t", lazy=True)  # one file, asked for: lazy too
    assert lazy.n_latents == L and lazy.path == tmp_path / "t" and lazy.config["kind"] == "topk"


def test_commands_read_lazily_only_what_does_not_fit(tmp_path):
    """``reads_lazily``: loading whole (LOAD_FACTOR x the weights) must fit in the memory at hand, else lazily; kinds
    that are not read in blocks always whole. ``open_dictionary(lazy=None)`` (every streaming command) follows it."""
    from conceptdict.saes.formats import open_dictionary
    from conceptdict.saes.lazy import LazyDictionary

    where = _saved_in_blocks(_whole("topk"), tmp_path / "b")
    size = sum(p.stat().st_size for p in where.glob("weights-*.safetensors"))
    assert reads_lazily(where, available=LOAD_FACTOR * size - 1) and not reads_lazily(where, available=LOAD_FACTOR * size)
    assert not reads_lazily(save_dictionary(SparseCoder(D, L, K, "matryoshka"), tmp_path / "m"), available=1)
    assert isinstance(open_dictionary(where, lazy=None).model, SparseCoder)  # this machine holds 40 KB
    assert isinstance(open_dictionary(where, lazy=True).model, LazyDictionary)


def test_the_environment_pins_the_choice(tmp_path, monkeypatch):
    from conceptdict.saes.lazy import LAZY_ENV

    where = _saved_in_blocks(_whole("topk"), tmp_path)
    monkeypatch.setenv(LAZY_ENV, "1")
    assert reads_lazily(where, available=10 ** 12)
    monkeypatch.setenv(LAZY_ENV, "0")
    assert not reads_lazily(where, available=1)
    monkeypatch.setenv(LAZY_ENV, "yes")
    with pytest.raises(ValueError, match="set it to 1"):
        reads_lazily(where)


# ------------------------------------------------------------------ naming a block at a time


def _naming_setup(tmp_path, kind: str, namer: str):
    """A block artifact of ``kind`` read lazily in blocks of 10 latents, the whole dictionary, a token store (D 12,
    480 rows) and a NameConfig (vocab: a cached 10-word vocabulary, so that no model is loaded)."""
    from conceptdict.naming import NameConfig, embed_vocabulary
    from test_naming_fakes import random_token_store

    whole = _whole(kind, 2 if kind == "crosscoder" else 1)
    lazy = open_lazy(_saved_in_blocks(whole, tmp_path / "blocks"), block_latents=10)
    store = random_token_store(n_ctx=40, ctx_len=12, d=D, seed=5)
    words = [f"w{i}" for i in range(10)]
    (tmp_path / "words.txt").write_text("\n".join(words) + "\n")
    g = torch.Generator().manual_seed(9)
    embed_vocabulary(words, "fake-model", "hp", lambda t: torch.randn(len(t), D, generator=g), tmp_path / "cache")
    cfg = NameConfig(namer=namer, vocab=str(tmp_path / "words.txt"), cache_dir=tmp_path / "cache", top_k=3, n_bins=6,
                     chunk=50, base_rows=32, logit_tokens=0, hookpoint="hp")
    return whole, lazy, store, cfg


def _same_concepts(got_dir, want_dir) -> None:
    """Two concepts.json equal: every name, score, runner-up, example row and count exactly; activations, statistics
    and histogram edges within 1e-5 (values up to about 15; a block's encoder matmul sums in another order)."""
    import json

    got, want = (json.loads((d / "concepts.json").read_text()) for d in (got_dir, want_dir))
    assert got["meta"] == want["meta"] and got["directions_shape"] == want["directions_shape"]
    assert len(got["concepts"]) == len(want["concepts"]) == want["n_concepts"]
    for g, w in zip(got["concepts"], want["concepts"]):
        for key in ("id", "name", "score", "runner_ups", "runner_up_scores", "extra", "logit_top"):
            assert g[key] == w[key], (w["id"], key)
        assert g["frequency"] == w["frequency"] and g["stats"]["count"] == w["stats"]["count"]
        assert g["histogram"]["counts"] == w["histogram"]["counts"]
        for group in ("top_examples", "quantile_examples"):
            assert [e["row"] for e in g[group]] == [e["row"] for e in w[group]], (w["id"], group)
            assert [e["activation"] for e in g[group]] == pytest.approx([e["activation"] for e in w[group]], rel=1e-6, abs=1e-5)
        assert g["stats"] == pytest.approx(w["stats"], rel=1e-6, abs=1e-5)
        assert g["histogram"]["edges"] == pytest.approx(w["histogram"]["edges"], rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("kind, namer", [("topk", "context"), ("topk", "vocab"), ("relu", "context"),
                                         ("batchtopk", "vocab")])
def test_naming_a_block_at_a_time_writes_the_whole_dictionarys_concepts(tmp_path, monkeypatch, kind, namer):
    """A lazily read dictionary named one block of 10 latents at a time, 4 at a time within it (the whole TopK's
    per-row cutoffs first)
    writes the files naming the whole dictionary in memory writes: the same names, scores and example rows
    (``_same_concepts``), directions and report pages; the summary counts the dead and keeps the most frequent."""
    from conceptdict.naming import (
        Naming,
        load_concepts,
        name_dictionary,
        pipeline,
        save_concepts,
        write_named,
        write_report,
    )

    whole, lazy, store, cfg = _naming_setup(tmp_path, kind, namer)
    one = name_dictionary(whole, store, cfg)
    monkeypatch.setattr(pipeline, "PIECE", 4)  # each block's concepts built 4 at a time
    save_concepts(one, tmp_path / "whole")
    write_report(one, tmp_path / "whole" / "report")
    run = Naming(lazy, store, cfg)
    summary = write_named(run.blocks(), tmp_path / "lazy", run.directions_shape, run.meta)
    assert sum(c.frequency > 0 for c in one.concepts) > L / 2 and any(c.top_examples for c in one.concepts)
    _same_concepts(tmp_path / "lazy", tmp_path / "whole")
    back = load_concepts(tmp_path / "lazy")
    assert torch.equal(back.directions, one.directions) and back.names == one.names
    report = sorted(p.name for p in (tmp_path / "whole" / "report").iterdir())
    assert sorted(p.name for p in (tmp_path / "lazy" / "report").iterdir()) == report
    firing = sorted((c for c in one.concepts if c.frequency > 0), key=lambda c: -c.frequency)[:12]
    assert len(summary) == L and summary.dead == sum(c.frequency <= 0 for c in one.concepts)
    assert [c.id for c in summary.most_frequent] == [c.id for c in firing]


def test_the_concepts_file_is_written_a_block_at_a_time_as_one_json_document(tmp_path):
    """ConceptsWriter's concepts.json is ``json.dumps(doc, indent=1)`` of the whole document however the concepts
    come; blocks out of order are refused, and a failed write leaves no file behind."""
    import json

    from conceptdict.naming import name_dictionary
    from conceptdict.naming.concepts import concept_to_json
    from conceptdict.naming.written import ConceptsWriter

    whole, _, store, cfg = _naming_setup(tmp_path, "topk", "context")
    one = name_dictionary(whole, store, cfg)
    with ConceptsWriter(tmp_path / "c", L, one.directions.shape) as out:
        for a in range(0, L, 40):
            out.add(one.concepts[a: a + 40], one.directions[a: a + 40])
        out.finish(one.meta)
    doc = {"format_version": 1, "n_concepts": L, "directions_shape": [L, D], "meta": one.meta,
           "concepts": [concept_to_json(c) for c in one.concepts]}
    assert (tmp_path / "c" / "concepts.json").read_text() == json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    with pytest.raises(ValueError, match="concepts must come in latent order: expected ids from 0"), \
            ConceptsWriter(tmp_path / "bad", L, one.directions.shape) as out:
        out.add(one.concepts[40:50], one.directions[40:50])
    assert not list((tmp_path / "bad").iterdir())


def test_name_in_memory_false_writes_the_same_folder_and_returns_a_summary(tmp_path, monkeypatch, capsys):
    """``conceptdict name`` (``cd.name(in_memory=False)``) over a block artifact read lazily (CONCEPTDICT_LAZY=1)
    writes what ``cd.name`` of the whole dictionary writes, and prints the same lines."""
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.cli.main import main
    from conceptdict.naming import embed_vocabulary
    from conceptdict.saes.lazy import LAZY_ENV
    from safetensors.torch import save_file

    save_file({"a": torch.randn(300, D, generator=torch.Generator().manual_seed(0))}, str(tmp_path / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp_path / "acts.safetensors", out=tmp_path / "store"))
    where = _saved_in_blocks(_whole("topk"), tmp_path / "blocks")
    words = [f"w{i}" for i in range(10)]
    (tmp_path / "words.txt").write_text("\n".join(words) + "\n")
    embed_vocabulary(words, "planted", "a", lambda t: torch.randn(len(t), D), tmp_path / "cache")
    settings = {"store": store, "hookpoint": "a", "vocab": str(tmp_path / "words.txt"), "model": "planted",
                "cache_dir": tmp_path / "cache", "top_k": 3, "chunk": 64, "logit_tokens": 0}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    monkeypatch.setenv(LAZY_ENV, "0")
    want = cd.name(where, out=tmp_path / "whole", **settings)
    monkeypatch.setenv(LAZY_ENV, "1")
    assert main(["name", str(where), *args, "--out", str(tmp_path / "lazy")]) == 0
    printed = capsys.readouterr().out
    assert f"named {L} latents with the vocab namer" in printed
    _same_concepts(tmp_path / "lazy", tmp_path / "whole")
    assert want.path == tmp_path / "whole" and len(want) == L
    with pytest.raises(Exception, match="pass out=DIR"):
        cd.name(where, in_memory=False, store=store, hookpoint="a")


def test_the_llm_namers_max_latents_counts_every_piece(tmp_path, monkeypatch):
    """Named a few latents at a time, the llm namer still names ``max_latents`` firing latents in all (the lowest
    ids), not that many per piece; its detection draws are seeded by the latent's id."""
    from conceptdict.naming import Naming, llm, pipeline
    from conceptdict.naming.llm import LlmConfig

    _, lazy, store, cfg = _naming_setup(tmp_path, "topk", "context")
    calls: list[str] = []

    def chat(config, messages):
        calls.append(messages[-1]["content"])
        return "cat" if len(calls) % 2 else " ".join(["1"] * 40)

    monkeypatch.setattr(llm, "chat", chat)
    monkeypatch.setattr(pipeline, "PIECE", 4)
    cfg = dataclasses.replace(cfg, namer="llm", llm=LlmConfig(url="http://unused", max_latents=7, n_heldout=2))
    run = Naming(lazy, store, cfg)
    concepts = [c for block in run.blocks() for c in block.concepts]
    named = [c.id for c in concepts if c.name]
    firing = [c.id for c in concepts if c.top_examples]
    assert named == firing[:7] and len(calls) == 14
