"""The example notebooks (examples/*.ipynb) run top to bottom, so they cannot rot (issue 33).

Each notebook runs in a fresh kernel on this interpreter (a kernelspec written into a temporary JUPYTER_PATH, so
neither a user's kernels nor a manual ``ipykernel install`` matter), in a temporary working directory, offline.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
KERNEL = "conceptdict-examples"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in tracebacks


@pytest.mark.unit
def test_notebooks_are_stored_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "diff_steer.ipynb"}
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        dirty = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and (c.get("outputs") or
                                                                                c.get("execution_count"))]
        assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before committing"


def _kernelspec(root: Path) -> Path:
    """A kernelspec named KERNEL that starts ipykernel with this very interpreter."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "conceptdict examples", "language": "python"}))
    return root


def _cell_output(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.integration
# quickstart is `slow` (.ci/run runs it, make test-slow): the README's Python quickstart runs the same cache, train,
# evaluate, name and cbm on the default model in the default tier (tests/test_readme.py), test_api.py the rest
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem == "quickstart" else p
                                  for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (pip install -e .[test])")
    nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (pip install -e .[test])")
    pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (pip install -e .[test])")
    from nbclient.exceptions import CellExecutionError

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec(tmp_path / "jupyter")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("CONCEPTDICT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))  # which interpreter ran it
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": str(work)}})
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except CellExecutionError as e:  # its message holds the failing cell's source, output and traceback
        failure = ANSI.sub("", str(e))
    if failure is not None:
        pytest.fail(f"{path.name} failed:\n{failure}", pytrace=False)
    print(f"{path.name}: {time.perf_counter() - start:.0f}s")
    assert _cell_output(nb.cells[0]).strip() == sys.executable, "the notebook ran in another interpreter"


def _notebook_code(path: Path) -> str:
    """The code cells of a notebook as one script (what a user who copies them into a .py file has)."""
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code") + "\n"


def _typed_package(root: Path) -> Path | None:
    """A folder for MYPYPATH that holds ``conceptdict`` laid out as installed, when the install is editable (a
    setuptools finder maps conceptdict to api/ and its stages to their folders, which mypy does not follow): links to
    each file of api/ and to each stage's folder. None when the package is installed as files."""
    import importlib.util

    top = Path(next(iter(importlib.util.find_spec("conceptdict").submodule_search_locations)))
    if (top / "activations").is_dir():
        return None
    pkg = root / "conceptdict"
    pkg.mkdir(parents=True)
    for f in top.iterdir():
        (pkg / f.name).symlink_to(f)
    for stage in ("activations", "saes", "naming", "cli"):
        where = Path(next(iter(importlib.util.find_spec(f"conceptdict.{stage}").submodule_search_locations)))
        (pkg / stage).symlink_to(where)
    return root


@pytest.mark.slow  # mypy reads torch's annotations: about a minute; .ci/run runs it (make test-slow)
def test_the_python_api_notebook_passes_mypy_strict_against_the_package(tmp_path, monkeypatch):
    """The third notebook's code, as a user's script, passes ``mypy --strict`` against the installed package (its
    own annotations, py.typed), and every public name is one mypy knows (not an Any through ``__getattr__``); a
    mistyped keyword and a wrong type are errors (the check can fail)."""
    mypy = pytest.importorskip("mypy.api", reason="the typing check needs mypy (pip install -e .[test])")
    import conceptdict as cd

    path = _typed_package(tmp_path / "typed")
    if path is not None:
        monkeypatch.setenv("MYPYPATH", str(path))

    def check(code: str) -> tuple[str, int]:
        script = tmp_path / "script.py"
        script.write_text(code)
        out, err, status = mypy.run(["--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"),
                                     str(script)])
        return out + err, status

    names = "\n".join(f"print(cd.{n})" for n in cd.__all__)
    out, status = check(_notebook_code(ROOT / "examples" / "python_api.ipynb") + names + "\n")
    assert status == 0, f"mypy --strict on examples/python_api.ipynb's code:\n{out}"
    out, status = check("import conceptdict as cd\ncd.evaluate('runs/sae', rowz=5)\nx: int = cd.load('runs/sae')\n")
    assert status == 1 and '"rowz"' in out and "SparseCoder" in out, out
