"""One writer per output directory, and an output never inside its own input (issue 39): the guard every command
that writes --out goes through (``conceptdict.outdir``), from the command line and from Python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.torch import load_file

import conceptdict as cd
from conceptdict.activations.lock import LOCK_NAME
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

TRAIN = ["--latents", "16", "--k", "2", "--batch-size", "64", "--seed", "3"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("outdirs")
    np.save(root / "rows.npy", np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32))
    assert main(["store", "import", str(root / "rows.npy"), "--out", str(root / "store")]) == 0
    return root / "store"


def _conceptdict(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; from conceptdict.cli.main import main; "
                             "sys.exit(main())", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_trains_on_one_out_the_second_stops_naming_the_first(store, tmp_path):
    out, alone = tmp_path / "sae", tmp_path / "alone"
    argv = ["train", "--store", str(store), *TRAIN, "--tokens", "64000"]
    first = _conceptdict(*argv, "--out", str(out))
    deadline = time.monotonic() + 120
    lock = out / LOCK_NAME
    while not (lock.exists() and lock.stat().st_size) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)  # the first holds the lock, paused: the second starts while it writes
    try:
        assert first.poll() is None, first.communicate()
        second = _conceptdict(*argv, "--out", str(out))
        _, err = second.communicate(timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 1, err
    assert f"--out {out} is being written by pid {first.pid} on host" in err and "Traceback" not in err
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    # the same command alone, in a fresh process like the first (not in this worker, whose state earlier tests set)
    run_alone = _conceptdict(*argv, "--out", str(alone))
    _, err = run_alone.communicate(timeout=600)
    assert run_alone.returncode == 0, err
    got, want = load_file(str(out / "weights.safetensors")), load_file(str(alone / "weights.safetensors"))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)
    assert not (out / LOCK_NAME).exists()


def test_an_out_inside_its_input_is_refused(store, tmp_path, capsys):
    assert main(["train", "--store", str(store), *TRAIN, "--out", str(store / "sae")]) == 1
    err = capsys.readouterr().err
    assert f"--out {store / 'sae'} is inside the input {store}" in err
    assert not (store / "sae").exists()
    sae = tmp_path / "sae"
    assert main(["train", "--store", str(store), *TRAIN, "--out", str(sae)]) == 0
    assert main(["export", str(sae), "--format", "saelens", "--out", str(sae)]) == 1
    assert f"--out {sae} is the input {sae}" in capsys.readouterr().err


def test_the_python_api_is_guarded_like_the_command_line(store, tmp_path):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("my metrics\n")
    with pytest.raises(FileExistsError, match="holds files conceptdict did not create"):
        cd.train(store=str(store), latents=16, k=2, out=mine)
    assert [p.name for p in mine.iterdir()] == ["metrics.jsonl"]
    cd.train(store=str(store), latents=16, k=2, batch_size=64, tokens=4096, out=mine, overwrite=True)
    assert (mine / "weights.safetensors").exists() and (mine / "metrics.jsonl").exists()


def test_a_refused_run_leaves_no_directory_behind(store, tmp_path, capsys):
    out = tmp_path / "runs" / "a" / "sae"
    assert main(["train", "--store", str(store), *TRAIN, "--lr", "inf", "--out", str(out)]) == 1
    assert "lr=inf must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # the --out and the parents made for it
