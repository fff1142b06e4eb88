"""Where training metrics go: a tiny sink protocol, a JSONL file sink, a null sink, the optional trackers (W&B,
TensorBoard; imported only when asked for) and the progress display (a bar on a terminal, lines in a log)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    """Receives one flat record (JSON-able values) per logging step."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Drops every record."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON line per record to ``path``.

    ``keep_until_step``: when resuming, first drop the records of steps after the checkpoint so the file
    reads as one uninterrupted run."""

    def __init__(self, path: str | Path, keep_until_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until_step is None:
            self.path.write_text("")
        elif self.path.exists():
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= keep_until_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TeeSink:
    """Writes every record to each of ``sinks`` (metrics.jsonl plus a tracker)."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class WandbSink:
    """Weights & Biases: one run per dictionary (``wandb.init(project=, name=, config=)``), ``step`` as its step."""

    def __init__(self, name: str, config: dict[str, Any], directory: Path | None) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "conceptdict"), name=name or None,
                               config=config, dir=str(directory) if directory else None, reinit=True)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """TensorBoard event files under ``directory`` (``torch.utils.tensorboard.SummaryWriter``), ``step`` as x."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._writer.add_scalar(k, v, int(record["step"]))

    def close(self) -> None:
        self._writer.close()


TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""``TrainConfig.log`` value -> the package it needs (an optional extra: ``pip install conceptdict[wandb]``)."""


def check_tracker(name: str | None) -> None:
    """Raise ValueError naming the fix when ``name`` is not a tracker or its package is not installed."""
    if name is None:
        return
    if name not in TRACKERS:
        raise ValueError(f"log={name!r} is not a tracker; use one of {sorted(TRACKERS)} (or leave it unset: "
                         f"metrics.jsonl is always written)")
    if importlib.util.find_spec(TRACKERS[name]) is None:
        raise ValueError(f"log={name!r} needs the {TRACKERS[name]} package, which is not installed: "
                         f"pip install 'conceptdict[{name}]' (or pip install {TRACKERS[name]})")
    if name == "wandb" and not wandb_credentials():
        raise ValueError("log='wandb': not logged in to Weights & Biases (no WANDB_API_KEY, no key in ~/.netrc); "
                         "run `wandb login` first, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` "
                         "uploads it later)")


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")
"""``WANDB_MODE`` values under which ``wandb.init`` needs no login."""


def wandb_credentials() -> bool:
    """Whether ``wandb.init`` will find what it needs without prompting: a local ``WANDB_MODE``, ``WANDB_API_KEY``, or
    the credentials wandb itself finds (``wandb.login(prompt=False)``; older wandb: ``wandb.api.api_key``, which
    reads the environment and ~/.netrc)."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES or os.environ.get("WANDB_API_KEY"):
        return True
    import inspect

    import wandb

    try:
        if "prompt" in inspect.signature(wandb.login).parameters:
            return bool(wandb.login(prompt=False))
        return bool(wandb.api.api_key)
    except Exception as e:  # noqa: BLE001 - a check wandb cannot answer must not stop a run wandb.init may allow
        log.debug("could not check the wandb login (%s); wandb.init will", e)
        return True


def tracker_sink(name: str, run_name: str, config: dict[str, Any], out: Path | None) -> MetricsSink:
    """The sink of tracker ``name`` (``wandb`` or ``tensorboard``) for one dictionary; its files go under ``out``."""
    check_tracker(name)
    if name == "wandb":
        return WandbSink(run_name, config, out)
    return TensorBoardSink((out or Path("runs")) / "tensorboard" / (run_name or "train"))


PROGRESS_SECONDS = 30.0
"""Without a terminal, training logs a progress line at most this often (a bar would fill a log with redraws)."""


class LineProgress:
    """A progress bar for logs: ``desc: step N/M (P%), R steps/s, about E left`` every :data:`PROGRESS_SECONDS`
    and once at the end; the same ``update``/``close`` calls as tqdm."""

    def __init__(self, total: int | None, initial: int, desc: str, log: logging.Logger) -> None:
        self.total, self.n, self.desc, self.log = total, initial, desc, log
        self.start = self.last = time.perf_counter()
        self.first = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.perf_counter() - self.last >= PROGRESS_SECONDS:
            self._line()

    def _line(self) -> None:
        self.last = now = time.perf_counter()
        rate = (self.n - self.first) / max(now - self.start, 1e-9)
        if self.total:
            left = max(self.total - self.n, 0) / rate if rate > 0 else float("inf")
            self.log.info("%s: step %d/%d (%.0f%%), %.1f steps/s, about %.0f s left", self.desc, self.n, self.total,
                          100 * self.n / self.total, rate, left)
        else:
            self.log.info("%s: step %d, %.1f steps/s", self.desc, self.n, rate)

    def close(self) -> None:
        self._line()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel's: IPython's shell is ipykernel's, which has a kernel (ipykernel
    merely imported, as by a test runner, is not one)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def progress(total: int | None, initial: int, desc: str, log: logging.Logger, enabled: bool = True):
    """tqdm.auto's bar on a terminal and in a notebook kernel (Jupyter's widget where ipywidgets is installed, text
    otherwise: a notebook redraws it in place, and its log lines would reach no handler there), :class:`LineProgress`
    lines otherwise (logs, CI, captured stderr); a bar that draws nothing when not ``enabled`` (ranks > 0)."""
    from tqdm.auto import tqdm

    if enabled and not sys.stderr.isatty() and not in_notebook():
        return LineProgress(total, initial, desc, log)
    return tqdm(total=total, initial=initial, unit="step", desc=desc, disable=not enabled)
