"""Image models (activations.vision) and image datasets (activations.images, image_cache) on a tiny CLIP."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from fixtures_images import COLOURS, draw, make_shapes

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations, embed_texts, load_model
from conceptdict.activations import vision

pytestmark = pytest.mark.integration


def _images():
    return [draw(shape, rgb, jitter=j) for j, (shape, rgb) in enumerate(
        [("circle", COLOURS["red"]), ("square", COLOURS["blue"]), ("triangle", COLOURS["green"])])]


def test_image_path_equals_transformers_own_features(tiny_clip_dir):
    handle = load_model(str(tiny_clip_dir))
    assert isinstance(handle, vision.ImageModelHandle) and handle.has_text
    pixels = vision.preprocess(handle, _images())
    got = vision.capture_images(handle, pixels, ["image.embed", "image.embed_normalized",
                                                 "vision.blocks.1.hook_out"])
    with torch.no_grad():
        want = handle.model.get_image_features(pixel_values=pixels)
        want = want if torch.is_tensor(want) else want.pooler_output
        hidden = handle.model.vision_model(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert got["image.embed"].shape == (3, 16)
    torch.testing.assert_close(got["image.embed"], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["image.embed_normalized"], torch.nn.functional.normalize(want, dim=-1))
    torch.testing.assert_close(got["vision.blocks.1.hook_out"], hidden[2])
    words = ["red", "a blue square", "green triangle"]
    enc = handle.tokenizer(words, padding=True, return_tensors="pt")
    with torch.no_grad():
        text = handle.model.get_text_features(**enc)
        text = text if torch.is_tensor(text) else text.pooler_output
    torch.testing.assert_close(embed_texts(handle, words, "text.embed"), text, rtol=1e-5, atol=1e-6)
    assert handle.d_model("image.embed") == 16 and handle.d_model("vision.blocks.0.hook_out") == 32


def test_patch_rows_mark_the_cls_row_and_number_the_patches(tiny_clip_dir):
    handle = load_model(str(tiny_clip_dir))
    tokens = torch.arange(2 * 17 * 1, dtype=torch.float32).reshape(2, 17, 1)
    rows, pos = vision.patch_rows(handle, tokens)
    assert rows.shape == (34, 1) and pos[:3].tolist() == [-1, 0, 1] and pos[17:19].tolist() == [-1, 0]
    assert rows[:, 0].tolist() == list(range(34))  # CLS first, then patches in the tower's order
    assert vision.patch_grid(16) == [4, 4]


def test_unknown_hookpoint_lists_the_valid_ones(tiny_clip_dir):
    handle = load_model(str(tiny_clip_dir))
    with pytest.raises(ValueError, match=r"unknown hookpoint 'vision.blocks.7.hook_out'.*vision\.blocks\.\d"):
        vision.check_image_hookpoints(handle, ["vision.blocks.7.hook_out"])
    with pytest.raises(ValueError, match="embeds texts"):
        vision.check_image_hookpoints(handle, ["text.embed"])


def test_folder_with_a_truncated_and_a_non_image_file_caches_the_rest(tmp_path, tiny_clip_dir, caplog):
    root = make_shapes(tmp_path / "shapes", per_class=3)
    good = (root / "red" / "circle-0.png").read_bytes()
    (root / "red" / "broken.png").write_bytes(good[: len(good) // 2])
    (root / "blue" / "notes.txt").write_text("not an image")
    cfg = CacheConfig(model=str(tiny_clip_dir), hookpoints=["image.embed"], dataset=str(root),
                      out=tmp_path / "store", batch_size=4, progress=False)
    with caplog.at_level(logging.WARNING):
        store = ActivationStore(cache_activations(cfg))
    assert store.level == "sequence" and store.num_rows == 9
    skipped = store.manifest["images"]["skipped"]
    assert store.manifest["images"]["skipped_count"] == 2
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in skipped) == ["broken.png", "notes.txt"]
    assert "broken.png" in caplog.text and "notes.txt" in caplog.text and "skipped 2" in caplog.text
    labels = store.labels("label")
    assert sorted(set(labels)) == sorted(COLOURS) and labels.count("red") == 3
    texts = store.texts()
    assert all(t.endswith(".png") for t in texts) and not any("broken" in t for t in texts)
    ctx = store.context_index(0, store.num_rows).tolist()
    rec = store.image_records[ctx[0]]
    assert rec["source"] == texts[0] and rec["thumbnail"].startswith("data:image/png;base64,")
    assert len(rec["sha256"]) == 16
    handle = load_model(str(tiny_clip_dir))
    from PIL import Image

    direct = vision.capture_images(handle, vision.preprocess(handle, [Image.open(texts[0]).convert("RGB")]),
                                   ["image.embed"])["image.embed"]
    torch.testing.assert_close(store.rows("image.embed", 0, 1).float(), direct)


def test_patch_store_keeps_positions_and_a_table_of_image_bytes(tmp_path, tiny_clip_dir):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    blobs = []
    for im in _images():
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        blobs.append(buf.getvalue())
    table = pa.table({"img": blobs, "colour": ["red", "blue", "green"], "n": [1, 2, 3]})
    pq.write_table(table, tmp_path / "images.parquet")
    cfg = CacheConfig(model=str(tiny_clip_dir), hookpoints=["vision.blocks.0.hook_out", "vision.blocks.1.hook_out"],
                      dataset=str(tmp_path / "images.parquet"), image_column="img", out=tmp_path / "store",
                      batch_size=2, progress=False)
    store = ActivationStore(cache_activations(cfg))
    assert store.level == "token" and store.num_rows == 3 * 17
    assert store.manifest["images"]["patch_grid"] == [4, 4] and store.manifest["images"]["cls_position"] == -1
    pos = store.position(0, 17).tolist()
    assert pos == [-1] + list(range(16))
    assert store.context_index(0, store.num_rows).tolist() == [i for i in range(3) for _ in range(17)]
    assert store.labels("colour")[17] == "blue" and store.labels("n")[-1] == 3
    assert store.row_context(5).text == "record 0 \u00b7 patch 4 (row 1, column 0)"
    assert "CLS" in store.row_context(17).text
    assert json.loads((tmp_path / "store" / "manifest.json").read_text())["model"]["modality"] == "image"
