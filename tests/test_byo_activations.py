"""Bring your own activations: `store import --hookpoint`, and `diff` over two stores whose hookpoints differ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conceptdict.activations import ActivationStore
from conceptdict.cli.main import main

TRAIN = ["--latents", "32", "--k", "4", "--batch-size", "64", "--tokens", "3200", "--eval-batches", "1",
         "--checkpoint-every", "0"]


def _arrays(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.normal(size=(640, 16)).astype(np.float32)
    chat = base + 0.1 * rng.normal(size=base.shape).astype(np.float32)
    np.save(tmp_path / "base.npy", base)
    np.save(tmp_path / "chat.npy", chat)
    return tmp_path / "base.npy", tmp_path / "chat.npy"


@pytest.mark.unit
def test_import_names_the_hookpoint(tmp_path):
    base, _ = _arrays(tmp_path)
    assert main(["store", "import", str(base), "--out", str(tmp_path / "default")]) == 0
    assert ActivationStore(tmp_path / "default").hookpoints == ["base"]  # the file's stem, as before
    assert main(["store", "import", str(base), "--hookpoint", "blocks.6.hook_resid_post",
                 "--out", str(tmp_path / "named")]) == 0  # fmt: skip
    store = ActivationStore(tmp_path / "named")
    assert store.hookpoints == ["blocks.6.hook_resid_post"] and store.d_in("blocks.6.hook_resid_post") == 16
    assert main(["store", "import", str(base), "--hookpoint", "a", "--hookpoint", "b",
                 "--out", str(tmp_path / "bad")]) == 1  # fmt: skip


@pytest.mark.integration
def test_diff_runs_on_stores_imported_from_base_and_chat(tmp_path, capsys):
    base, chat = _arrays(tmp_path)
    for f in (base, chat):
        assert main(["store", "import", str(f), "--level", "sequence", "--out", str(tmp_path / f.stem)]) == 0
    out = tmp_path / "diff"
    # each store holds one hookpoint (base, chat): they are paired without flags
    assert main(["diff", "--store", str(tmp_path / "base"), "--store", str(tmp_path / "chat"), *TRAIN,
                 "--out", str(out)]) == 0, capsys.readouterr()  # fmt: skip
    doc = json.loads((out / "diff.json").read_text())
    assert doc["hookpoint"] == "base" and len(doc["latents"]) == 32
    cfg = json.loads((out / "crosscoder" / "config.json").read_text())
    assert cfg["store_hookpoints"] == ["base", "chat"]
    # and by name, the documented way
    assert main(["diff", "--store", str(tmp_path / "base"), "--store", str(tmp_path / "chat"), "--hookpoint", "base",
                 "--hookpoint-b", "chat", *TRAIN, "--out", str(tmp_path / "diff2")]) == 0  # fmt: skip
    rc = main(["diff", "--store", str(tmp_path / "base"), "--store", str(tmp_path / "chat"), "--hookpoint", "chat",
               *TRAIN, "--out", str(tmp_path / "diff3")])  # fmt: skip
    assert rc == 1 and "--hookpoint-b" in capsys.readouterr().err
