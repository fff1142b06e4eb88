"""What the docs name exists: every repo path that README.md and docs/**/*.md name in backticks, links or the
commands of bash blocks, every link's #anchor (a heading of its file, by GitHub's slug rules) and every dotted module
path (``conceptdict.x.y``, ``saes.x.y``, ...: imported, then looked up attribute by attribute). Issue 51: about
twenty paths named modules that had moved, and nothing read them.

A word is a repo path when its first component is a top-level entry of the repository that git does not
ignore (``saes/training.py``, ``bench/``, ``Makefile``); ``runs/quick/store`` is a user's output folder (``runs/``
is in .gitignore), not a repo path. Links are relative to their doc; backticked paths to the repository root."""

from __future__ import annotations

import fnmatch
import importlib
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

IGNORED = [line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
TOP = sorted(p.name for p in ROOT.iterdir()
             if not p.name.startswith(".") and not any(fnmatch.fnmatch(p.name, g) for g in IGNORED))

PACKAGES = {"conceptdict": "conceptdict", "saes": "conceptdict.saes", "activations": "conceptdict.activations",
            "naming": "conceptdict.naming", "cli": "conceptdict.cli"}
"""How the docs name the library's modules: ``conceptdict.*`` as installed, or by the folder (pyproject's
package-dir: ``saes`` is ``conceptdict.saes``)."""


def _prose(text: str) -> str:
    """The text without its fenced blocks (commands and code, whose ``#`` lines are not headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _spans(text: str) -> list[str]:
    """Every inline code span (one may run over a line break, as Markdown allows), its lines joined."""
    spans = re.findall(r"(?<!`)`((?:[^`\n]|\n(?!\s*\n))+)`(?!`)", _prose(text))
    return [" ".join(s.split()) for s in spans]


def _command_words(text: str) -> list[str]:
    """The words of the doc's bash blocks (``python bench/x.py --flag``: a user runs them as written)."""
    blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M)
    return [w for body in blocks for line in body.replace("\\\n", " ").splitlines()
            for w in shlex.split(line, comments=True)]


def _links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", _prose(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # https:, mailto: are not repo files


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor in ``doc``; a repeated one gets GitHub's ``-1``, ``-2`` suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(doc.read_text()), re.M):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def repo_path(span: str) -> str | None:
    """The repo path a backticked span names (its first word: ``bench/x.py --flag`` names bench/x.py), or None."""
    word = span.split()[0]
    first = re.split(r"[/#:]", word)[0]
    if first not in TOP or (word == first and not (ROOT / first).is_file()):
        return None  # `cli` alone is a word of prose; `Makefile`, `README.md` are files
    return word


def module_path(span: str) -> str | None:
    """The dotted name a span names (``saes.train(cfg, ...)`` names saes.train), or None."""
    m = re.match(r"([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)", span)
    if m is None or m.group(1) not in PACKAGES or "/" in span.split()[0]:
        return None
    return m.group(0)


def _problem_with_file(doc: Path, target: str, base: Path) -> str | None:
    """Why ``target`` (``path``, ``path#anchor``, ``#anchor``, ``path::test``) named in ``doc`` does not exist."""
    target = target.split("::")[0]
    path, _, anchor = target.partition("#")
    file = (base / path).resolve() if path else doc
    if "<" in path or "*" in path:  # `cli/demo_<stage>.py`: a pattern; something must match it
        pattern = re.sub(r"<[^>]*>", "*", path)
        return None if list(base.glob(pattern)) else f"nothing matches {path}"
    if not file.is_relative_to(ROOT) or not file.exists():
        return f"{path} does not exist"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{file.relative_to(ROOT)} has no heading #{anchor}"
    return None


def resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names: the longest importable prefix, then attributes (a dataclass's
    field without a default counts)."""
    first, *rest = dotted.split(".")
    parts = PACKAGES[first].split(".") + rest
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if not hasattr(obj, name) and name in fields:
                return fields[name]
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def _named(kind: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        if kind == "link":
            out += [(doc, t) for t in dict.fromkeys(_links(text))]
        else:
            pick = repo_path if kind == "path" else module_path
            words = _spans(text) + (_command_words(text) if kind == "path" else [])
            out += [(doc, p) for p in dict.fromkeys(map(pick, words)) if p]
    return out


def _ids(named):
    return [f"{doc.relative_to(ROOT)}:{t}" for doc, t in named]


def test_the_docs_name_enough_to_check():
    """The extraction finds what the docs name (a broken regex would pass every test below vacuously)."""
    assert {"api", "saes", "docs", "tests", "bench", "Makefile", "README.md"} <= set(TOP) and "runs" not in TOP
    assert len(_named("path")) > 100 and len(_named("link")) > 100 and len(_named("module")) > 50
    assert repo_path("runs/quick/store") is None and repo_path("cli") is None
    assert repo_path("bench/x.py --seeds 0") == "bench/x.py" and repo_path("Makefile") == "Makefile"
    assert module_path("saes.train(cfg, batches, *, out)") == "saes.train" and module_path("cd.train") is None
    assert _command_words("```bash\npython bench/x.py \\\n  --seeds 0  # two\n```\n") == \
        ["python", "bench/x.py", "--seeds", "0"]


@pytest.mark.parametrize("doc,path", _named("path"), ids=_ids(_named("path")))
def test_backticked_repo_path_exists(doc, path):
    problem = _problem_with_file(doc, path, ROOT)
    assert problem is None, f"{doc.relative_to(ROOT)} names `{path}`: {problem}"


@pytest.mark.parametrize("doc,link", _named("link"), ids=_ids(_named("link")))
def test_link_target_and_anchor_exist(doc, link):
    problem = _problem_with_file(doc, link, doc.parent)
    assert problem is None, f"{doc.relative_to(ROOT)} links to {link}: {problem}"


@pytest.mark.parametrize("doc,dotted", _named("module"), ids=_ids(_named("module")))
def test_dotted_module_path_resolves(doc, dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{doc.relative_to(ROOT)} names `{dotted}`, which does not resolve: {e!r}")


@pytest.mark.parametrize("heading,anchor", [
    ("Mixed precision (`precision=bf16`) on this machine's CPU", "mixed-precision-precisionbf16-on-this-machines-cpu"),
    ("Relaxed refits (2026-12-04)", "relaxed-refits-2026-12-04"),
    ("BatchTopK 0.15", "batchtopk-015"),
    ("Which kind should I use?", "which-kind-should-i-use"),
    ("The [store](x.md) a dictionary_is evaluated on", "the-store-a-dictionary_is-evaluated-on"),
])
def test_slug_follows_github(heading, anchor):
    assert slug(heading) == anchor


def test_anchors_number_repeated_headings(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# Setup\n\n```bash\n# not a heading\n```\n\n## Setup\n\n### Setup\n")
    assert anchors(doc) == {"setup", "setup-1", "setup-2"}
