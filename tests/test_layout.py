"""The import directions and dependency boundaries of DESIGN.md, enforced by parsing the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("activations", "saes", "naming", "cli")
# stage -> stages it may import
ALLOWED = {
    "cli": {"activations", "saes", "naming", "cli"},
    "naming": {"activations", "saes", "naming"},
    "saes": {"saes"},
    "activations": {"activations"},
}
MODEL_LIBS = {"transformer_lens", "transformers", "datasets"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved), with line numbers."""
    rel = path.relative_to(ROOT)
    package = ["conceptdict", *rel.parts[:-1]]
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


@pytest.mark.parametrize("stage", STAGES)
def test_import_directions(stage):
    bad = []
    for path in _files(stage):
        for name, line in _imports(path):
            parts = name.split(".")
            if parts[0] in STAGES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports bare top-level {name!r}; use conceptdict.{name}")
            if parts[0] == "conceptdict" and len(parts) > 1 and parts[1] in STAGES:
                if parts[1] not in ALLOWED[stage]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({stage} may not import {parts[1]})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("stage", ["saes", "naming", "cli"])
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
    for stage in ("activations", "saes", "naming"):
        for p in _files(stage):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "library code logs through logging; only cli prints: " + ", ".join(bad)


def test_no_unsafe_torch_load():
    bad = []
    for stage in STAGES + ("bench", "tests"):
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
    import conceptdict.activations
    import conceptdict.cli
    import conceptdict.naming
    import conceptdict.saes

    for mod, folder in [
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


@pytest.mark.parametrize("stage", ["activations", "saes", "naming", "cli"])
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


@pytest.mark.parametrize("package", ["activations", "saes", "saes.kernels", "naming", "cli"])
def test_no_module_is_shadowed_by_a_name_its_package_exports(package):
    """``package.x`` is the module x or something else, never both (``saes.train`` once was a function
    hiding the module saes/train.py, so code reached the module through importlib)."""
    import importlib
    import pkgutil
    import types

    pkg = importlib.import_module(f"conceptdict.{package}")
    shadowed = [info.name for info in pkgutil.iter_modules(pkg.__path__)
                if not isinstance(getattr(pkg, info.name, types.ModuleType("x")), types.ModuleType)]
    assert not shadowed, f"conceptdict.{package} exports names that hide its modules: {shadowed}"
