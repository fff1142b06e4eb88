"""`conceptdict cbsae` and ``cd.cbsae`` as docs/guide/concepts.md writes them, on the tiny sentence store (issue 50:
both were a TypeError, the API's positional and the ``concepts`` setting sharing a name)."""

from __future__ import annotations

import functools
import json
import re
import shlex
import types
from pathlib import Path

import pytest
import torch

from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "concepts.md"
FAST = {"steps": 100}
"""The bottleneck's Adam steps (default 3000): the guide's calls with this one setting added, to stay fast."""


def _guide_blocks() -> tuple[list[str], str]:
    """(the CB-SAE section's command argv, its Python block)."""
    section = GUIDE.read_text().split("## CB-SAE", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (argv,) = [shlex.split(line) for line in bash.splitlines() if line.startswith("conceptdict ")]
    return argv, python


@pytest.fixture(scope="module")
def quick(tiny_sentence_store, tmp_path_factory):
    """A working directory holding runs/quick/concepts (named and scored) and my-concepts.txt, as the guide has."""
    from conceptdict.saes import SparseCoder, save_dictionary

    store_dir, model_dir = tiny_sentence_store
    root = tmp_path_factory.mktemp("guide_cbsae")
    torch.manual_seed(0)
    sae = save_dictionary(SparseCoder(32, 16, 4, kind="topk"), root / "sae",
                          extra={"stores": [str(store_dir)], "hookpoints": ["sentence.mean_normalized"]})
    (root / "words.txt").write_text("cat\ndog\nrain\nsnow\nbread\ncheese\nthe\nof\n")
    concepts = root / "runs" / "quick" / "concepts"
    assert main(["name", str(sae), "--vocab", str(root / "words.txt"), "--model", str(model_dir),
                 "--cache-dir", str(root / "cache"), "--out", str(concepts)]) == 0  # fmt: skip
    assert main(["score", str(concepts)]) == 0
    (root / "my-concepts.txt").write_text("cat\nweather\n")
    return root


def test_cbsae_command_runs_as_the_guide_writes_it(quick, monkeypatch, capsys):
    argv, _ = _guide_blocks()
    monkeypatch.chdir(quick)
    assert main([*argv[1:], "--steps", str(FAST["steps"])]) == 0, capsys.readouterr().err
    out = Path(argv[argv.index("--out") + 1])
    assert "added" in capsys.readouterr().out
    doc = json.loads((out / "cbsae.json").read_text())
    assert doc["source"] == "runs/quick/concepts" and doc["config"]["concepts"] == "my-concepts.txt"
    assert (out / "dictionary" / "config.json").exists() and (out / "concepts" / "concepts.json").exists()


def test_cbsae_python_line_runs_as_the_guide_writes_it(quick, monkeypatch):
    import conceptdict

    _, code = _guide_blocks()
    monkeypatch.chdir(quick)
    guide_cd = types.SimpleNamespace(cbsae=functools.partial(conceptdict.cbsae, **FAST))
    scope = {"cd": guide_cd}
    exec(compile(code, f"{GUIDE.name} (CB-SAE)", "exec"), scope)
    result = scope["result"]
    assert result.dictionary == Path("runs/quick/cbsae/dictionary") and result.summary["n_added"] >= 1


def test_cbsae_with_every_listed_concept_present_prunes_and_adds_nothing(quick, monkeypatch, capsys):
    """A concept list whose concepts the dictionary has already (a kept latent's own name) was a traceback deep in
    the bottleneck's training (the quantile of zero concepts); it is the pruned dictionary with nothing added."""
    argv, _ = _guide_blocks()
    monkeypatch.chdir(quick)
    concepts = json.loads(Path("runs/quick/concepts/concepts.json").read_text())["concepts"]
    def score(c):
        return ((c.get("scores") or {}).get("embedding") or {}).get("score") or 0.0

    kept = [c["name"] for c in concepts if score(c) >= 0.7]
    assert kept, "the fixture's dictionary keeps no latent; the test needs one"
    Path("present.txt").write_text(kept[0] + "\n")
    out = "runs/quick/cbsae-present"
    args = [*argv[1:], "--steps", str(FAST["steps"])]
    args[args.index("my-concepts.txt")], args[args.index("--out") + 1] = "present.txt", out
    assert main(args) == 0, capsys.readouterr().err
    doc = json.loads((Path(out) / "cbsae.json").read_text())
    assert doc["n_added"] == 0 and doc["added"] == [] and list(doc["present"]) == [kept[0]]
    assert doc["n_kept"] == json.loads((Path(out) / "dictionary" / "config.json").read_text())["n_latents"]
