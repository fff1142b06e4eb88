"""Watching a run: progress lines when stderr is not a terminal, metrics.jsonl never empty, and the optional
trackers (``log="wandb"`` / ``"tensorboard"``): wired to each dictionary's metrics, imported only when asked for,
and a one-line error naming the package when it is missing."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.saes import metrics

pytestmark = pytest.mark.integration

SMALL = dict(hookpoint="blocks.0.hook_out", latents=32, k=4, batch_size=32, eval_batches=1, kernel_impl="reference",
             tokens=32 * 12)


def test_a_run_without_a_terminal_logs_progress_lines(tiny_lm_store, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(metrics, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO):
        cd.train(store=tiny_lm_store[0], out=tmp_path / "sae", **SMALL)
    lines = [r.getMessage() for r in caplog.records if "steps/s" in r.getMessage()]
    assert any("train topk: step 12/12 (100%)" in ln for ln in lines), lines
    assert len(lines) >= 12  # a line per step when the interval is 0, and one at the end


def test_metrics_jsonl_holds_the_last_step_of_a_run_shorter_than_log_every(tiny_lm_store, tmp_path):
    cd.train(store=tiny_lm_store[0], out=tmp_path / "sae", log_every=1000, **SMALL)
    records = [json.loads(ln) for ln in (tmp_path / "sae" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [12] and records[0]["rows"] == 12 * 32 and "fvu" in records[0]
    cd.train(store=tiny_lm_store[0], out=tmp_path / "sae5", log_every=5, **SMALL)
    records = [json.loads(ln) for ln in (tmp_path / "sae5" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 12]


class FakeWandb(types.ModuleType):
    """Records what training sends to wandb (the real package would need an account or offline files)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.runs: list[dict] = []
        self.__spec__ = types.SimpleNamespace(name="wandb")

    def init(self, **kwargs):
        run = {"init": kwargs, "logs": [], "finished": False}
        self.runs.append(run)
        fake = types.SimpleNamespace(log=lambda data, step: run["logs"].append((step, data)),
                                     finish=lambda: run.update(finished=True))
        return fake


def test_log_wandb_sends_each_dictionarys_metrics(tiny_lm_store, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: object())
    out = tmp_path / "sweep"
    assert main(["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "32",
                 "--batch-size", "32", "--eval-batches", "1", "--kernel-impl", "reference", "--tokens", "384",
                 "--log-every", "4", "--log", "wandb", "--sweep", "k=4,8", "--out", str(out)]) == 0
    assert len(fake.runs) == 2 and all(r["finished"] for r in fake.runs)
    assert sorted(r["init"]["name"] for r in fake.runs) == ["k-4", "k-8"]
    assert sorted(r["init"]["config"]["k"] for r in fake.runs) == [4, 8]
    for run in fake.runs:
        assert [step for step, _ in run["logs"]] == [4, 8, 12] and "fvu" in run["logs"][0][1]
        assert "step" not in run["logs"][0][1]
    # metrics.jsonl is still written beside the tracker
    assert (out / "k-4" / "metrics.jsonl").read_text().count("\n") == 3


def test_a_missing_tracker_package_is_one_line_before_training(tiny_lm_store, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
    assert main(["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "32",
                 "--k", "4", "--log", "tensorboard", "--out", str(tmp_path / "sae")]) != 0
    err = capsys.readouterr().err.strip()
    assert "needs the tensorboard package" in err and "pip install" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "sae" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="not a tracker"):
        cd.train(store=tiny_lm_store[0], out=tmp_path / "x", log="mlflow", **SMALL)


def test_log_tensorboard_writes_each_scalar_at_its_step(tiny_lm_store, tmp_path, monkeypatch):
    written = []

    class FakeWriter:  # torch.utils.tensorboard.SummaryWriter needs the tensorboard package
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append(("closed",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: object())
    cd.train(store=tiny_lm_store[0], out=tmp_path / "sae", log="tensorboard", log_every=4, **SMALL)
    assert written[0] == ("dir", str(tmp_path / "sae" / "tensorboard" / "sae")) and written[-1] == ("closed",)
    assert sorted({step for tag, *rest in written if tag == "fvu" for step in rest[1:]}) == [4, 8, 12]
    assert not any(tag == "step" for tag, *_ in written)


@pytest.fixture
def no_wandb_login(monkeypatch):
    """A wandb (fake) that finds no credentials: no WANDB_MODE, no WANDB_API_KEY, ``wandb.login(prompt=False)``
    answering False."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    fake = FakeWandb()
    fake.login = lambda prompt=True, **kwargs: False if prompt is False else pytest.fail("wandb prompted")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: object())
    return fake


def test_log_wandb_without_a_login_is_one_line_before_training(tiny_lm_store, tmp_path, no_wandb_login, capsys):
    assert main(["train", "--store", str(tiny_lm_store[0]), "--hookpoint", "blocks.0.hook_out", "--latents", "32",
                 "--k", "4", "--log", "wandb", "--out", str(tmp_path / "sae")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not logged in to Weights & Biases" in err, err
    assert "run `wandb login` first, or set WANDB_MODE=offline" in err
    assert not no_wandb_login.runs and not (tmp_path / "sae" / "metrics.jsonl").exists()


def test_the_wandb_login_check_reads_the_mode_the_key_and_wandbs_own_answer(no_wandb_login, monkeypatch):
    assert not metrics.wandb_credentials()
    for var, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "k" * 40)):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            m.setitem(sys.modules, "wandb", None)  # answered without importing wandb
            assert metrics.wandb_credentials()
    no_wandb_login.login = lambda anonymous=None, key=None: pytest.fail("an old wandb's login() prompts")
    no_wandb_login.api = types.SimpleNamespace(api_key=None)  # older wandb: the key from the environment / netrc
    assert not metrics.wandb_credentials()
    no_wandb_login.api.api_key = "k" * 40
    assert metrics.wandb_credentials()


def test_log_wandb_without_the_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as importlib sees a package that is not installed
    with pytest.raises(ValueError, match=r"log='wandb' needs the wandb package, which is not installed: pip install"):
        metrics.check_tracker("wandb")
