"""``cd.__version__`` and ``conceptdict --version``: the installed distribution's version, read without importing
a stage (issue 51)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

import conceptdict
from conceptdict.cli.main import main

pytestmark = pytest.mark.unit


def test_version_is_the_installed_distributions():
    assert conceptdict.__version__ == importlib.metadata.version("conceptdict")
    assert "__version__" in dir(conceptdict)


def test_version_imports_no_stage_and_no_torch():
    """A fresh interpreter: ``import conceptdict`` and its ``__version__`` load neither torch nor a stage."""
    code = ("import json, sys, conceptdict; v = conceptdict.__version__; "
            "print(json.dumps([v, sorted(m for m in sys.modules if m == 'torch' or m.startswith('conceptdict.'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    version, loaded = json.loads(out)
    assert version == importlib.metadata.version("conceptdict")
    assert loaded == [], f"cd.__version__ imported {loaded}"


def test_version_without_distribution_metadata(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.delitem(vars(conceptdict), "__version__", raising=False)
    assert conceptdict.__version__ == conceptdict.UNKNOWN_VERSION == "0+unknown"
    monkeypatch.delitem(vars(conceptdict), "__version__")  # the next reader gets the real one again


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"conceptdict {importlib.metadata.version('conceptdict')}"
