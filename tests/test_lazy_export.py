"""dictionary_learning's ``ae.pt`` written a block of latents at a time (saes.lazy_io.TorchArchiveWriter): the
archive ``torch.save`` writes, filled piecewise, read by ``torch.load(weights_only=True)`` to the same tensors."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from conceptdict.cli.main import main
from conceptdict.saes.formats import dictlearn, native
from conceptdict.saes.lazy import open_lazy
from conceptdict.saes.lazy_io import TorchArchiveWriter
from test_lazy import _saved_in_blocks, _whole

pytestmark = pytest.mark.unit

TENSORS = {"encoder.weight": torch.randn(10, 3), "decoder.weight": torch.randn(3, 10),
           "k": torch.tensor(4, dtype=torch.int), "threshold": torch.tensor(-1.0),
           "half": torch.randn(2, 5).half(), "ids": torch.arange(7), "mask": torch.tensor([True, False, True])}


def _pieces(path, zip64_from: int = 0xFFFFFFFF) -> None:
    """TENSORS written in ranges along their axes, out of order."""
    shapes = {n: (t.dtype, tuple(t.shape)) for n, t in TENSORS.items()}
    with TorchArchiveWriter(path, shapes, zip64_from=zip64_from) as out:
        dec, enc = TENSORS["decoder.weight"], TENSORS["encoder.weight"]
        out.write("decoder.weight", dec[:, 6:], 1, 6)
        out.write("encoder.weight", enc[4:], 0, 4)
        out.write("decoder.weight", dec[:, :6], 1, 0)
        out.write("encoder.weight", enc[:4], 0, 0)
        out.write("half", TENSORS["half"][:, 2:], 1, 2)
        out.write("half", TENSORS["half"][:, :2], 1, 0)
        for name in ("k", "threshold", "ids", "mask"):
            out.write(name, TENSORS[name])


def _same_archive(mine, theirs) -> None:
    """``mine`` is torch.save's bytes except the first 20 digits of .data/serialization_id and that record's CRC."""
    a, b = mine.read_bytes(), theirs.read_bytes()
    za, zb = zipfile.ZipFile(mine), zipfile.ZipFile(theirs)
    assert [(i.filename, i.header_offset, i.file_size) for i in za.infolist()] == \
        [(i.filename, i.header_offset, i.file_size) for i in zb.infolist()]
    ident = za.infolist()[-1]
    assert ident.filename.endswith(".data/serialization_id")
    at = a.index(za.read(ident))  # the id's bytes in the file
    crc = ident.CRC.to_bytes(4, "little")
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    allowed = set(range(at, at + 20)) | {j for i in range(len(a)) if a[i:i + 4] == crc for j in range(i, i + 4)}
    assert len(a) == len(b) and set(differ) <= allowed, differ[:20]
    assert za.read(ident)[20:] == zb.read(zb.infolist()[-1])[20:], "the CRC half of the id is torch's"
    assert za.testzip() is None


def test_a_torch_archive_written_in_pieces_is_torch_saves_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _pieces(tmp_path / "a" / "ae.pt")
    torch.save(TENSORS, tmp_path / "b" / "ae.pt.tmp")  # as dictlearn.write saves: the archive is named "ae.pt"
    (tmp_path / "b" / "ae.pt.tmp").rename(tmp_path / "b" / "ae.pt")
    _same_archive(tmp_path / "a" / "ae.pt", tmp_path / "b" / "ae.pt")
    for mmap in (False, True):
        got = torch.load(tmp_path / "a" / "ae.pt", weights_only=True, mmap=mmap)
        assert list(got) == list(TENSORS)
        for name, t in TENSORS.items():
            assert got[name].dtype == t.dtype and got[name].stride() == t.stride() and torch.equal(got[name], t)
    assert not (tmp_path / "a" / "ae.pt.tmp").exists()


def test_zip64_records_read_back(tmp_path):
    """Records past 4 GiB (or of 4 GiB) are described in zip64 extra fields: forced on every record here, torch.load
    and zipfile read the same tensors and CRCs."""
    _pieces(tmp_path / "ae.pt", zip64_from=0)
    assert zipfile.ZipFile(tmp_path / "ae.pt").testzip() is None
    got = torch.load(tmp_path / "ae.pt", weights_only=True)
    assert all(torch.equal(got[n], t) for n, t in TENSORS.items())


def test_an_error_while_writing_leaves_no_file(tmp_path):
    with pytest.raises(KeyError), TorchArchiveWriter(tmp_path / "ae.pt", {"a": (torch.float32, (3,))}) as out:
        out.write("b", torch.zeros(3))
    assert list(tmp_path.iterdir()) == []


def _threshold_one(whole):
    with torch.no_grad():
        whole.threshold.fill_(0.25)
    return whole


@pytest.mark.parametrize("kind", ["topk", "batchtopk-absolute", "relu"])
def test_a_lazy_dictionary_exports_the_whole_ones_ae_pt(tmp_path, kind):
    """dictionary_learning's export of a dictionary read in blocks of 10 latents (3 files) is the whole one's
    ae.pt (torch.save's file, but for the id) and config.json, and reads back to the same weights."""
    whole = _threshold_one(_whole(kind))
    lazy = open_lazy(_saved_in_blocks(whole, tmp_path / "blocks"), block_latents=10)
    assert len(lazy.blocks) > 3
    dictlearn.write(whole, tmp_path / "one", "blocks.0.hook_out", "m")
    dictlearn.write(lazy, tmp_path / "lazy", "blocks.0.hook_out", "m")
    _same_archive(tmp_path / "lazy" / dictlearn.WEIGHTS, tmp_path / "one" / dictlearn.WEIGHTS)
    assert (tmp_path / "lazy" / dictlearn.CONFIG).read_text() == (tmp_path / "one" / dictlearn.CONFIG).read_text()
    back = dictlearn.read(tmp_path / "lazy").model
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
        assert torch.equal(getattr(back, name), getattr(whole, name)), name


def test_a_lazy_batchtopk_with_thresholds_per_latent_is_refused_and_leaves_no_file(tmp_path):
    whole = _threshold_one(_whole("batchtopk-absolute"))
    with torch.no_grad():
        whole.threshold[50] = 0.5  # in a later block than the first
    lazy = open_lazy(_saved_in_blocks(whole, tmp_path / "blocks"), block_latents=10)
    with pytest.raises(ValueError, match="one scalar threshold"):
        dictlearn.write(lazy, tmp_path / "lazy")
    assert not any((tmp_path / "lazy").glob("ae.pt*"))


def test_export_dictionary_learning_reads_a_dictionary_that_does_not_fit_lazily(tmp_path, monkeypatch):
    """``conceptdict export --format dictionary-learning`` of a dictionary that is read lazily
    (``CONCEPTDICT_LAZY=1``) never loads it whole, and writes the whole one's weights."""
    whole = _threshold_one(_whole("topk"))
    src = _saved_in_blocks(whole, tmp_path / "blocks")

    def whole_load(directory):
        raise AssertionError(f"{directory} was loaded whole")

    monkeypatch.setenv("CONCEPTDICT_LAZY", "1")
    monkeypatch.setattr(native, "read", whole_load)
    assert main(["export", str(src), "--format", "dictionary-learning", "--out", str(tmp_path / "out")]) == 0
    state = torch.load(tmp_path / "out" / dictlearn.WEIGHTS, weights_only=True)
    assert torch.equal(state["encoder.weight"], whole.W_enc.T) and torch.equal(state["decoder.weight"], whole.W_dec.T)
    assert json.loads((tmp_path / "out" / dictlearn.CONFIG).read_text())["trainer"]["dict_size"] == whole.n_latents
