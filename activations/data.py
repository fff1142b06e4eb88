"""Datasets -> records -> fixed-length token contexts.

A dataset spec is one of: ``stdlib-docstrings`` (built here from the running Python), a local file
(``.txt`` one document per line, ``.jsonl``/``.json``, ``.csv``, ``.parquet``), or a Hugging Face hub
dataset name (``name`` or ``name:config``, streamed). In-memory lists (of strings or dicts) are passed
to :func:`iter_records` directly.

Contexts: with packing, documents are concatenated (separated by the tokenizer's EOS/SEP token) and
cut into bodies of fixed length, each wrapped in the tokenizer's own special tokens (or BOS when it
adds none); without packing, each document is one context, truncated. Pre-tokenised columns are used
as-is (no special tokens added).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

STDLIB_SPEC = "stdlib-docstrings"
BROAD_SPEC = "broad-text"
"""The broad dictionary's text: docstrings, man pages and Debian package synopses (``activations.broad``)."""
BROAD_DOCSTRINGS_SPEC = "broad-docstrings"
"""Its docstrings alone (``activations.broad.docstring_records``)."""
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class Context(NamedTuple):
    """One model input: token ids (no padding), the per-document labels, and the document text."""

    ids: list[int]
    labels: dict[str, Any]
    text: str | None


DATA_SUFFIXES = (".txt", ".text", ".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")


def check_local_path(spec: str, flag: str) -> None:
    """A ``--model`` / ``--dataset`` written as a path (``./x``, ``../x``, ``/x``, ``~/x``, or a data file's name such
    as ``notes.txt``) must exist: "no such file" with the path, never a Hub error about repo ids."""
    text = str(spec)
    path = Path(text).expanduser()
    if not path.exists() and (text.startswith((".", "/", "~")) or path.suffix.lower() in DATA_SUFFIXES):
        raise FileNotFoundError(f"{flag} {text}: no such file or directory (a path, so it is not looked up on the "
                                f"Hub); check the path (relative paths start from {os.getcwd()})")


def describe_dataset(spec: str) -> dict:
    """The manifest's dataset descriptor for ``spec``; a local file's carries the sha256 of its contents."""
    if spec == STDLIB_SPEC:
        return {"kind": "builtin", "spec": spec, "python": sys.version.split()[0]}
    if spec in (BROAD_SPEC, BROAD_DOCSTRINGS_SPEC):
        from conceptdict.activations.broad import environment_key

        return {"kind": "builtin", "spec": spec, "python": sys.version.split()[0], "environment": environment_key()}
    check_local_path(spec, "--dataset")
    path = Path(spec).expanduser()
    if path.is_file():
        from conceptdict.activations.integrity import file_sha256

        return {"kind": "local file", "spec": str(path.resolve()), "bytes": path.stat().st_size,
                "sha256": file_sha256(path)}
    if path.exists():
        return {"kind": "local file", "spec": str(path.resolve())}
    return {"kind": "hub", "spec": spec, **_hub_revision(spec)}


def _hub_revision(spec: str) -> dict:
    """{"revision": the commit sha of hub dataset ``spec``} when the hub is reachable, else {}."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return {}
    try:
        from huggingface_hub import HfApi

        return {"revision": HfApi().dataset_info(spec.partition(":")[0], timeout=10).sha}
    except Exception as e:  # noqa: BLE001 - no revision is recorded, and the resume check then skips it
        log.info("no hub revision for dataset %s (%s)", spec, type(e).__name__)
        return {}


def check_same_dataset(recorded: dict, now: dict, store: Path, complete: bool = False) -> None:
    """Refuse to resume ``store`` over a dataset whose contents (local file: sha256) or hub revision changed
    since the store was started, or to report a ``complete`` store as done for a dataset that changed since."""
    for key in ("sha256", "revision"):
        old, new = recorded.get(key), now.get(key)
        if old is not None and new is not None and old != new:
            what = ("is finished, but from the earlier version: its rows are not this dataset's" if complete else
                    "was started; resuming would mix rows of both versions")
            raise ValueError(f"dataset {now.get('spec')} changed since store {store} {what} ({key} then "
                             f"{old[:16]}..., now {new[:16]}...); restore it, or cache the new contents into a new "
                             "--out (or pass --overwrite)")
    if now.get("kind") == "local file" and "sha256" in now and "sha256" not in recorded:
        log.warning("store %s records no fingerprint of %s (made by an older conceptdict); resuming without "
                    "checking that the file is unchanged", store, now.get("spec"))


def first_undecodable_line(path: Path, encoding: str) -> tuple[int, int, int] | None:
    """(line number, column, byte) of the first line of ``path`` that does not decode, or None."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            try:
                line.decode(encoding)
            except UnicodeDecodeError as e:
                return number, e.start + 1, line[e.start]
    return None


def _local_records(path: Path, encoding: str) -> Iterator[dict]:
    import datasets

    builder = LOCAL_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"cannot read {path}: expected one of {sorted(LOCAL_BUILDERS)} (or a hub dataset name)")
    if path.stat().st_size == 0:
        raise ValueError(f"dataset {path} is empty (0 bytes): nothing to cache; point --dataset at a file with "
                         "records")
    kwargs = {} if builder == "parquet" else {"encoding": encoding}
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **kwargs)
        yield from ds
    except StopIteration:  # what `datasets` raises for a file with no records
        raise ValueError(f"dataset {path} holds no records: nothing to cache") from None
    except UnicodeDecodeError as e:
        where = first_undecodable_line(path, encoding)
        at = f"line {where[0]}, column {where[1]} (byte 0x{where[2]:02x})" if where else f"byte {e.start}"
        raise ValueError(f"dataset {path} is not valid {encoding} at {at}; pass --encoding with the file's "
                         "encoding (e.g. --encoding latin-1 or cp1252), or re-save it as UTF-8") from None


def iter_records(spec: str | Iterable, split: str = "train", encoding: str = "utf-8") -> Iterator[dict]:
    """Records (dicts) of a dataset spec or of an in-memory list of strings/dicts; ``encoding`` applies to
    local text files."""
    if not isinstance(spec, str):
        for rec in spec:
            yield {"text": rec} if isinstance(rec, str) else dict(rec)
        return
    if spec == STDLIB_SPEC:
        yield from stdlib_docstrings()
        return
    if spec in (BROAD_SPEC, BROAD_DOCSTRINGS_SPEC):
        from conceptdict.activations.broad import broad_texts, docstring_records

        yield from broad_texts() if spec == BROAD_SPEC else docstring_records()
        return
    import datasets

    path = Path(spec).expanduser()
    if path.exists():
        yield from _local_records(path, encoding)
        return
    else:
        name, _, config = spec.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one message
            raise ValueError(f"cannot load dataset {spec!r}: {type(e).__name__}: {e}. Pass 'stdlib-docstrings', "
                             "a local .txt/.jsonl/.csv/.parquet file, or a hub dataset name reachable from this "
                             "machine") from e
    yield from ds


def special_wrapping(tokenizer, prepend_bos: bool = True) -> tuple[list[int], list[int], int | None]:
    """(prefix, suffix, separator) ids the tokenizer puts around one document, e.g. BERT ([CLS], [SEP], [SEP])."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    at = next((i for i in range(len(with_special)) if with_special[i:i + len(plain)] == plain), 0)
    prefix, suffix = list(with_special[:at]), list(with_special[at + len(plain):])
    bos = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos and not prefix and bos is not None:
        prefix = [bos]
    sep = getattr(tokenizer, "eos_token_id", None)
    if sep is None:
        sep = getattr(tokenizer, "sep_token_id", None)
    return prefix, suffix, sep


def _field(record: dict, column: str, index: int) -> Any:
    if column not in record:
        raise ValueError(f"dataset record {index} has no column {column!r}; its columns are {sorted(record)}; "
                         "pass --text-column (or --tokens-column) with one of them")
    return record[column]


def _labels(record: dict, skip: set[str], label_columns: list[str] | None, index: int = 0) -> dict[str, Any]:
    missing = [k for k in label_columns or [] if k not in record]
    if missing:
        raise ValueError(f"label column {missing[0]!r} is not in record {index} of the dataset (its columns: "
                         f"{sorted(record)}); pass --label-column with one of them")
    keys = label_columns if label_columns is not None else [
        k for k, v in record.items() if k not in skip and isinstance(v, (str, int, float, bool))]
    return {k: record.get(k) for k in keys}


def iter_contexts(records: Iterable[dict], tokenizer, *, context_length: int, packing: bool,
                  text_column: str = "text", tokens_column: str | None = None,
                  label_columns: list[str] | None = None, prepend_bos: bool = True,
                  vocab_size: int | None = None, source: str | None = None) -> Iterator[Context]:
    """Fixed-length contexts (the last packed one may be shorter). Raises ValueError for a missing column, an
    empty dataset, or a pre-tokenised id outside [0, vocab_size); ``source``: the dataset's name for them."""
    if tokens_column is None and tokenizer is None:
        raise ValueError("this model has no Hugging Face tokenizer; pass a pre-tokenised --tokens-column")
    prefix, suffix, sep = ([], [], None) if tokens_column else special_wrapping(tokenizer, prepend_bos)
    body = context_length - len(prefix) - len(suffix)
    if body < 1:
        raise ValueError(f"context_length {context_length} leaves no room after the special tokens "
                         f"{prefix + suffix}; raise --context-length")
    column = tokens_column or text_column
    pending: list[int] = []
    count = blank = 0
    for count, record in enumerate(records, start=1):
        value = _field(record, column, count - 1)
        if tokens_column:
            ids, text = _token_ids(value, column, count - 1, vocab_size), None
        else:
            if not isinstance(value, str):
                raise ValueError(f"column {column!r} holds {type(value).__name__}, not text; for token ids use "
                                 "--tokens-column")
            if not value.strip():
                blank += 1
                continue  # a blank line or empty document is no text to cache
            ids, text = tokenizer(value, add_special_tokens=False)["input_ids"], value
        if not packing:
            if not prefix + ids + suffix:
                continue  # an empty pre-tokenised document gives no context
            yield Context(prefix + ids[:body] + suffix, _labels(record, {column}, label_columns, count - 1), text)
            continue
        pending.extend(ids + ([sep] if sep is not None and not tokens_column else []))
        while len(pending) >= body:
            yield Context(prefix + pending[:body] + suffix, {}, None)
            pending = pending[body:]
    where = f"dataset {str(source)!r}" if source else "the dataset"
    if count == 0:
        raise ValueError(f"{where} is empty: no records to cache")
    if blank == count:
        raise ValueError(f"{where} holds no text: all {count} records of its column {column!r} are blank; fill "
                         "the file, or pass --text-column with the column that holds the text")
    if blank:
        log.info("skipped %d blank records of %d", blank, count)
    if packing and pending:
        yield Context(prefix + pending + suffix, {}, None)


def _token_ids(value: Any, column: str, index: int, vocab_size: int | None) -> list[int]:
    """A record's pre-tokenised ids, each an integer the model embeds."""
    try:
        ids = [int(t) for t in value]
    except (TypeError, ValueError):
        raise ValueError(f"record {index}: column {column!r} must hold a list of integer token ids, got "
                         f"{str(value)[:60]!r}") from None
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"record {index}: column {column!r} holds token id {bad[0]}, outside the model's vocabulary "
                         f"[0, {vocab_size if vocab_size is not None else 'its size'}); tokenise with this model's "
                         "tokenizer")
    return ids


# ---------------------------------------------------------------- the standard-library docstring corpus

FAMILIES: dict[str, tuple[str, ...]] = {
    "text": ("string", "re", "textwrap", "difflib", "unicodedata", "stringprep", "codecs", "locale", "gettext",
             "shlex", "fnmatch", "rlcompleter", "readline", "_pyio", "encodings"),
    "net": ("socket", "ssl", "http", "urllib", "email", "smtplib", "poplib", "imaplib", "ftplib", "ipaddress",
            "xmlrpc", "socketserver", "mailbox", "mimetypes", "wsgiref", "webbrowser", "nntplib", "telnetlib",
            "uuid", "smtpd", "cgi", "cgitb"),
    "os/files": ("os", "pathlib", "shutil", "glob", "tempfile", "stat", "filecmp", "fileinput", "io", "posixpath",
                 "ntpath", "genericpath", "zipfile", "tarfile", "gzip", "bz2", "lzma", "zipimport", "linecache",
                 "sysconfig", "platform", "getpass", "mailcap", "netrc", "site", "shelve", "dbm", "zipapp"),
    "data formats": ("json", "csv", "xml", "html", "configparser", "plistlib", "pickle", "pickletools", "copyreg",
                     "sqlite3", "base64", "binascii", "quopri", "struct", "tomllib", "uu", "xdrlib", "wave",
                     "aifc", "sunau", "chunk", "colorsys", "imghdr", "sndhdr"),
    "concurrency": ("threading", "multiprocessing", "concurrent", "asyncio", "queue", "sched", "subprocess",
                    "signal", "selectors", "contextvars", "_threading_local", "asyncore", "asynchat"),
    "dev tools": ("unittest", "doctest", "pdb", "bdb", "trace", "traceback", "inspect", "dis", "ast", "tokenize",
                  "token", "pydoc", "profile", "cProfile", "pstats", "timeit", "logging", "warnings", "importlib",
                  "pkgutil", "modulefinder", "runpy", "compileall", "py_compile", "symtable", "tabnanny", "code",
                  "codeop", "pyclbr", "venv", "ensurepip", "tracemalloc", "faulthandler", "lib2to3"),
    "numbers/time": ("statistics", "fractions", "decimal", "_pydecimal", "numbers", "random", "datetime",
                     "_pydatetime", "calendar", "zoneinfo", "time", "_strptime", "hashlib", "hmac", "secrets"),
    "data structures": ("collections", "heapq", "bisect", "enum", "dataclasses", "functools", "operator", "copy",
                        "graphlib", "types", "typing", "abc", "_collections_abc", "contextlib", "weakref",
                        "reprlib", "pprint", "array", "_weakrefset"),
}
_FAMILY_OF = {mod: fam for fam, mods in FAMILIES.items() for mod in mods}
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
MAX_PER_MODULE = 60
MAX_PER_FAMILY = 350
MIN_CHARS, MAX_CHARS = 40, 1500


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstrings_of(tree: ast.Module) -> Iterator[str]:
    """Module, then public class/function docstrings in source order (nested ones after their parent)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop(0)
        doc = ast.get_docstring(node, clean=False) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc:
            yield doc
        children = [c for c in getattr(node, "body", []) if isinstance(c, (ast.ClassDef, ast.FunctionDef,
                                                                          ast.AsyncFunctionDef))]
        stack[0:0] = [c for c in children if not c.name.startswith("_")]


@functools.cache
def _stdlib_docstrings() -> tuple[tuple[str, str, str], ...]:
    return tuple((r["text"], r["module"], r["family"]) for r in _collect_stdlib())


def stdlib_docstrings() -> list[dict]:
    """Docstrings of the running Python's standard library (see :func:`_collect_stdlib`); a fresh list of
    ``{"text", "module", "family"}`` records each call, parsed once per process."""
    return [{"text": t, "module": m, "family": f} for t, m, f in _stdlib_docstrings()]


def _collect_stdlib() -> list[dict]:
    """Docstrings of the running Python's standard library, parsed from source (nothing is imported).

    Deterministic: files in sorted order, fixed filters (40..1500 characters after cleaning, at most
    60 per top-level module and 350 per family, modules outside :data:`FAMILIES` skipped). Each record is
    ``{"text", "module", "family"}``; ``family`` is one of the 8 hand-made groups in :data:`FAMILIES`.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    per_family: dict[str, int] = {}
    for top, family in sorted(_FAMILY_OF.items()):
        if per_family.get(family, 0) >= MAX_PER_FAMILY:
            continue
        files = [root / f"{top}.py"] if (root / f"{top}.py").is_file() else sorted((root / top).rglob("*.py"))
        kept = 0
        for path in files:
            if _SKIP_PARTS & set(path.relative_to(root).parts) or kept >= MAX_PER_MODULE:
                continue
            try:
                tree = ast.parse(path.read_bytes(), str(path))
            except (SyntaxError, ValueError):
                continue
            module = _module_name(path, root)
            for doc in docstrings_of(tree):
                text = inspect.cleandoc(doc).strip()
                if (MIN_CHARS <= len(text) <= MAX_CHARS and len(text.split()) >= 5 and kept < MAX_PER_MODULE
                        and per_family.get(family, 0) < MAX_PER_FAMILY):
                    kept += 1
                    per_family[family] = per_family.get(family, 0) + 1
                    out.append({"text": text, "module": module, "family": family})
    if not out:
        raise RuntimeError(f"found no standard-library sources under {root}; this Python ships without .py files")
    return out
