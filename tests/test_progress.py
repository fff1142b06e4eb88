"""Progress bars through tqdm.auto (issue 51): in a notebook kernel Jupyter's widget where ipywidgets is installed
(text otherwise), text on a terminal, plain lines in logs, and no "IProgress not found" warning in a kernel without
ipywidgets."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import tqdm.auto

from conceptdict.saes.metrics import LineProgress, in_notebook, progress

pytestmark = pytest.mark.unit

LOG = logging.getLogger("conceptdict.test_progress")


def test_progress_in_a_log_is_lines(monkeypatch):
    """Without a terminal (pytest captures stderr) and outside a notebook: log lines, no redrawn bar; ipykernel
    imported without a kernel running (tests/test_examples.py imports it in this process) changes nothing."""
    assert not sys.stderr.isatty()
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert not in_notebook()
    assert isinstance(progress(10, 0, "train", LOG), LineProgress)
    assert not isinstance(progress(10, 0, "train", LOG, enabled=False), LineProgress)


def test_progress_in_a_notebook_kernel_is_tqdm_autos_bar(monkeypatch):
    """In a notebook kernel training shows the bar tqdm.auto chose (the widget where ipywidgets is installed, text
    otherwise): a notebook's stderr is no terminal, and its log lines would reach no handler."""

    class Chosen(tqdm.auto.tqdm):
        """What tqdm.auto chose in this kernel."""

    shell = types.SimpleNamespace(kernel=object())  # ipykernel's shell, as IPython.get_ipython() gives it
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setattr(tqdm.auto, "tqdm", Chosen)
    assert in_notebook()
    bar = progress(10, 2, "train", LOG)
    assert type(bar) is Chosen and (bar.n, bar.total, bar.disable) == (2, 10, False)
    bar.close()
    assert progress(10, 0, "train", LOG, enabled=False).disable


KERNEL_WITHOUT_WIDGETS = "import sys, ipykernel.zmqshell; sys.modules['ipywidgets'] = None; "
"""A notebook kernel as tqdm.autonotebook recognises one (ipykernel's shell imported), ipywidgets not importable."""


def _stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-W", "always", "-c", KERNEL_WITHOUT_WIDGETS + code], capture_output=True,
                          text=True, check=True).stderr


def test_no_iprogress_warning_in_a_kernel_without_ipywidgets():
    pytest.importorskip("ipykernel")
    plain = _stderr_of("import tqdm.auto")
    assert "IProgress not found" in plain, "tqdm no longer warns without ipywidgets: the guard may go"
    err = _stderr_of("import conceptdict, tqdm.auto, tqdm.std; "
                     "assert issubclass(tqdm.auto.tqdm, tqdm.std.tqdm); "
                     "from conceptdict.saes.metrics import progress")
    assert "IProgress" not in err, err


def test_import_conceptdict_outside_a_kernel_imports_no_tqdm():
    code = "import sys, conceptdict; print(sorted(m for m in sys.modules if m.split('.')[0] in ('tqdm', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
