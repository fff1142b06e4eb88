"""A saved dictionary read lazily (saes/lazy.py): a block of latents at a time, with the whole dictionary's codes,
reconstructions, evaluation and exported files."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match=r"clt dictionary is not read in blocks of latents \(its latents are split by "
                                         r"layer\)"):
        open_lazy(save_dictionary(SparseCoder(D, L, K, "clt", n_sources=2), tmp_path / "c"))
    assert not reads_lazily(tmp_path / "c", available=1)  # the commands load it whole
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
