"""The README's walkthrough commands run as written (DESIGN.md: README commands are executed by a test)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-walkthrough -->"


def walkthrough_commands() -> list[list[str]]:
    """The bash block right after the walkthrough marker, one argv per command (backslash lines joined)."""
    text = (ROOT / "README.md").read_text()
    assert MARK in text, "README.md lost its walkthrough marker"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARK):], re.S)
    assert block, "no ```bash block after the walkthrough marker"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.unit
def test_walkthrough_covers_every_stage():
    commands = [argv[1] for argv in walkthrough_commands()]
    assert all(argv[0] == "conceptdict" for argv in walkthrough_commands())
    for stage in ("cache", "store", "train", "eval", "name", "show", "cbm", "export"):
        assert stage in commands, f"the README walkthrough no longer shows `conceptdict {stage}`"


@pytest.mark.integration
def test_walkthrough_runs(tmp_path):
    exe = Path(sys.executable).with_name("conceptdict")
    env = dict(os.environ, CONCEPTDICT_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    for argv in walkthrough_commands():
        proc = subprocess.run([str(exe), *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"`{shlex.join(argv)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    quick = tmp_path / "runs" / "quick"
    assert (quick / "store" / "manifest.json").exists()
    assert (quick / "sae" / "weights.safetensors").exists() and (quick / "sae" / "eval.json").exists()
    assert (quick / "concepts" / "concepts.json").exists()
    assert (quick / "report" / "index.html").exists()
    assert (quick / "saelens" / "cfg.json").exists() and (quick / "saelens" / "sae_weights.safetensors").exists()


IMAGES = "## Images: Discover-then-Name as published"


@pytest.mark.unit
def test_image_recipe_parses_with_the_current_flags():
    """The hub recipe cannot run offline (tests/test_vision_cli.py runs the same commands on a tiny CLIP); every
    command and flag in it must still exist."""
    from conceptdict.cli.main import build_parser

    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(IMAGES):], re.S).group(1).replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [argv[1] for argv in commands] == ["cache", "train", "name", "cache", "cbm"]
    for argv in commands:
        args, rest = build_parser(argv[1]).parse_known_args(argv[1:])
        assert not rest, f"`{shlex.join(argv)}`: unknown arguments {rest}"
