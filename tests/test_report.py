"""The HTML report: escaping of every data string, pages, CBM pages, and rendering in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from conceptdict.naming.bottleneck.cbm import CbmConfig, train_cbm
from conceptdict.naming.concepts import Concept, ConceptDictionary, Example
from conceptdict.naming.reports.report import esc, histogram_svg, write_report

EVIL = "<script>alert('x')</script>"


def _dictionary(n=7, evil=True):
    concepts = []
    for j in range(n):
        ex = Example(row=j, activation=2.5 - 0.1 * j, tokens=("def", " f", "(", EVIL if evil else " x", ")", ":"),
                     marked=3, text="def f(" + (EVIL if evil else " x") + "):")  # fmt: skip
        seq = Example(row=100 + j, activation=0.5, tokens=(), marked=-1, text=f"Return the <b>{j}</b> & more")
        concepts.append(
            Concept(
                id=j, name=EVIL if (evil and j == 0) else f"concept {j}", score=0.31 + 0.01 * j,
                runner_ups=("alpha", '"quoted"'), runner_up_scores=(0.3, 0.29), namer="vocab",
                frequency=0.0 if j == n - 1 else 0.01 * (j + 1),
                stats={"max": 3.0, "mean_active": 1.2}, histogram={"edges": [0, 1, 2, 3], "counts": [5, 2, 1 + j]},
                top_examples=(ex, seq), logit_top=("<tok>",), logit_bottom=("&amp;",),
                extra={"dead": True} if j == n - 1 else {},
            )  # fmt: skip
        )
    return ConceptDictionary(tuple(concepts), torch.randn(n, 4), {"model": "m<1>", "hookpoint": "h", "namer": "vocab"})


def _cbm(cd):
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (60,), generator=gen)
    x = torch.rand(60, len(cd.concepts), generator=gen)
    x[:, 1] += y
    labels = ["<b>bold</b>" if v else "plain" for v in y.tolist()]
    return train_cbm(x, labels, cd.names, CbmConfig(lambdas=[0.01]), raw=x)


@pytest.mark.unit
def test_every_data_string_is_escaped(tmp_path):
    cd = _dictionary()
    index = write_report(cd, tmp_path, cbm=_cbm(cd), per_page=4)
    pages = sorted(tmp_path.glob("*.html"))
    names = {p.name for p in pages}
    assert {"index.html", "concepts-2.html", "cbm.html", "cbm-class-0.html", "cbm-class-1.html"} <= names
    for p in pages:
        text = p.read_text()
        assert "<script" not in text.lower(), p.name  # no script element at all, data or otherwise
        assert "<b>" not in text and "<tok>" not in text
    html = index.read_text() + (tmp_path / "concepts-2.html").read_text()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "<mark>&lt;script&gt;" in html  # the activating token is highlighted and shown as text
    assert "&amp;amp;" in html and "&quot;quoted&quot;" in html and "m&lt;1&gt;" in html
    assert "&lt;b&gt;bold&lt;/b&gt;" in (tmp_path / "cbm.html").read_text()


@pytest.mark.unit
def test_cards_order_and_histogram():
    svg = histogram_svg([0, 1, 2, 3], [4, 0, 1])
    assert svg.count("<rect") == 3 and svg.startswith("<svg")
    assert "never fires" in histogram_svg([0, 1], [0])
    assert esc('<a href="x">') == "&lt;a href=&quot;x&quot;&gt;"


@pytest.mark.unit
def test_most_frequent_concepts_come_first_and_dead_last(tmp_path):
    cd = _dictionary(evil=False)
    text = write_report(cd, tmp_path).read_text()
    ids = [int(i) for i in re.findall(r'id="c(\d+)"', text)]
    assert ids == [5, 4, 3, 2, 1, 0, 6]


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


OFFLINE_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


@pytest.mark.integration
def test_report_renders_in_headless_chromium(tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    cd = _dictionary()
    index = write_report(cd, tmp_path / "report", cbm=_cbm(cd))
    shot = tmp_path / "shot.png"
    common = [binary, *OFFLINE_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    run = subprocess.run([*common, f"--screenshot={shot}", index.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, run.stderr.decode()[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run([*common, "--dump-dom", index.as_uri()], capture_output=True, timeout=120).stdout.decode()
    assert 'id="c0"' in dom and "<script" not in dom.lower()
    assert "<mark>&lt;script&gt;alert('x')&lt;/script&gt;</mark>" in dom  # parsed as text, highlighted
