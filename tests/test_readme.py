"""The README's walkthrough commands run as written (DESIGN.md: README commands are executed by a test)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-walkthrough -->"
QUICKSTART = "## Quickstart: command line"
PYTHON = "<!-- readme-python -->"


def _block(after: str, lang: str = "bash", path: Path = ROOT / "README.md") -> str:
    text = path.read_text()
    assert after in text, f"{path.name} lost {after!r}"
    block = re.search(rf"```{lang}\n(.*?)```", text[text.index(after):], re.S)
    assert block, f"no ```{lang} block after {after!r}"
    return block.group(1)


def walkthrough_commands(after: str = MARK) -> list[list[str]]:
    """The bash block right after ``after``, one argv per command (backslash lines joined)."""
    joined = _block(after).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.unit
def test_walkthrough_covers_every_stage():
    commands = [argv[1] for argv in walkthrough_commands()]
    assert all(argv[0] == "conceptdict" for argv in walkthrough_commands())
    for stage in ("cache", "store", "train", "eval", "name", "show", "cbm", "export"):
        assert stage in commands, f"the README walkthrough no longer shows `conceptdict {stage}`"


TRAINING_WARNINGS = ("will train only", "memorised the store's rows")
"""The warnings of a run too short to learn (api/train_run.py) or one that fit its rows (saes/stopping.py): the
README's sizes must trip neither."""


def _run_commands(commands: list[list[str]], tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("conceptdict")
    env = dict(os.environ, CONCEPTDICT_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    for argv in commands:
        proc = subprocess.run([str(exe), *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"`{shlex.join(argv)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        if argv[1] == "train":
            said = [w for w in TRAINING_WARNINGS if w in proc.stderr]
            assert not said, f"`{shlex.join(argv)}` warns {said}; change the README's sizes:\n{proc.stderr[-3000:]}"


@pytest.mark.integration
def test_walkthrough_runs(tmp_path):
    _run_commands(walkthrough_commands(), tmp_path)
    quick = tmp_path / "runs" / "quick"
    assert (quick / "store" / "manifest.json").exists()
    assert (quick / "sae" / "weights.safetensors").exists() and (quick / "sae" / "eval.json").exists()
    assert (quick / "concepts" / "concepts.json").exists()
    assert (quick / "report" / "index.html").exists()
    assert (quick / "saelens" / "cfg.json").exists() and (quick / "saelens" / "sae_weights.safetensors").exists()
    # the default model is named by its hub id in what other tools read, not by the bundled copy's path
    saelens_cfg = json.loads((quick / "saelens" / "cfg.json").read_text())
    assert saelens_cfg["metadata"]["model_name"] == "sentence-transformers/all-MiniLM-L6-v2"


@pytest.mark.integration
@pytest.mark.slow  # .ci/run runs it (make test-slow); its commands are a subset of the walkthrough's, run above
def test_cli_quickstart_runs(tmp_path):
    commands = walkthrough_commands(QUICKSTART)
    assert len(commands) <= 10 and {argv[1] for argv in commands} >= {"cache", "train", "name", "cbm"}
    _run_commands(commands, tmp_path)
    assert (tmp_path / "runs" / "start" / "report" / "index.html").exists()


@pytest.mark.integration
def test_python_quickstart_runs(tmp_path, monkeypatch, caplog):
    """The README's Python quickstart, executed as written (in a fresh working directory)."""
    code = _block(PYTHON, "python")
    assert len(code.strip().splitlines()) <= 12, "the Python quickstart grew past ten lines"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONCEPTDICT_CACHE", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="conceptdict"):
        exec(compile(code, "README.md (Python quickstart)", "exec"), {"__name__": "__readme__"})
    said = [w for w in TRAINING_WARNINGS if w in caplog.text]
    assert not said, f"the Python quickstart's train warns {said}; change its sizes"
    assert (tmp_path / "runs" / "py" / "cbm" / "cbm.json").exists()


@pytest.mark.unit
def test_both_quickstarts_come_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it under 200 (details go to docs/guide/)"
    for marker in (QUICKSTART, PYTHON):
        assert next(i for i, line in enumerate(lines) if line.startswith(marker)) < 60


IMAGES = "## Images: Discover-then-Name as published"


@pytest.mark.unit
def test_image_recipe_parses_with_the_current_flags():
    """The hub recipe cannot run offline (tests/test_vision_cli.py runs the same commands on a tiny CLIP); every
    command and flag in it must still exist."""
    from conceptdict.cli.main import build_parser

    block = _block(IMAGES, path=ROOT / "docs" / "guide" / "vision.md").replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [argv[1] for argv in commands] == ["cache", "train", "name", "cache", "cbm"]
    for argv in commands:
        args, rest = build_parser(argv[1]).parse_known_args(argv[1:])
        assert not rest, f"`{shlex.join(argv)}`: unknown arguments {rest}"
