"""Stage configs -> flags and strict config files."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Literal

import pytest

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

pytestmark = pytest.mark.unit


def _help(text: str, **kwargs):
    return dataclasses.field(metadata={"help": text, **kwargs.pop("metadata", {})}, **kwargs)


@dataclasses.dataclass
class Inner:
    k: int = _help("Latents kept per row.", default=32)


@dataclasses.dataclass
class Demo:
    out: Path = _help("Where to write.")
    hookpoints: list[str] = _help("Capture sites; repeat the flag for several.", default_factory=list,
                                  metadata={"flag": "hookpoint"})
    context_length: int = _help("Tokens per context.", default=128)
    dtype: Literal["float32", "float16", "bfloat16"] = _help("Storage dtype.", default="float32")
    overwrite: bool = _help("Replace an existing store.", default=False)
    sae: Inner = _help("Nested settings.", default_factory=Inner)


def _parse(argv, config_file=None):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Demo)
    return build_config(Demo, p.parse_args(argv), config_file)


def test_declared_help_becomes_flag_help():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Demo)
    help_text = p.format_help()
    assert "--context-length" in help_text and "Tokens per context." in help_text
    assert "--hookpoint" in help_text and "--sae.k" in help_text


def test_flags_parse_to_typed_config(tmp_path):
    cfg = _parse(["--out", str(tmp_path), "--hookpoint", "a", "--hookpoint", "b", "--context-length", "16",
                  "--dtype", "bfloat16", "--overwrite", "--sae.k", "4"])
    assert cfg == Demo(out=tmp_path, hookpoints=["a", "b"], context_length=16, dtype="bfloat16",
                       overwrite=True, sae=Inner(k=4))


def test_flags_override_config_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"out": "x", "context_length": 8, "sae": {"k": 3}}))
    cfg = _parse(["--context-length", "9"], f)
    assert cfg.out == Path("x") and cfg.context_length == 9 and cfg.sae.k == 3


def test_unknown_key_names_closest(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"out": "x", "context_lenght": 8}))
    with pytest.raises(ConfigError, match="did you mean 'context_length'"):
        _parse([], f)
    f.write_text(json.dumps({"out": "x", "sae": {"kk": 8}}))
    with pytest.raises(ConfigError, match=r"sae.*did you mean 'k'"):
        _parse([], f)


def test_bad_choice_is_rejected(capsys):
    with pytest.raises(SystemExit):
        _parse(["--out", "x", "--dtype", "float64"])
    assert "invalid choice" in capsys.readouterr().err


def test_resolved_config_round_trips(tmp_path):
    cfg = _parse(["--out", str(tmp_path), "--hookpoint", "h"])
    path = write_resolved_config(cfg, tmp_path)
    assert json.loads(path.read_text())["hookpoints"] == ["h"]
    again = _parse([], path)
    assert again == cfg
