"""`eval` and `compare` measure crosscoders (e.g. the one `conceptdict diff` trains over two stores): FVU per source
and overall, L0, dead latents, and the live latents per diff tag, through the API and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.saes import load_dictionary
from conceptdict.saes.diffing import decoder_table
from fixtures_planted import planted_pair_stores

pytestmark = pytest.mark.integration

ROWS = 2048


@pytest.fixture(scope="module")
def diffed(tmp_path_factory):
    """A tiny crosscoder trained by cd.diff over two stores (planted A and B rows with B-only atoms)."""
    tmp = tmp_path_factory.mktemp("cc")
    stores, x = planted_pair_stores(tmp, 16)  # [4096, 2, 16]
    cd.diff(store=stores, out=tmp / "diff", latents=32, k=3, batch_size=128, tokens=4096, eval_batches=2,
            checkpoint_every=0, seed=0, device="cpu")
    return tmp / "diff" / "crosscoder", stores, x


def _direct_fvu(model, x):
    """FVU of each source computed here from the first rows: sum |x_s - x_hat_s|^2 / sum |x_s - mean x_s|^2."""
    with torch.no_grad():
        x_hat = model.decode(model.encode(x))
    err = (x - x_hat).double().pow(2).sum(dim=(0, 2))
    var = (x.double() - x.double().mean(0)).pow(2).sum(dim=(0, 2))
    return (err / var).tolist(), float(err.sum() / var.sum())


def test_eval_measures_a_crosscoder_per_source(diffed, tmp_path):
    cc, stores, x = diffed
    ev = cd.evaluate(cc, rows=ROWS, rows_from="start", batch_size=500, out=tmp_path / "eval.json")
    model = load_dictionary(cc)
    per_source, overall = _direct_fvu(model, x[:ROWS])
    m = ev.metrics
    assert m.n_tokens == ROWS and len(m.per_source_fvu) == 2
    assert all(np.isfinite(m.per_source_fvu))
    assert list(m.per_source_fvu) == pytest.approx(per_source, rel=1e-4)
    assert m.fvu == pytest.approx(overall, rel=1e-4)
    live = sum(1 for d in m.density if d > 0)
    assert sum(ev.latent_tags.values()) == live == round((1 - m.dead_fraction) * m.n_latents)
    tags = decoder_table(model).tags
    assert ev.latent_tags["B-only"] == sum(1 for t, d in zip(tags, m.density) if t == "B-only" and d > 0) > 0
    text = ev.format(cc)
    assert "FVU source 1" in text and "only source 1 (B-only)" in text
    doc = json.loads((tmp_path / "eval.json").read_text())
    assert doc["latent_tags"] == ev.latent_tags and doc["store"] == [str(s) for s in stores]
    # held-out rows by default: diff recorded the batches its training held out
    assert cd.evaluate(cc, out=tmp_path / "h.json").rows_from == "training's held-out batches"


def test_eval_and_compare_a_crosscoder_through_the_cli(diffed, tmp_path, capsys):
    cc, stores, x = diffed
    argv = ["eval", str(cc), "--store", str(stores[0]), "--store-b", str(stores[1]), "--rows", str(ROWS),
            "--rows-from", "start", "--out", str(tmp_path / "eval.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FVU source 0" in out and "live latents by decoder norms" in out
    doc = json.loads((tmp_path / "eval.json").read_text())
    assert doc["metrics"]["per_source_fvu"] == pytest.approx(_direct_fvu(load_dictionary(cc), x[:ROWS])[0], rel=1e-4)
    # compare: the crosscoder against itself (same rows, so the same numbers twice and every latent matched)
    assert main(["compare", str(cc), str(cc), "--store", str(stores[0]), "--store-b", str(stores[1]),
                 "--rows", str(ROWS), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "FVU per source" in printed and "only source 0 (A-only)" in printed
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    a, b = result["dictionaries"]
    assert a["metrics"]["per_source_fvu"] == b["metrics"]["per_source_fvu"]
    assert all(np.isfinite(a["metrics"]["per_source_fvu"]))
    assert sum(a["latent_tags"].values()) == a["live_latents"] and a["latent_tags"] == b["latent_tags"]
    assert result["matches"][a["name"]][b["name"]] == 1.0
    # the API gives the same comparison
    cmp = cd.compare([cc, cc], store=stores[0], store_b=stores[1], rows=ROWS, out=tmp_path / "cmp2")
    assert cmp.result["dictionaries"][0]["metrics"]["per_source_fvu"] == a["metrics"]["per_source_fvu"]


def test_crosscoder_flags_are_checked(diffed, tmp_path, capsys):
    cc, stores, _ = diffed
    assert main(["eval", str(cc), "--hookpoint", "nope", "--out", str(tmp_path / "e.json")]) == 1
    assert "nope" in capsys.readouterr().err
    single = tmp_path / "sae"
    cd.train(store=stores[0], latents=16, k=2, tokens=1024, batch_size=128, eval_batches=1, checkpoint_every=0,
             out=single, device="cpu")
    assert main(["eval", str(single), "--store-b", str(stores[1])]) == 1
    assert "drop --store-b" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["crosscoder-absolute", "crosscoder-l1"])
def test_eval_measures_every_crosscoder_kind(diffed, tmp_path, kind):
    """The other crosscoder kinds (the default one is measured above) evaluate the same way."""
    _, stores, x = diffed
    cd.diff(store=stores, out=tmp_path / "diff", kind=kind, latents=32, k=3, batch_size=128, tokens=2048,
            eval_batches=1, checkpoint_every=0, seed=0, device="cpu")
    ev = cd.evaluate(tmp_path / "diff" / "crosscoder", rows=512, rows_from="start", out=tmp_path / "eval.json")
    assert ev.metrics.kind == kind
    assert list(ev.metrics.per_source_fvu) == pytest.approx(
        _direct_fvu(load_dictionary(tmp_path / "diff" / "crosscoder"), x[:512])[0], rel=1e-4)
    assert sum(ev.latent_tags.values()) == sum(1 for d in ev.metrics.density if d > 0)
