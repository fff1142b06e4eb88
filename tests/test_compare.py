"""`conceptdict compare`: the metrics of saes.compare, its numbers against `conceptdict eval`, the page, and a run
on the demo's dictionaries (rendered in headless Chromium when one is installed)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conceptdict.cli.main import main
from conceptdict.naming.reports.compare import comparison_table, render_comparison
from conceptdict.saes import SparseCoder
from conceptdict.saes.compare import Entry, compare, frontier, max_other_cosine, split_fraction


def _model(seed: int, latents: int = 24, d: int = 8, k: int = 3) -> SparseCoder:
    m = SparseCoder(d, latents, k, "topk")
    m.reset_parameters(torch.Generator().manual_seed(seed))
    return m


@pytest.mark.unit
def test_max_other_cosine_matches_the_dense_computation():
    a, b = torch.randn(37, 6), torch.randn(11, 6)
    unit = torch.nn.functional.normalize
    best, where = max_other_cosine(a, b, chunk=8)
    dense = unit(a, dim=1) @ unit(b, dim=1).T
    torch.testing.assert_close(best, dense.max(dim=1).values)
    assert torch.equal(where, dense.argmax(dim=1))
    self_best, _ = max_other_cosine(a, chunk=5)
    own = unit(a, dim=1) @ unit(a, dim=1).T
    own.fill_diagonal_(-2)
    torch.testing.assert_close(self_best, own.max(dim=1).values)


@pytest.mark.unit
def test_split_fraction_counts_aligned_latents_that_never_fire_together():
    W = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 1.0, 0], [0, 0, 1.0]])
    fires = torch.zeros(10, 4, dtype=torch.bool)
    fires[:5, 0], fires[5:, 1], fires[:, 2], fires[::2, 3] = True, True, True, True
    assert split_fraction(W, fires) == pytest.approx(0.5)  # latents 0 and 1: one direction, exclusive firing
    fires[0, 1] = fires[1, 1] = True  # now they overlap (Jaccard 2/7 > 0.05)
    assert split_fraction(W, fires) == 0.0


@pytest.mark.unit
def test_frontier_keeps_the_points_nothing_beats():
    pts = {"a": (8.0, 0.2), "b": (16.0, 0.1), "c": (16.0, 0.3), "d": (4.0, 0.5), "e": (8.0, 0.2)}
    assert frontier(pts) == ["a", "b", "d", "e"]


@pytest.mark.unit
def test_the_same_dictionary_twice_matches_fully_and_names_differ_by_what_each_found():
    x = [torch.randn(64, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    m, other = _model(0), _model(1)
    names = [f"n{i}" for i in range(24)]
    result = compare([Entry("a", m, x, "h", names), Entry("b", _model(0), x, "h", names[:-1] + ["zebra"]),
                      Entry("c", other, x, "h"), Entry("t", _model(2), x, "elsewhere")])
    rows = {r["name"]: r for r in result["dictionaries"]}
    assert result["matches"]["a"]["b"] == 1.0 and result["matches"]["b"]["a"] == 1.0
    assert "t" not in result["matches"]["a"] and rows["t"]["unique_latents"] is None  # another space
    assert rows["a"]["unique_latents"] == 0 and rows["c"]["unique_latents"] > 0
    live_last = rows["a"]["metrics"]["dead_fraction"] < 1
    assert rows["b"]["unique_names"]["examples"] == (["zebra"] if live_last else [])
    assert rows["c"]["unique_names"] is None  # not named
    assert 0 <= rows["a"]["weights"]["split_fraction"] <= 1
    assert rows["a"]["weights"]["encoder_decoder_cosine_mean"] == pytest.approx(1.0)  # tied at initialisation
    text = comparison_table(result)
    assert text.splitlines()[0].startswith("dictionary") and len(text.splitlines()) == 6
    page = render_comparison(result | {"dictionaries": [rows["a"] | {"name": "<b>x</b>"}], "frontier": []})
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<script" not in page and "http" not in page.split("</head>")[1]


@pytest.mark.unit
def test_a_set_of_per_layer_transcoders_is_one_row_matched_layer_by_layer():
    """A `train --layers` set is one entry: its evaluation combines its layers (L0 the sum, FVU per layer), and each
    layer's latents are matched only in that layer's space: with the same layer of another set, or a dictionary of
    that hookpoint."""
    from conceptdict.saes import evaluate

    def tc(seed: int) -> SparseCoder:
        m = SparseCoder(8, 24, 3, "transcoder")
        g = torch.Generator().manual_seed(seed)
        m.reset_parameters(g)
        with torch.no_grad():
            m.W_dec.copy_(torch.randn(24, 8, generator=g))
        return m

    x = [torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def plts(name: str, seeds: tuple[int, int]) -> Entry:
        layers = [Entry(f"{name}/{l}", tc(s), x, f"out{l}") for l, s in enumerate(seeds)]
        return Entry(name, layers[0].model, x, "out1", layers=layers)

    result = compare([plts("a", (0, 1)), plts("b", (0, 2)), Entry("one", tc(1), x, "out1")])
    rows, m = {r["name"]: r for r in result["dictionaries"]}, result["matches"]
    live = [sum(d > 0 for d in evaluate(tc(s), x).density) for s in (0, 1)]
    assert rows["a"]["kind"] == "transcoder x 2 layers" and rows["a"]["n_latents"] == 48
    assert rows["a"]["metrics"]["l0"] == pytest.approx(6.0) and len(rows["a"]["metrics"]["per_source_fvu"]) == 2
    assert rows["a"]["live_latents"] == sum(live)
    assert m["one"]["a"] == 1.0  # its latents are a's layer 1
    assert m["a"]["one"] == pytest.approx(live[1] / sum(live))  # a's layer 0 has no peer in "one"
    assert live[0] / sum(live) <= m["a"]["b"] < 1.0  # layer 0 the same in both sets, layer 1 not
    assert rows["a"]["unique_latents"] == 0 and rows["b"]["unique_latents"] > 0


# -- the command line ---------------------------------------------------------------------------------

@pytest.mark.integration
def test_compare_numbers_equal_eval_numbers(tmp_path, planted_store, capsys):
    fast = ["--kernel-impl", "reference", "--batch-size", "256", "--eval-batches", "2", "--latents", "32"]
    assert main(["train", "--store", str(planted_store), "--out", str(tmp_path / "s"), *fast, "--k", "3",
                 "--sweep", "kind=topk,batchtopk"]) == 0
    dicts = [tmp_path / "s" / "kind-batchtopk", tmp_path / "s" / "kind-topk"]
    assert main(["compare", *map(str, dicts), "--store", str(planted_store), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "2 dictionaries on 512 rows" in out and "held out" in out
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    for d, row in zip(dicts, result["dictionaries"]):
        assert main(["eval", str(d)]) == 0
        want = json.loads((d / "eval.json").read_text())["metrics"]
        got = row["metrics"]
        for key in ("n_tokens", "l0", "mse", "fvu", "explained_variance", "explained_variance_saebench", "cos_sim",
                    "dead_fraction", "dense_fraction", "density_histogram"):
            assert got[key] == want[key], (d.name, key)
    assert (tmp_path / "cmp" / "index.html").read_text().count("<tr") >= 3
    assert result["matches"]["kind-batchtopk"]["kind-topk"] >= 0


@pytest.mark.integration
def test_compare_on_the_demo_dictionaries_renders(tmp_path, monkeypatch, capsys):
    """The demo's TopK sentence dictionary (named by the demo) beside a BatchTopK one trained and named here."""
    from test_report import OFFLINE_FLAGS, chromium_binary

    from conceptdict import demo_api as demo

    monkeypatch.setattr(demo, "STEPS", demo.STEPS[:3])  # cache, train, name
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--fast"]) == 0
    assert main(["train", "--store", str(out / "store"), "--out", str(tmp_path / "btk"), "--latents", "128",
                 "--k", "8", "--batch-size", "64", "--tokens", "4096", "--kind", "batchtopk"]) == 0
    assert main(["name", str(tmp_path / "btk"), "--vocab", "wordfreq:en:3000", "--out", str(tmp_path / "names")]) == 0
    capsys.readouterr()
    assert main(["compare", str(out / "concepts"), str(tmp_path / "names"), "--store", str(out / "store"),
                 "--out", str(tmp_path / "cmp")]) == 0
    text = capsys.readouterr().out
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["kind"] for r in result["dictionaries"]] == ["topk", "batchtopk"]
    assert all(r["unique_names"] is not None for r in result["dictionaries"]) and "names only" in text
    assert result["frontier"]
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    index = tmp_path / "cmp" / "index.html"
    common = [binary, *OFFLINE_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    shot = tmp_path / "shot.png"
    run = subprocess.run([*common, f"--screenshot={shot}", index.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, run.stderr.decode()[-2000:]
    dom = subprocess.run([*common, "--dump-dom", index.as_uri()], capture_output=True, timeout=120).stdout.decode()
    assert "FVU-L0 frontier" in dom and "<circle" in dom and "<script" not in dom.lower()


@pytest.mark.integration
def test_eval_and_compare_take_every_single_source_kind(tmp_path, planted_store, capsys):
    """A sweep over every trainable kind that reads one hookpoint (crosscoders: tests/test_crosscoder_eval.py;
    transcoders read two: tests/test_transcoder.py), then eval and compare on all of them: finite figures, the
    same numbers both ways."""
    import math

    from conceptdict.saes.kinds import KINDS

    kinds = [k for k, s in KINDS.items() if s.trainable and s.sources == "one"]
    assert {"topk", "batchtopk", "relu", "jumprelu", "matryoshka", "spade"} <= set(kinds)
    fast = ["--kernel-impl", "reference", "--batch-size", "256", "--eval-batches", "2", "--latents", "32", "--k", "3",
            "--tokens", str(40 * 256), "--checkpoint-every", "0"]
    assert main(["train", "--store", str(planted_store), "--out", str(tmp_path / "s"), *fast,
                 "--sweep", f"kind={','.join(kinds)}"]) == 0
    dicts = [tmp_path / "s" / f"kind-{k}" for k in kinds]
    capsys.readouterr()
    assert main(["compare", *map(str, dicts), "--store", str(planted_store), "--out", str(tmp_path / "cmp")]) == 0
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())["dictionaries"]
    assert [r["kind"] for r in rows] == kinds
    for d, row in zip(dicts, rows):
        assert main(["eval", str(d)]) == 0, d.name
        got = json.loads((d / "eval.json").read_text())["metrics"]
        assert math.isfinite(got["fvu"]) and got["fvu"] < 1.0 and got["l0"] > 0, (d.name, got["fvu"], got["l0"])
        assert row["metrics"]["fvu"] == got["fvu"] and row["metrics"]["l0"] == got["l0"], d.name
