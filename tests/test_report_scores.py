"""The report's score pages: sorted by confidence or by a scorer, CSS-only band filters, escaping, and
rendering in headless Chromium (skipped without a chromium binary)."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
from test_report import EVIL, OFFLINE_FLAGS, _dictionary, chromium_binary

from conceptdict.naming.reports.report import write_report

SCORES = [0.95, 0.7, 0.5, None, 0.85, 0.65, None]


def _scored():
    cd = _dictionary()
    concepts = []
    for c, s in zip(cd.concepts, SCORES):
        if s is None:
            concepts.append(c)
            continue
        emb = {"score": s, "auroc": s, "negatives": "random+hard"}
        det = {"score": 1.0 - s, "balanced_accuracy": 1.0 - s, "negatives": "random+hard"}
        names = {"vocab": {"name": c.name, "score": c.score, "scores": {"embedding": emb}},
                 "context": {"name": EVIL if c.id == 1 else f"ctx {c.id}", "score": 0.2, "scores": {}}}  # fmt: skip
        concepts.append(dataclasses.replace(c, scores={"embedding": emb, "detection": det}, names=names,
                                            confidence=s - 0.1))  # fmt: skip
    meta = {**cd.meta, "scoring": {"scorers": ["embedding", "detection"], "namers": ["vocab", "context"],
                                   "negatives": {"kinds": "random+hard"}}}  # fmt: skip
    return dataclasses.replace(cd, concepts=tuple(concepts), meta=meta)


def _ids(html):
    return [int(i) for i in re.findall(r'<tr class="r b-\w+"><td><a href="[^"]*#c(\d+)"', html)]


@pytest.mark.unit
def test_score_pages_sort_band_and_escape(tmp_path):
    write_report(_scored(), tmp_path)
    by_conf = (tmp_path / "scores.html").read_text()
    assert _ids(by_conf) == [0, 4, 1, 5, 2, 3, 6]  # confidence high to low, unscored last
    by_det = (tmp_path / "scores-by-detection.html").read_text()
    assert _ids(by_det) == [2, 5, 1, 4, 0, 3, 6]
    assert 'class="r b-hi"><td><a href="index.html#c0"' in by_conf  # 0.85 confidence -> band hi
    assert re.search(r'class="r b-none"><td><a href="[^"]*#c3"', by_conf)
    for page in tmp_path.glob("*.html"):
        assert "<script" not in page.read_text().lower(), page.name
    assert "context: &lt;script&gt;" in by_conf
    index = (tmp_path / "index.html").read_text()
    assert 'href="scores.html"' in index and "embedding 0.950 (random+hard negatives)" in index
    assert "confidence 0.85" in index and "namers: vocab:" in index


@pytest.mark.unit
def test_unscored_dictionaries_get_no_score_pages(tmp_path):
    write_report(_dictionary(), tmp_path)
    assert not (tmp_path / "scores.html").exists()
    assert "scores.html" not in (tmp_path / "index.html").read_text()


@pytest.mark.integration
def test_score_pages_render_and_filter_in_headless_chromium(tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    cd = _scored()
    cd = dataclasses.replace(cd, concepts=cd.concepts * 1)
    index = write_report(cd, tmp_path / "report")
    scores = index.parent / "scores.html"
    common = [binary, *OFFLINE_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700"]
    shots = {}
    for frag in ("", "#hi", "#lo"):
        shot = tmp_path / f"shot{frag.strip('#')}.png"
        run = subprocess.run([*common, f"--screenshot={shot}", scores.as_uri() + frag], capture_output=True,
                             timeout=120)  # fmt: skip
        assert shot.exists() and shot.stat().st_size > 5_000, run.stderr.decode()[-2000:]
        shots[frag] = shot.read_bytes()
    assert shots[""] != shots["#hi"] != shots["#lo"]  # the filter hides rows
    dom = subprocess.run([*common, "--dump-dom", scores.as_uri()], capture_output=True, timeout=120).stdout.decode()
    assert dom.count('<tr class="r ') == len(cd.concepts) and "<script" not in dom.lower()
