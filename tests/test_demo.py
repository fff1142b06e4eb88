"""``conceptdict demo --fast``: the cache step on the embedded default, the summary, and step reuse."""

from __future__ import annotations

import pytest

from conceptdict.activations import ActivationStore
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


def test_demo_fast_caches_prints_and_reuses(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--fast"]) == 0
    text = capsys.readouterr().out
    assert "cache   done" in text and "hookpoint   sentence.mean_normalized  D=384" in text
    store = ActivationStore(out / "store")
    assert store.level == "sequence" and len(set(store.labels("family"))) == 8
    assert 0 < ActivationStore(out / "store_tokens").num_rows <= 2048
    assert (out / "store" / "cache_config.json").exists()
    assert main(["demo", "--out", str(out), "--fast"]) == 0
    again = capsys.readouterr().out
    assert "cache   reused" in again and "sentence.mean_normalized" in again
