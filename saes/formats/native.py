"""This project's own layout (``saes.artifact``), as one entry of the format table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifact import CONFIG_FILE, FORMAT, INDEX_FILE, WEIGHTS_FILE, load_native, load_native_config
from .common import Loaded
from .files import read_json

NEEDS = f"{CONFIG_FILE} with format {FORMAT!r} + {WEIGHTS_FILE} (or {INDEX_FILE} and the files it names)"


def matches(directory: Path) -> bool:
    path = directory / CONFIG_FILE
    return path.exists() and read_json(path).get("format") == FORMAT


def read_config(directory: Path) -> dict[str, Any]:
    return load_native_config(directory)


def read(directory: Path) -> Loaded:
    return Loaded(load_native(directory), load_native_config(directory))
