"""Labelled text corpora built from what this machine already has, for ``bench/cbm_accuracy.py``.

Each builder returns ``[{"text", "label"}]``, deterministic for a given machine (sorted sources, fixed
caps, no sampling). None of them is used by a test or tuned on: they are the "data the project has never
seen" of issue 11. Every corpus but ``stdlib`` draws only from the half of man pages, Debian packages and
docstring files that the broad dictionary's text leaves out (``conceptdict.activations.broad.held_out``), so the
broad route is measured on texts (and pages, packages, files) its dictionary never read.

- ``manpages``: the NAME line plus the first DESCRIPTION paragraph of each English man page under
  ``/usr/share/man``, labelled by section (1 user commands, 2 system calls, 3 library calls, 5 file formats,
  7 overviews, 8 administration).
- ``debian``: the description of each package in the apt cache (``apt-cache dumpavail``: the package lists
  already on the machine, nothing is fetched; without Translation files that is the one-line synopsis),
  labelled by Debian section (games, sound, graphics, ...).
- ``pydocs``: docstrings of third-party Python packages installed beside conceptdict (torch, numpy, sympy,
  ...), labelled by the package they come from. The standard library is left out (that is the demo's corpus).
- ``stdlib``: the demo's corpus (standard-library docstrings by module family), for reference (all of it: about
  half of its files are in the broad text).
- ``man2``: a 2-class split of the man pages, user commands (section 1) against library calls (section 3).
- ``debian30``: topics of short texts: the one-line synopsis alone (a few words) of Debian packages in the 30
  largest sections that have at least :data:`PER_CLASS_30` packages, labelled by section.
- ``msglang``: a task of another kind, the language of a text rather than its topic: translated program messages
  (the msgstr of the gettext catalogs under ``/usr/share/locale/LANG/LC_MESSAGES/*.mo``, at least 3 words) in
  :data:`MSG_LANGUAGES`, ten languages in close pairs and families (Danish / Swedish / Norwegian, Spanish /
  Portuguese / Catalan, ...), labelled by language. No catalog is in the broad text.
"""

from __future__ import annotations

import ast
import inspect
import struct
import sysconfig
from pathlib import Path

from conceptdict.activations.broad import apt_packages, clip, held_out, man_pages

PER_CLASS = 300
"""At most this many texts per label (so each corpus stays at a few thousand rows)."""
PER_CLASS_2 = 700
"""``man2``: texts per class of the 2-class split."""
PER_CLASS_30 = 200
"""``debian30``: texts per section of the 30-class one (the held-out half of the packages has at least 200 in 33
sections)."""

MAN_SECTIONS = ("1", "2", "3", "5", "7", "8")
DEBIAN_SECTIONS = ("games", "sound", "graphics", "science", "math", "fonts", "web", "net", "text", "mail")
PY_PACKAGES = ("torch", "numpy", "sympy", "networkx", "transformers", "jinja2", "pip", "setuptools", "_pytest",
               "huggingface_hub", "numba", "fsspec")  # fmt: skip


def _take(pairs, per_class: int) -> list[dict]:
    """First ``per_class`` unique texts of each label, spread over the sources (every n-th candidate)."""
    by_label: dict[str, list[str]] = {}
    for label, text in pairs:
        by_label.setdefault(label, []).append(text)
    out = []
    for label in sorted(by_label):
        texts = list(dict.fromkeys(by_label[label]))
        step = max(1, len(texts) // per_class)
        out += [{"text": t, "label": label} for t in texts[::step][:per_class]]
    return out


# ---------------------------------------------------------------- man pages

def manpages(root: Path = Path("/usr/share/man"), per_class: int = PER_CLASS,
             sections: tuple[str, ...] = MAN_SECTIONS) -> list[dict]:
    return _take(((sec, text) for page, sec, text in man_pages(root, sections) if held_out(page)), per_class)


# ---------------------------------------------------------------- Debian package descriptions


def man2() -> list[dict]:
    return manpages(per_class=PER_CLASS_2, sections=("1", "3"))


def _apt_packages():
    """(section, synopsis, first paragraph of the long description) of the held-out packages in the apt cache."""
    return ((section, short, first) for package, section, short, first in apt_packages() if held_out(package))


def debian(per_class: int = PER_CLASS) -> list[dict]:
    pairs = []
    for section, short, first in _apt_packages():
        text = clip(f"{short}. {first}") if section in DEBIAN_SECTIONS else None
        if text:
            pairs.append((section, text))
    return _take(pairs, per_class)


def debian30(per_class: int = PER_CLASS_30, n_classes: int = 30) -> list[dict]:
    by_section: dict[str, list[str]] = {}
    for section, short, _ in _apt_packages():
        short = " ".join(short.split())
        if section and len(short.split()) >= 2:
            by_section.setdefault(section, []).append(short)
    big = sorted((s for s, t in by_section.items() if len(set(t)) >= per_class), key=lambda s: (-len(by_section[s]), s))
    return _take(((s, t) for s in sorted(big[:n_classes]) for t in by_section[s]), per_class)


# ---------------------------------------------------------------- translated program messages

MSG_LANGUAGES = ("ca", "da", "de", "es", "fr", "it", "nb", "nl", "pt_BR", "sv")
LOCALE_ROOT = Path("/usr/share/locale")


def mo_messages(path: Path) -> list[str]:
    """The translations (msgstr; a plural's first form) in gettext catalog ``path`` (the GNU .mo layout: magic,
    revision, count, offsets of the original and translated string tables); [] for a file that is not one."""
    data = path.read_bytes()
    order = {0x950412DE: "<", 0xDE120495: ">"}.get(struct.unpack("<I", data[:4])[0]) if len(data) >= 20 else None
    if order is None:
        return []
    _, count, _, table = struct.unpack(order + "4I", data[4:20])
    out = []
    for i in range(count):
        size, offset = struct.unpack(order + "2I", data[table + 8 * i: table + 8 * i + 8])
        out.append(data[offset: offset + size].decode("utf-8", "replace").split("\0")[0])
    return out


def msglang(per_class: int = PER_CLASS, root: Path = LOCALE_ROOT,
            languages: tuple[str, ...] = MSG_LANGUAGES) -> list[dict]:
    pairs = []
    for lang in languages:
        for path in sorted((root / lang / "LC_MESSAGES").glob("*.mo")):
            for message in mo_messages(path):
                text = " ".join(message.split())
                # whole phrases: no format directives or option tables, which say more about the program
                if len(text.split()) >= 3 and "%" not in text and not text.startswith("-") and len(text) <= 200:
                    pairs.append((lang, text))
    return _take(pairs, per_class)


# ---------------------------------------------------------------- third-party docstrings


def _docstrings(path: Path):
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                # the summary paragraph: parameter tables and examples say little about the package
                yield inspect.cleandoc(doc).split("\n\n")[0]


def pydocs(per_class: int = PER_CLASS) -> list[dict]:
    site = Path(sysconfig.get_paths()["purelib"])
    pairs = []
    for package in PY_PACKAGES:
        root = site / package
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            if {"tests", "test", "testing", "_vendor"} & set(path.relative_to(root).parts) or not held_out(
                    path.relative_to(site).as_posix()):
                continue
            for doc in _docstrings(path):
                text = clip(doc)
                if text:
                    pairs.append((package.lstrip("_"), text))
    return _take(pairs, per_class)


def stdlib(per_class: int = PER_CLASS) -> list[dict]:
    from conceptdict.activations import stdlib_docstrings

    return _take(((r["family"], r["text"]) for r in stdlib_docstrings()), per_class)


CORPORA = {"manpages": manpages, "debian": debian, "pydocs": pydocs, "stdlib": stdlib, "man2": man2,
           "debian30": debian30, "msglang": msglang}


HOOKPOINT = "sentence.mean_normalized"


def default_model():
    """A function returning the default model (all-MiniLM-L6-v2, the embedded package), loaded on its first call
    only: a run whose corpora are all cached never loads it."""
    from conceptdict.activations import DEFAULT_MODEL_DIR, load_model

    handle = {}

    def model():
        if "m" not in handle:
            handle["m"] = load_model(str(DEFAULT_MODEL_DIR()))
        return handle["m"]

    return model


def embedded(name: str, model, cache: Path, max_length: int = 128):
    """(x [N, D] at ``sentence.mean_normalized``, labels [N], texts [N]) of corpus ``name``, embedded once
    under ``cache`` (keyed by the texts) and reused. ``model()`` returns the model handle (loaded lazily)."""
    import hashlib
    import json

    from safetensors.torch import load_file, save_file

    from conceptdict.activations import embed_texts

    records = CORPORA[name]()
    texts, labels = [r["text"] for r in records], [r["label"] for r in records]
    key = hashlib.sha256(("\n\0".join(texts) + "\0" + "\0".join(labels) + HOOKPOINT + str(max_length)).encode())
    path = cache / f"{name}-{key.hexdigest()[:16]}.safetensors"
    if not path.exists():
        x = model().embed_texts(texts, HOOKPOINT, max_length=max_length)
        cache.mkdir(parents=True, exist_ok=True)
        save_file({"x": x.contiguous()}, str(path))
        path.with_suffix(".json").write_text(json.dumps({"labels": labels, "texts": texts}))
    return load_file(str(path))["x"], labels, texts
