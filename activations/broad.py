"""Broad text that exists wherever conceptdict runs, for the broad dictionary (``conceptdict broad``,
``cd.broad_dictionary``): the docstrings of the running Python's standard library and of every package installed
beside it (parsed from source; nothing is imported), the man pages under ``/usr/share/man``, and the Debian
package synopses in the apt cache (``apt-cache dumpavail``: the package lists already on the machine). A source a
machine lacks (no man pages, no apt) is skipped.

A fixed half of the sources (docstring files, man pages, packages: :func:`held_out`) never enters the broad text,
nor does any text that one of them also holds: evaluations of the broad route (``bench/cbm_corpora.py``) draw their
labelled texts from that half, so no evaluation text, and no other text of its page, file or package, is in the
broad dictionary's training text."""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.metadata
import inspect
import re
import shutil
import subprocess
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
MAX_TEXTS = {"docstrings": 24000, "man": 16000, "apt": 32000}
"""At most this many texts of each kind of source (spread over the sources): about 4M tokens in all, a 15-minute
caching on 2 CPU cores."""
MAN_ROOT = Path("/usr/share/man")
MAN_SECTIONS = ("1", "2", "3", "4", "5", "6", "7", "8")
HELD_OUT_SHARE = 2
"""One source in this many (by :func:`held_out`) is kept out of the broad text for evaluations."""


def held_out(source: str) -> bool:
    """True for the sources the broad text never reads (one in :data:`HELD_OUT_SHARE`, fixed by a hash of the
    source's name: a docstring file's path below its site directory such as ``numpy/linalg/_linalg.py``, a man
    page's file name such as ``ls.1.gz``, a Debian package's name)."""
    return hashlib.sha256(source.encode()).digest()[0] % HELD_OUT_SHARE == 0


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


def clip(text: str, min_chars: int = MIN_CHARS, min_words: int = MIN_WORDS) -> str | None:
    """``text`` with its whitespace collapsed, cut at :data:`MAX_CHARS`; None when it is too short to say anything."""
    text = " ".join(text.split())
    if len(text) < min_chars or len(text.split()) < min_words:
        return None
    return text[:MAX_CHARS]


def summary_paragraph(doc: str) -> str | None:
    """The first paragraph of a docstring, whitespace collapsed; None when it is too short to say anything."""
    return clip(inspect.cleandoc(doc).split("\n\n")[0])


def docstring_texts(path: Path) -> Iterator[str]:
    """The summary paragraph of each docstring of the Python file ``path`` (module, then public classes and
    functions), skipping ones too short to say anything; nothing when the file does not parse."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError, OSError):
        return
    for doc in docstrings_of(tree):
        text = summary_paragraph(doc)
        if text:
            yield text


def _texts_of(root: Path, top: Path, keep) -> Iterator[tuple[bool, str]]:
    """(kept, text) of the docstrings under ``top``: kept is ``keep(path below the root)`` of the text's file."""
    files = [top] if top.is_file() else sorted(top.rglob("*.py"))
    for path in files:
        rel = path.relative_to(root)
        if not SKIP_PARTS & set(rel.parts):
            kept = keep(rel.as_posix())
            yield from ((kept, text) for text in docstring_texts(path))


def _spread(items: list, cap: int) -> list:
    """``cap`` of ``items`` (all of them when fewer), evenly spaced over the whole list (deterministic)."""
    return items if len(items) <= cap else [items[i * len(items) // cap] for i in range(cap)]


def _not_held_out(source: str) -> bool:
    return not held_out(source)


def docstring_records(per_package: int = PER_PACKAGE, max_texts: int = MAX_TEXTS["docstrings"],
                      roots: list[tuple[str, Path]] | None = None, keep=_not_held_out) -> list[dict]:
    """``{"text", "source", "package"}`` records: the summary paragraph of every docstring under ``roots`` (default
    :func:`source_roots`) in files ``keep(path below the root)`` accepts (default: not :func:`held_out`) and in no
    file it refuses, unique, at most ``per_package`` per top-level package and ``max_texts`` in all; deterministic
    for a given environment."""
    seen: set[str] = set()
    left_out: set[str] = set()  # texts of refused files: a copy of one elsewhere is left out too
    groups = []
    for kind, root in roots if roots is not None else source_roots():
        for top in sorted(root.iterdir()):
            name = top.stem if top.suffix == ".py" else top.name
            if not (top.suffix == ".py" or (top.is_dir() and "." not in top.name)) or name in SKIP_PARTS:
                continue
            texts = []
            for kept, text in _texts_of(root, top, keep):
                texts.append(text) if kept else left_out.add(text)
            texts = [t for t in dict.fromkeys(texts) if t not in seen]
            seen.update(texts)
            groups.append((kind, name, texts))
    records = [{"text": t, "source": kind, "package": name} for kind, name, texts in groups
               for t in _spread([t for t in texts if t not in left_out], per_package)]
    return _spread(records, max_texts)


# ---------------------------------------------------------------- man pages

_TROFF_ESCAPES = re.compile(r"\\f[BIRPC(]?[A-Z]?|\\\*\(..|\\\*.|\\\(..|\\&|\\-|\\e|\\ |\\c|\\[0-9|^%]")
_MACRO_WORDS = re.compile(r"^\.(B|I|BR|IR|RB|RI|BI|IB|Nm|Nd|Ar|Fl|Xr|Em|Pa|Cm|Sy|Dv|Li|Va|Fn|Ft)\s+")


def man_text(source: str) -> str | None:
    """The NAME line and the first DESCRIPTION paragraph of a man(7) or mdoc(7) page, markup removed; None when the
    page has no NAME section or says too little."""
    section, parts, para = None, {"NAME": [], "DESCRIPTION": []}, 0
    for line in source.splitlines():
        head = re.match(r"^\.(SH|Sh)\s+\"?([A-Z ]+)\"?", line)
        if head:
            section = head.group(2).strip()
            continue
        if section not in parts:
            continue
        if line.startswith((".PP", ".LP", ".P ", ".Pp", ".TP", ".IP")) and section == "DESCRIPTION" and parts[section]:
            para += 1
        if para:
            continue
        if line.startswith((".", "'")):
            line = _MACRO_WORDS.sub("", line)
            if line.startswith((".", "'")):
                continue
        parts[section].append(_TROFF_ESCAPES.sub("", line).replace("\\", "").replace('"', ""))
    if not parts["NAME"]:
        return None
    return clip(" ".join(parts["NAME"]) + ". " + " ".join(parts["DESCRIPTION"]))


def man_pages(root: Path = MAN_ROOT, sections: tuple[str, ...] = MAN_SECTIONS) -> Iterator[tuple[str, str, str]]:
    """(file name, section, :func:`man_text`) of every English man page under ``root`` in ``sections`` (sorted;
    links and ``.so`` redirects skipped); nothing when there are no man pages."""
    for sec in sections:
        folder = root / f"man{sec}"
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if not path.is_file() or path.is_symlink():
                continue
            try:
                raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            except (OSError, EOFError, gzip.BadGzipFile):
                continue
            source = raw.decode("utf-8", "replace")
            text = None if source.startswith(".so ") else man_text(source)
            if text:
                yield path.name, sec, text


# ---------------------------------------------------------------- Debian packages


def apt_packages() -> Iterator[tuple[str, str, str, str]]:
    """(package, section, synopsis, first paragraph of the long description) of every package in the apt cache
    (``apt-cache dumpavail``: the lists already on the machine, nothing is fetched; without Translation files the
    long description is empty); nothing where apt is missing."""
    if shutil.which("apt-cache") is None:
        return
    run = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True)
    if run.returncode == 0:
        yield from parse_dumpavail(run.stdout)


def parse_dumpavail(text: str) -> Iterator[tuple[str, str, str, str]]:
    """:func:`apt_packages` of the text ``apt-cache dumpavail`` prints (Debian control stanzas)."""
    for block in text.split("\n\n"):
        fields, last = {}, None
        for line in block.splitlines():
            if line.startswith(" ") and last:
                fields[last] += "\n" + line[1:]
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        if "Description" not in fields or "Package" not in fields:
            continue
        short, _, long = fields["Description"].partition("\n")
        yield fields["Package"], fields.get("Section", "").rpartition("/")[2], short, (
            long.split("\n.\n")[0] if long else "")


def _capped_by_group(records: list[dict], key: str, cap: int) -> list[dict]:
    """``cap`` records spread evenly over the groups (``record[key]``): every group keeps as many as the fairest
    split allows, deterministic."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r[key], []).append(r)
    share, out = cap, []
    for i, (_, rs) in enumerate(sorted(groups.items(), key=lambda g: len(g[1]))):
        take = _spread(rs, max(1, share // (len(groups) - i)))
        out += take
        share -= len(take)
    return out


def man_records(max_texts: int = MAX_TEXTS["man"], root: Path = MAN_ROOT) -> list[dict]:
    """``{"text", "source": "man", "section", "page"}`` of the man pages not :func:`held_out` (nor the same text as
    a held-out page's), unique, at most ``max_texts`` spread over the sections."""
    pages = list(man_pages(root))
    left_out = {t for p, _, t in pages if held_out(p)}
    recs: dict[str, dict] = {}
    for page, section, text in pages:
        if text not in left_out and text not in recs:
            recs[text] = {"text": text, "source": "man", "section": section, "page": page}
    return _capped_by_group(list(recs.values()), "section", max_texts)


def apt_records(max_texts: int = MAX_TEXTS["apt"], packages: Iterator[tuple] | None = None) -> list[dict]:
    """``{"text", "source": "apt", "section", "package"}``: the synopsis (and the long description's first
    paragraph when the lists have it) of the packages (default :func:`apt_packages`) not :func:`held_out` (nor the
    same text as a held-out package's), unique, at least 3 words, at most ``max_texts`` spread over the sections."""
    recs, left_out = {}, set()
    for package, section, short, first in apt_packages() if packages is None else packages:
        text = clip(f"{short}. {first}" if first else short, min_chars=12, min_words=3)
        if text and held_out(package):
            left_out.add(text)
        elif text and text not in recs:
            recs[text] = {"text": text, "source": "apt", "section": section, "package": package}
    return _capped_by_group([r for t, r in recs.items() if t not in left_out], "section", max_texts)


def broad_texts(per_package: int = PER_PACKAGE, max_texts: dict[str, int] | None = None,
                roots: list[tuple[str, Path]] | None = None, man_root: Path = MAN_ROOT,
                apt: bool = True) -> list[dict]:
    """The broad text: :func:`docstring_records`, :func:`man_records` and :func:`apt_records` (each capped by
    ``max_texts[kind]``, default :data:`MAX_TEXTS`), docstrings first, unique; deterministic for a given machine."""
    caps = {**MAX_TEXTS, **(max_texts or {})}
    records = [*docstring_records(per_package, caps["docstrings"], roots), *man_records(caps["man"], man_root),
               *(apt_records(caps["apt"]) if apt else [])]
    seen: set[str] = set()
    return [r for r in records if not (r["text"] in seen or seen.add(r["text"]))]


def environment_key() -> str:
    """Hex digest of what :func:`broad_texts` reads: the Python version, every installed distribution's name and
    version (a new or upgraded package changes the docstrings), the man pages' names and sizes, and the apt lists'
    names and sizes."""
    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                    if d.metadata["Name"]})
    files = [f"{p.relative_to(MAN_ROOT)}:{p.stat().st_size}" for sec in MAN_SECTIONS
             for p in sorted((MAN_ROOT / f"man{sec}").glob("*")) if p.is_file()] if MAN_ROOT.is_dir() else []
    lists = Path("/var/lib/apt/lists")
    files += [f"{p.name}:{p.stat().st_size}" for p in sorted(lists.glob("*Packages*"))] if lists.is_dir() else []
    h = hashlib.sha256("\n".join([sys.version, *dists, *files]).encode())
    return h.hexdigest()[:16]
