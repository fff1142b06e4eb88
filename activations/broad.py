"""Broad text that exists wherever conceptdict runs: the docstrings of the running Python's standard library and of
every package installed beside it, parsed from source (nothing is imported). The broad dictionary
(``conceptdict broad``, ``cd.broad_dictionary``) is trained on it."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import inspect
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from conceptdict.activations.data import docstrings_of

SKIP_PARTS = {"test", "tests", "testing", "idle_test", "_vendor", "vendor", "__pycache__", "turtledemo",
              "site-packages", "dist-packages", "examples"}
MIN_CHARS, MAX_CHARS, MIN_WORDS = 40, 600, 5
PER_PACKAGE = 1500
"""At most this many texts from one top-level package or standard-library module (spread over its files)."""
MAX_TEXTS = 40000
"""At most this many texts in all (spread over the packages)."""


def source_roots() -> list[tuple[str, Path]]:
    """("stdlib" | "packages", directory) of the running Python, each directory once."""
    paths = sysconfig.get_paths()
    roots, seen = [], set()
    for kind, path in [("stdlib", paths["stdlib"]), ("packages", paths["purelib"]), ("packages", paths["platlib"])]:
        p = Path(path).resolve()
        if p.is_dir() and p not in seen:
            seen.add(p)
            roots.append((kind, p))
    return roots


def summary_paragraph(doc: str) -> str | None:
    """The first paragraph of a docstring, whitespace collapsed; None when it is too short to say anything."""
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    if len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return None
    return text[:MAX_CHARS]


def _texts_of(root: Path, top: Path) -> Iterator[str]:
    files = [top] if top.is_file() else sorted(top.rglob("*.py"))
    for path in files:
        if SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for doc in docstrings_of(tree):
            text = summary_paragraph(doc)
            if text:
                yield text


def _spread(items: list, cap: int) -> list:
    """``cap`` of ``items`` (all of them when fewer), evenly spaced over the whole list (deterministic)."""
    return items if len(items) <= cap else [items[i * len(items) // cap] for i in range(cap)]


def broad_texts(per_package: int = PER_PACKAGE, max_texts: int = MAX_TEXTS,
                roots: list[tuple[str, Path]] | None = None) -> list[dict]:
    """``{"text", "source", "package"}`` records: the summary paragraph of every docstring under ``roots``
    (default :func:`source_roots`), unique, at most ``per_package`` per top-level package and ``max_texts`` in
    all; deterministic for a given set of installed packages."""
    seen: set[str] = set()
    groups = []
    for kind, root in roots if roots is not None else source_roots():
        for top in sorted(root.iterdir()):
            name = top.stem if top.suffix == ".py" else top.name
            if not (top.suffix == ".py" or (top.is_dir() and "." not in top.name)) or name in SKIP_PARTS:
                continue
            texts = [t for t in dict.fromkeys(_texts_of(root, top)) if t not in seen]
            seen.update(texts)
            if texts:
                groups.append([{"text": t, "source": kind, "package": name} for t in _spread(texts, per_package)])
    records = [r for g in groups for r in g]
    return _spread(records, max_texts)


def environment_key() -> str:
    """Hex digest of what :func:`broad_texts` reads: the Python version and every installed distribution's name
    and version (a new or upgraded package changes the broad texts, so it changes the key)."""
    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                    if d.metadata["Name"]})
    h = hashlib.sha256("\n".join([sys.version, *dists]).encode())
    return h.hexdigest()[:16]
