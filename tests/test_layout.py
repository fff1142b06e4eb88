"""The import directions and dependency boundaries of docs/architecture.md, enforced by parsing the source.

Folders and what they may import (``api/`` installs as the top-level package ``conceptdict``, the Python API):

    cli ──► api ──► naming ──► saes
                      └──────► activations          saes ✗ activations, activations ✗ saes; nothing imports cli
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("activations", "saes", "naming", "cli")
FOLDERS = STAGES + ("api",)
# folder -> folders it may import
ALLOWED = {
    "cli": {"api", "cli"},
    "api": {"api", "activations", "saes", "naming"},
    "naming": {"activations", "saes", "naming"},
    "saes": {"saes"},
    "activations": {"activations"},
}
CLI_SHARED = ("conceptdict.cli.args", "conceptdict.cli.errors")
"""The cli modules a command module may import (a command never imports another command)."""
MODEL_LIBS = {"transformer_lens", "transformers", "datasets"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved), with line numbers."""
    rel = path.relative_to(ROOT)
    package = ["conceptdict", *rel.parts[:-1]] if rel.parts[0] != "api" else ["conceptdict", *rel.parts[1:-1]]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
    return out


def _files(stage: str) -> list[Path]:
    return sorted((ROOT / stage).rglob("*.py"))


def _folder_of(name: str) -> str | None:
    """The folder a ``conceptdict...`` module lives in (``api`` for the top-level package's modules)."""
    parts = name.split(".")
    if parts[0] != "conceptdict":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else "api"


@pytest.mark.parametrize("folder", FOLDERS)
def test_import_directions(folder):
    bad = []
    for path in _files(folder):
        for name, line in _imports(path):
            if name.split(".")[0] in FOLDERS:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports bare top-level {name!r}; use conceptdict.{name}")
            target = _folder_of(name)
            if target is not None and target not in ALLOWED[folder]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({folder}/ may not import {target}/)")
    assert not bad, "\n".join(bad)


def test_command_modules_import_no_other_command():
    """A command is flags -> settings -> one API call -> print: it imports the API and cli.args / cli.errors only."""
    bad = []
    for path in _files("cli"):
        if path.name in ("main.py", "args.py", "errors.py", "__init__.py"):
            continue
        for name, line in _imports(path):
            if name.startswith("conceptdict.cli") and name not in CLI_SHARED:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "command modules import another command:\n" + "\n".join(bad)


@pytest.mark.parametrize("stage", ["saes", "naming", "cli", "api"])
def test_model_libraries_only_in_activations(stage):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {name}"
        for p in _files(stage)
        for name, line in _imports(p)
        if name.split(".")[0] in MODEL_LIBS
    ]
    assert not bad, "only activations/ may touch transformer-lens, transformers, datasets:\n" + "\n".join(bad)


def test_numba_only_in_kernels():
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for stage in STAGES
        for p in _files(stage)
        for name, line in _imports(p)
        if name.split(".")[0] == "numba" and "kernels" not in p.parts
    ]
    assert not bad, "numba is imported outside saes/kernels: " + ", ".join(bad)


def test_no_print_in_library_code():
    bad = []
    for stage in ("activations", "saes", "naming", "api"):
        for p in _files(stage):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "library code logs through logging; only cli prints: " + ", ".join(bad)


def test_no_unsafe_torch_load():
    bad = []
    for stage in FOLDERS + ("bench", "tests"):
        for p in sorted((ROOT / stage).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load":
                    if getattr(node.func.value, "id", None) == "torch":
                        kw = {k.arg: k.value for k in node.keywords}
                        ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                        if not ok:
                            bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "torch.load without weights_only=True: " + ", ".join(bad)


def test_installed_namespace_maps_to_the_source_folders():
    import conceptdict
    import conceptdict.activations
    import conceptdict.cli
    import conceptdict.naming
    import conceptdict.saes

    for mod, folder in [
        (conceptdict, "api"),
        (conceptdict.activations, "activations"),
        (conceptdict.saes, "saes"),
        (conceptdict.naming, "naming"),
        (conceptdict.cli, "cli"),
    ]:
        assert Path(mod.__file__).resolve().parent == ROOT / folder


def _module_aliases(path: Path, tree: ast.AST) -> set[str]:
    """Names that ``path`` binds to modules of this project (``import a.b as x``, ``from . import mod``)."""
    import importlib.util

    aliases = set()
    for node, (name, _) in zip([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))],
                               _imports(path)):
        if not name.startswith("conceptdict."):
            continue
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.asname}
        else:
            for a in node.names:
                try:
                    spec = importlib.util.find_spec(f"{name}.{a.name}")
                except ModuleNotFoundError:
                    spec = None
                if spec is not None:
                    aliases.add(a.asname or a.name)
    return aliases


@pytest.mark.parametrize("stage", ["activations", "saes", "naming", "cli", "api"])
def test_no_private_names_across_modules(stage):
    """A module uses another module's public names only: no ``from .x import _private``, no ``x._private``."""
    bad = []
    for path in _files(stage):
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                  and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", ["", "activations", "saes", "saes.kernels", "naming", "cli"])
def test_no_module_is_shadowed_by_a_name_its_package_exports(package):
    """``package.x`` is the module x or something else, never both (``saes.train`` once was a function
    hiding the module saes/train.py, so code reached the module through importlib)."""
    import importlib
    import pkgutil
    import types

    pkg = importlib.import_module(f"conceptdict.{package}".rstrip("."))
    shadowed = [info.name for info in pkgutil.iter_modules(pkg.__path__)
                if not isinstance(getattr(pkg, info.name, types.ModuleType("x")), types.ModuleType)]
    assert not shadowed, f"conceptdict.{package} exports names that hide its modules: {shadowed}"


def test_modules_stay_small_and_the_command_line_thin():
    """No library module over 450 lines; the whole command line (flags -> one API call -> print) under 1,400."""
    long = {str(p.relative_to(ROOT)): n for folder in FOLDERS for p in _files(folder)
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these modules: {long}"
    cli = sum(len(p.read_text().splitlines()) for p in _files("cli"))
    assert cli < 1400, f"cli/ holds {cli} lines: move what is not flags or printing into the API (api/)"


def test_train_help_fits_a_screenful(capsys, monkeypatch):
    """`conceptdict train --help` describes the common flags in one or two sentences each (under 120 lines at 80
    columns); `--help-all` describes every flag."""
    from conceptdict.cli.main import main

    monkeypatch.setenv("COLUMNS", "80")
    for flag, most in (("--help", 120), ("--help-all", 400)):
        with pytest.raises(SystemExit):
            main(["train", flag])
        text = capsys.readouterr().out
        assert len(text.splitlines()) < most, f"train {flag} prints {len(text.splitlines())} lines"
        assert "--latents" in text and "--matryoshka-groups" in text
    assert "Sizes of the nested" in text  # --help-all describes a kind's own setting
