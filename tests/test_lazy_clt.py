"""A cross-layer transcoder's block artifact read lazily (saes/lazy_clt.py): a range of every layer's latents at a
time, with the whole CLT's codes, reconstructions and evaluation."""

from __future__ import annotations

import conceptdict as cd
import pytest
import torch
from conceptdict.saes import SparseCoder, evaluate, save_dictionary
from conceptdict.saes.artifact import finish_parts, save_dictionary_part
from conceptdict.saes.lazy import LAZY_ENV, open_lazy, reads_lazily
from conceptdict.saes.lazy_clt import LazyCLT
from test_distributed_shards import blocks_of

pytestmark = pytest.mark.unit

D, S, P, K = 12, 3, 32, 4  # 3 layers of 32 latents each
L = S * P


def _whole(kind: str, seed: int = 0) -> SparseCoder:
    """A CLT of ``kind`` with every weight it holds random (its decoder's triangle; thresholds positive)."""
    torch.manual_seed(seed)
    whole = SparseCoder(D, L, K, kind, n_sources=S)
    state = whole.state_dict()
    for name, t in state.items():
        t.copy_(torch.rand_like(t) * 0.3 + 0.1 if name in ("threshold", "norm_scale") else torch.randn_like(t))
    whole.load_state_dict(state)  # the decoder keeps its triangle: zero from a latent to the layers before its own
    assert whole.W_dec.masked_select(~whole.decoder_mask()).abs().sum() == 0
    return whole.requires_grad_(False)


def _saved(whole: SparseCoder, where, shards: int = 2):
    """``whole`` saved as a block artifact of ``shards`` files (file i: slice i of every layer's latents), as a
    latent-sharded run writes it; one file with ``shards`` 1."""
    if shards == 1:
        return save_dictionary(whole, where, extra={"hookpoints": [f"in{l}" for l in range(S)] +
                                                    [f"out{l}" for l in range(S)]})
    blocks = blocks_of(whole, shards)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, where, i, shards)
    return finish_parts(blocks[0], where, shards)


def _pairs(n: int, seed: int = 3) -> torch.Tensor:
    """n rows of the S layers' inputs then their outputs [n, 2S, D]."""
    return torch.randn(n, 2 * S, D, generator=torch.Generator().manual_seed(seed)) * 2


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-6 of the values' scale (a block's matmul sums in another order than the whole one's)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
@pytest.mark.parametrize("shards", [2, 1])
def test_lazy_clt_codes_and_reconstructions_are_the_whole_ones(tmp_path, kind, shards):
    """encode / decode / sae(x) over blocks of 6 latents of every layer (several per file; the last piece of a file
    joins the one before when it would hold k latents or fewer) equal the whole CLT's; ``clt`` keeps each layer's k
    largest over every block, not k per block."""
    whole = _whole(kind)
    lazy = open_lazy(_saved(whole, tmp_path, shards), block_latents=6)
    assert isinstance(lazy, LazyCLT) and len(lazy.blocks) >= 4 and all(b - a > K for a, b in lazy.blocks)
    assert lazy.blocks[0][0] == 0 and lazy.blocks[-1][1] == P
    x = _pairs(40)[:, :S]
    f = whole.encode(x)
    got = lazy.encode(x)
    _close(got, f)
    if kind == "clt":
        per_layer = (got != 0).view(40, S, P).sum(dim=2)
        assert (per_layer == K).all(), "TopK per layer over the whole layer: k codes per layer and row"
    _close(lazy.decode(f), whole.decode(f))
    _close(lazy(x), whole(x))
    assert (lazy.cfg.kind, lazy.cfg.latents, lazy.cfg.sources) == (kind, L, S)


@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
def test_a_lazy_clt_evaluation_is_the_whole_ones(tmp_path, kind):
    """``saes.evaluate`` of a 2-shard CLT artifact read lazily: FVU per layer, L0 per layer, densities and L1 equal
    the whole CLT's (FVU within 1e-6 relative)."""
    whole = _whole(kind, seed=1)
    lazy = open_lazy(_saved(whole, tmp_path), block_latents=6)
    batches = [_pairs(30, 5), _pairs(25, 6)]
    one, blocks = evaluate(whole, batches), evaluate(lazy, batches)
    assert blocks.n_tokens == one.n_tokens == 55 and blocks.n_latents == L
    assert blocks.fvu == pytest.approx(one.fvu, rel=1e-6)
    assert blocks.per_source_fvu == pytest.approx(one.per_source_fvu, rel=1e-6) and len(one.per_source_fvu) == S
    assert blocks.l0 == one.l0 and blocks.per_layer_l0 == one.per_layer_l0 and len(one.per_layer_l0) == S
    assert blocks.density == one.density and blocks.per_layer_dead == one.per_layer_dead
    assert blocks.l1 == pytest.approx(one.l1, rel=1e-6)


def test_latents_is_the_clt_of_a_range_of_every_layer_across_files(tmp_path):
    """``latents(start, stop)`` is a CLT of latents [start, stop) of every layer (layer-major), also across the two
    files (16 latents of each layer per file); its decoder is its triangle; ``decoder_directions`` and ``whole()``
    are the whole CLT's."""
    whole = _whole("clt-batchtopk", seed=2)
    lazy = open_lazy(_saved(whole, tmp_path))
    part = lazy.latents(10, 22)
    cols = torch.cat([torch.arange(l * P + 10, l * P + 22) for l in range(S)])
    assert isinstance(part, SparseCoder) and (part.n_latents, part.n_sources, part.kind) == (S * 12, S, "clt-batchtopk")
    assert torch.equal(part.W_enc, whole.W_enc[:, cols]) and torch.equal(part.W_dec, whole.W_dec[cols])
    assert torch.equal(part.b_enc, whole.b_enc[cols]) and torch.equal(part.threshold, whole.threshold[cols])
    assert torch.equal(part.b_dec, whole.b_dec) and part.W_enc.t().is_contiguous()
    assert [(first, c.start, c.stop) for first, c in lazy.pieces(10, 22)] == [(10, 0, 12), (42, 12, 24), (74, 24, 36)]
    assert torch.equal(lazy.decoder_directions(), whole.decoder_directions())
    assert torch.equal(lazy.whole().W_dec, whole.W_dec)
    with pytest.raises(ValueError, match=r"must lie in \[0, 32\) and hold more than k=4"):
        lazy.latents(0, 4)
    with pytest.raises(ValueError, match="block_latents=4 must exceed k=4"):
        open_lazy(tmp_path, block_latents=4)


def test_the_commands_read_a_clt_lazily_when_it_does_not_fit(tmp_path, monkeypatch):
    """``reads_lazily`` now says yes for a CLT that does not fit (it was always no); ``cd.load(lazy=True)`` gives a
    LazyCLT; its TopK's cutoffs over global latent ids are refused with the per-layer way (``layer_cutoffs``)."""
    where = _saved(_whole("clt"), tmp_path)
    assert reads_lazily(where, available=1) and not reads_lazily(where, available=10 ** 12)
    monkeypatch.setenv(LAZY_ENV, "1")
    assert reads_lazily(where, available=10 ** 12)
    lazy = cd.load(where, lazy=True)
    assert isinstance(lazy, LazyCLT) and lazy.n_latents == L and lazy.blocks == [(0, 16), (16, 32)]
    with pytest.raises(ValueError, match=r"whose TopK is per layer: its cutoffs are per layer too, layer_cutoffs\("):
        lazy.cutoffs(lambda: iter(()), 0)


def test_cd_evaluate_reads_a_clt_block_artifact_lazily_with_the_whole_ones_numbers(tmp_path, monkeypatch):
    """``cd.evaluate`` of a 2-shard CLT artifact (its layers' inputs and outputs in a store): read lazily
    (CONCEPTDICT_LAZY=1) it writes the FVU per layer and L0 per layer that loading it whole does, within 1e-6
    relative."""
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from safetensors.torch import save_file

    hookpoints = [f"in{l}" for l in range(S)] + [f"out{l}" for l in range(S)]
    rows = _pairs(300, 7)
    save_file({h: rows[:, i].contiguous() for i, h in enumerate(hookpoints)}, str(tmp_path / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp_path / "acts.safetensors", out=tmp_path / "store"))
    whole = _whole("clt", seed=4)
    blocks = blocks_of(whole, 2)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp_path / "clt", i, 2)
    where = finish_parts(blocks[0], tmp_path / "clt", 2, extra={"hookpoints": hookpoints, "stores": [str(store)]})
    got = {}
    for pinned in ("0", "1"):
        monkeypatch.setenv(LAZY_ENV, pinned)
        ev = cd.evaluate(where, contexts=0, out=tmp_path / f"eval{pinned}.json")
        assert isinstance(ev.dictionary, LazyCLT) == (pinned == "1")
        got[pinned] = ev.metrics
    one, lazy = got["0"], got["1"]
    assert lazy.n_tokens == one.n_tokens == 300
    assert lazy.fvu == pytest.approx(one.fvu, rel=1e-6)
    assert lazy.per_source_fvu == pytest.approx(one.per_source_fvu, rel=1e-6)
    assert lazy.l0 == one.l0 and lazy.per_layer_l0 == one.per_layer_l0 and lazy.density == one.density


def test_export_circuit_tracer_writes_a_lazy_clt_a_block_at_a_time(tmp_path, monkeypatch):
    """``conceptdict export --format circuit-tracer`` of a 2-shard clt-batchtopk read lazily (CONCEPTDICT_LAZY=1,
    files written a block at a time) writes the tensors and config.yaml that the whole CLT's export writes, bit for
    bit."""
    from conceptdict.cli.main import main
    from conceptdict.saes.formats import circuit_tracer
    from safetensors.torch import load_file

    hookpoints = [f"blocks.{l}.mlp.hook_in" for l in range(S)] + [f"blocks.{l}.mlp.hook_out" for l in range(S)]
    whole = _whole("clt-batchtopk", seed=5)
    blocks = blocks_of(whole, 2)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp_path / "clt", i, 2)
    where = finish_parts(blocks[0], tmp_path / "clt", 2, extra={"hookpoints": hookpoints})
    for pinned in ("0", "1"):
        monkeypatch.setenv(LAZY_ENV, pinned)
        assert main(["export", str(where), "--format", "circuit-tracer", "--out", str(tmp_path / pinned)]) == 0
    files = sorted(p.name for p in (tmp_path / "0").iterdir())
    assert sorted(p.name for p in (tmp_path / "1").iterdir()) == files and f"W_dec_{S - 1}.safetensors" in files
    for name in (f for f in files if f.endswith(".safetensors")):
        want, got = load_file(tmp_path / "0" / name), load_file(tmp_path / "1" / name)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), name
    assert (tmp_path / "1" / "config.yaml").read_text() == (tmp_path / "0" / "config.yaml").read_text()
    lazy = open_lazy(where, block_latents=6)  # several blocks per file
    circuit_tracer.export(lazy, tmp_path / "blocks", config=lazy.config, model_name=None, hookpoint=None)
    for name in (f for f in files if f.endswith(".safetensors")):
        want, got = load_file(tmp_path / "0" / name), load_file(tmp_path / "blocks" / name)
        assert all(torch.equal(got[n], want[n]) for n in want), name


def test_layer_latents_are_one_layers_latents_read_alone(tmp_path):
    """``layer_latents(l, a, b)`` reads latents [a, b) of layer l alone, also across the two files: its ``encode``
    takes layer l's input [N, D] and, of a block, gives the whole CLT's codes of those latents (``clt``: those at or
    above each row's k-th largest of the layer over every block, ``layer_cutoffs``); its directions are the whole
    CLT's decoder rows of them [m, S, D]. The block read last is held (asked again, not read again; one held block
    for ``latents`` and ``layer_latents`` alike) and ranges and layers out of bounds are refused."""
    for kind in ("clt", "clt-batchtopk"):
        whole = _whole(kind, seed=3)
        lazy = open_lazy(_saved(whole, tmp_path / kind), block_latents=6)
        x = _pairs(40, 8)[:, :S]
        f = whole.encode(x).view(40, S, P)
        for l in range(S):
            rows = [(0, x[:25, l]), (25, x[25:, l])]
            cut = lazy.layer_cutoffs(l, lambda rows=rows: iter(rows), 40)
            if kind == "clt":
                torch.testing.assert_close(cut, f[:, l].topk(K, dim=1).values[:, -1], rtol=0, atol=1e-5)
            else:
                assert cut is None
            for a, b in [(10, 22), *lazy.blocks]:
                part = lazy.layer_latents(l, a, b)
                cols = slice(l * P + a, l * P + b)
                assert (part.n_latents, part.n_sources, part.kind, part.layer) == (b - a, S, kind, l)
                assert torch.equal(part.coder.W_enc, whole.W_enc[:, cols]) and part.coder.W_enc.t().is_contiguous()
                assert torch.equal(part.coder.b_enc, whole.b_enc[cols])
                assert torch.equal(part.decoder_directions(), whole.decoder_directions()[cols])
                if kind == "clt-batchtopk":
                    assert torch.equal(part.coder.threshold, whole.threshold[cols])
                if (a, b) in lazy.blocks:  # (the cutoffs are its blocks' values: another range may round otherwise)
                    codes = part.encode(x[:, l])
                    _close(codes if cut is None else torch.where(codes >= cut[:, None], codes, 0.0), f[:, l, a:b])
    assert lazy.layer_latents(1, 6, 16) is lazy.layer_latents(1, 6, 16)
    assert lazy.layer_latents(2, 6, 16) is not lazy.layer_latents(1, 6, 16)
    block = lazy.latents(6, 16)
    assert lazy.latents(6, 16) is block and lazy.layer_latents(0, 6, 16) is not block
    assert lazy.latents(6, 16) is not block, "one block held: the layer's read let the other go"
    with pytest.raises(ValueError, match=r"layer_latents\(0, 0, 4\): the range of each layer's latents must lie in "
                                         r"\[0, 32\) and hold more than k=4"):
        lazy.layer_latents(0, 0, 4)
    with pytest.raises(ValueError, match=r"layer_latents\(3, 0, 8\): this clt-batchtopk has layers 0..2"):
        lazy.layer_latents(3, 0, 8)


def _clt_store(tmp_path, rows: int = 240):
    """A store of the S layers' inputs and outputs (in0.., out0..; ``rows`` rows)."""
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from safetensors.torch import save_file

    x = _pairs(rows, 11)
    save_file({h: x[:, i].contiguous() for i, h in enumerate(HOOKPOINTS)}, str(tmp_path / "acts.safetensors"))
    return import_array(ImportConfig(array=tmp_path / "acts.safetensors", out=tmp_path / "store"))


HOOKPOINTS = [f"in{l}" for l in range(S)] + [f"out{l}" for l in range(S)]


@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
def test_naming_a_lazy_clt_writes_the_whole_clts_concepts(tmp_path, monkeypatch, capsys, kind):
    """``conceptdict name`` of a 2-shard CLT read lazily (CONCEPTDICT_LAZY=1) in blocks of 6 latents per layer, 4
    latents named at a time: layer by layer, each block's latents of one layer reading that layer's input alone,
    with ``clt``'s TopK cutoffs per layer. It writes the concepts.json that ``cd.name`` of the whole CLT writes (the
    same names, scores, layers, decoder norms and example rows; activations and statistics to float32 rounding),
    the same directions [L, S, D] and report pages."""
    from conceptdict.cli.main import main
    from conceptdict.naming import embed_vocabulary, load_concepts, pipeline
    from conceptdict.saes.lazy import LAZY_ENV
    from test_lazy import _same_concepts

    store = _clt_store(tmp_path)
    whole = _whole(kind, seed=6)
    blocks = blocks_of(whole, 2)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp_path / "clt", i, 2)
    where = finish_parts(blocks[0], tmp_path / "clt", 2, extra={"hookpoints": HOOKPOINTS, "stores": [str(store)]})
    words = [f"w{i}" for i in range(10)]
    (tmp_path / "words.txt").write_text("\n".join(words) + "\n")
    g = torch.Generator().manual_seed(2)
    embed_vocabulary(words, "planted", "in0", lambda t: torch.randn(len(t), D, generator=g), tmp_path / "cache")
    settings = {"vocab": str(tmp_path / "words.txt"), "model": "planted", "cache_dir": tmp_path / "cache",
                "top_k": 3, "n_bins": 6, "chunk": 50, "logit_tokens": 0}
    monkeypatch.setenv(LAZY_ENV, "0")
    want = cd.name(where, out=tmp_path / "whole", **settings)
    monkeypatch.setenv(LAZY_ENV, "1")
    monkeypatch.setattr("conceptdict.saes.lazy_clt.BLOCK_MIB", 3900 / 2 ** 20)  # 6 latents of each layer a block
    monkeypatch.setattr(pipeline, "PIECE", 4)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    assert main(["name", str(where), *args, "--out", str(tmp_path / "lazy")]) == 0
    assert f"named {L} latents with the vocab namer" in capsys.readouterr().out
    assert open_lazy(where).blocks == [(0, 6), (6, 16), (16, 22), (22, 32)]
    _same_concepts(tmp_path / "lazy", tmp_path / "whole")
    got = load_concepts(tmp_path / "lazy")
    assert torch.equal(got.directions, want.directions) and got.directions.shape == (L, S, D)
    assert got.names == want.names and [c.extra["layer"] for c in got.concepts] == [i // P for i in range(L)]
    assert sum(c.frequency > 0 for c in want.concepts) > L / 2
    report = sorted(p.name for p in (tmp_path / "whole" / "report").iterdir())
    assert sorted(p.name for p in (tmp_path / "lazy" / "report").iterdir()) == report


@pytest.mark.parametrize("kind", ["clt", "clt-batchtopk"])
def test_a_lazy_clts_replacement_model_is_the_whole_ones(tmp_path, kind):
    """``clt_replacement`` of a 2-shard CLT read lazily in blocks of 6 latents per layer: every layer's code and its
    output from the codes of the layers up to it equal the whole CLT's (what the spliced CE / KL of `eval --model`
    reads; before, the lazy CLT had no ``W_dec`` and the evaluation stopped with an AttributeError)."""
    from conceptdict.saes.replacement import clt_replacement

    whole = _whole(kind, seed=5)
    where = _saved(whole, tmp_path / "clt", shards=2)
    lazy, one = clt_replacement(open_lazy(where, block_latents=6)), clt_replacement(whole)
    x = _pairs(40, 11)[:, :S]  # each layer's input
    codes_lazy, codes_one = [], []
    for l in range(S):
        codes_lazy.append(lazy.encode(l, x[:, l]))
        codes_one.append(one.encode(l, x[:, l]))
        _close(codes_lazy[-1], codes_one[-1])
        _close(lazy.decode(l, codes_lazy), one.decode(l, codes_one))
    assert lazy.n_layers == one.n_layers == S
