"""`export --push hf:OWNER/REPO`: the written directory goes to HfApi.upload_folder (monkeypatched: no network),
and a missing login, offline mode or a refused upload are one line, checked before anything is written."""

from __future__ import annotations

import fnmatch
import os

import pytest
import torch

from conceptdict.cli.main import main

pytestmark = pytest.mark.unit


@pytest.fixture
def sae(tmp_path):
    from conceptdict.saes import SparseCoder, save_dictionary

    torch.manual_seed(0)
    model = SparseCoder(16, 32, 4, kind="topk")
    return save_dictionary(model, tmp_path / "sae", extra={"hookpoints": ["blocks.2.hook_out"]})


@pytest.fixture
def hub(monkeypatch):
    """Records create_repo / upload_folder calls; online, logged in as a fake token."""
    import huggingface_hub
    from huggingface_hub import constants

    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw, self.token))

    def upload_folder(self, **kw):
        ignored = kw.get("ignore_patterns") or []
        files = [f for f in os.listdir(kw["folder_path"]) if not any(fnmatch.fnmatch(f, p) for p in ignored)]
        calls.append(("upload_folder", kw["repo_id"], kw, files))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/abc"})()

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return calls


def test_export_push_uploads_the_written_directory(sae, tmp_path, hub, capsys):
    out = tmp_path / "saelens"
    rc = main(["export", str(sae), "--format", "saelens", "--out", str(out), "--push", "hf:me/my-saes/layer_2"])
    assert rc == 0, capsys.readouterr().err
    assert [c[0] for c in hub] == ["create_repo", "upload_folder"]
    assert hub[0][1] == "me/my-saes" and hub[0][2] == {"exist_ok": True} and hub[0][3] == "hf_fake"
    name, repo, kw, files = hub[1]
    assert repo == "me/my-saes" and kw["folder_path"] == str(out) and kw["path_in_repo"] == "layer_2"
    assert sorted(files) == ["README.md", "cfg.json", "sae_weights.safetensors"]
    assert f"uploaded {out} to hf:me/my-saes/layer_2" in capsys.readouterr().out


@pytest.mark.parametrize("setup, message", [
    ("no-token",
     "--push hf:me/r: not logged in to the Hugging Face hub (no token); run `hf auth login` or set HF_TOKEN"),
    ("offline", "--push hf:me/r: uploading needs the network but HF_HUB_OFFLINE is set"),
    ("bad-name", "is not a hub dictionary name; write hf:OWNER/REPO"),
])
def test_push_refusals_are_one_line_and_write_nothing(sae, tmp_path, hub, monkeypatch, capsys, setup, message):
    import huggingface_hub
    from huggingface_hub import constants

    if setup == "no-token":
        monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    if setup == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    target = "me-r" if setup == "bad-name" else "hf:me/r"
    out = tmp_path / "x"
    rc = main(["export", str(sae), "--format", "saelens", "--out", str(out), "--push", target])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and message in err[0], err
    assert hub == [] and not (out / "cfg.json").exists()


def test_a_refused_upload_is_one_line_naming_the_fix(sae, tmp_path, hub, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    def refuse(self, **kw):
        raise HfHubHTTPError("403 Forbidden: you cannot write to me/r.\nRequest id: x",
                             response=type("R", (), {"status_code": 403, "headers": {}, "request": None})())

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", refuse)
    rc = main(["export", str(sae), "--format", "saelens", "--out", str(tmp_path / "y"), "--push", "hf:me/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "the hub refused the upload" in err[0] and "(HTTP 403)" in err[0] and "write access" in err[0]
    assert (tmp_path / "y" / "cfg.json").exists()  # the export itself is kept
