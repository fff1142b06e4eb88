"""`conceptdict hookpoints` / `cd.hookpoints`: every hookpoint of a tiny text and a tiny image model with the shape
one probe forward measures, checked against what capturing each hookpoint really gives; `--hookpoint help`
points to the command."""

from __future__ import annotations

import pytest

import conceptdict as cd
from conceptdict.activations.models import capture
from conceptdict.activations.vision import capture_images, preprocess
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration


def test_text_model_lists_every_hookpoint_with_the_width_capture_gives(tiny_lm_dir):
    import torch

    model = cd.load_model(str(tiny_lm_dir))
    table = cd.hookpoints(model)
    assert table.names() == model.hookpoints and len(table) > 100  # every name, aliases included, no "..."
    assert table.get("blocks.0.hook_out")[1:] == ("[T, 32]", 32, "token", "")
    assert table.get("blocks.1.mlp.hook_post").d == 128 and table.get("blocks.0.attn.hook_z").shape == "[T, 2, 16]"
    pattern = table.get("blocks.0.attn.hook_pattern")
    assert pattern.shape == "[2, T, T]" and pattern.d is None
    assert table.get("embed.hook_in").d is None and "token ids" in table.get("embed.hook_in").note
    assert "use_attn_result" in table.get("blocks.0.attn.hook_result").note
    assert table.get("sentence.mean_normalized")[1:4] == ("[32]", 32, "sequence")
    cacheable = [h.name for h in table if h.d is not None and h.rows == "token"]
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    got = capture(model, ids, torch.ones_like(ids), cacheable)
    assert {h: got[h].shape[-1] for h in cacheable} == {h: table.get(h).d for h in cacheable}
    with pytest.raises(KeyError, match="closest: blocks.0.hook_out"):
        table.get("blocks.0.hook_outt")


def test_cli_prints_the_whole_table_and_help_points_to_it(tiny_lm_dir, tmp_path, capsys):
    assert main(["hookpoints", "--model", str(tiny_lm_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = cd.load_model(str(tiny_lm_dir)).hookpoints
    assert lines[0].startswith(f"{len(names)} hookpoints of {tiny_lm_dir}") and len(lines) == len(names) + 2
    assert [line.split()[0] for line in lines[2:]] == names
    row = next(line.split() for line in lines if line.startswith("blocks.1.hook_resid_pre "))
    assert row == ["blocks.1.hook_resid_pre", "[T,", "32]", "32", "token"]
    (tmp_path / "d.txt").write_text("alpha beta\n")
    for value, expected in [("help", "--hookpoint help: `conceptdict hookpoints --model"),
                            ("nothing_like_it", "unknown hookpoint 'nothing_like_it'")]:
        rc = main(["cache", "--model", str(tiny_lm_dir), "--hookpoint", value, "--dataset", str(tmp_path / "d.txt"),
                   "--out", str(tmp_path / value)])
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert rc == 1 and len(err) == 1 and expected in err[0], err
        assert f"lists all {len(names)} with their shapes" in err[0] and "..." not in err[0]


def test_image_models_list_pooled_block_and_text_hookpoints(tiny_clip_dir, tmp_path):
    from PIL import Image

    from fixtures_images import build_tiny_image_model

    clip = cd.load_model(str(tiny_clip_dir))
    table = cd.hookpoints(clip)
    assert table.names() == clip.hookpoints
    assert table.get("image.embed")[1:4] == ("[16]", 16, "image")
    block = table.get("vision.blocks.1.hook_out")
    assert block[1:4] == ("[17, 32]", 32, "image token") and "CLS + 16 patches" in block.note
    assert table.get("text.embed_normalized")[1:4] == ("[16]", 16, "text")
    pixels = preprocess(clip, [Image.new("RGB", (48, 40))])
    got = capture_images(clip, pixels, ["image.embed", "vision.blocks.1.hook_out"])
    assert got["image.embed"].shape[-1] == 16 and tuple(got["vision.blocks.1.hook_out"].shape[1:]) == (17, 32)
    registers = cd.hookpoints(str(build_tiny_image_model(tmp_path / "reg", "dinov2_with_registers")))
    assert registers.get("vision.blocks.0.hook_out").shape == "[19, 32]"
    assert "CLS + 16 patches, 2 registers not stored" in registers.get("vision.blocks.0.hook_out").note


@pytest.mark.unit
def test_the_bundled_model_is_called_default_in_messages(tmp_path):
    from conceptdict.activations import DEFAULT_MODEL_DIR
    from conceptdict.activations.models import unknown_hookpoint

    message = unknown_hookpoint("help", ["a", "b"], str(DEFAULT_MODEL_DIR()))
    assert message == ("--hookpoint help: `conceptdict hookpoints --model default` lists all 2 with their shapes "
                       "(or, in Python, cd.hookpoints('default'))")
    assert "--model " + str(tmp_path) + "`" in unknown_hookpoint("zzz", ["a"], str(tmp_path))
