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


def test_text_only_flags_are_refused_for_an_image_model(tmp_path, tiny_clip_dir):
    cfg = CacheConfig(model=str(tiny_clip_dir), hookpoints=["vision.blocks.0.hook_out"], dataset=str(tmp_path),
                      out=tmp_path / "store", tokens_column="ids", progress=False)
    with pytest.raises(ValueError, match="image model: --tokens-column applies to text models only"):
        cache_activations(cfg)


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
    from conceptdict.activations import store_summary

    assert "2 unreadable image(s) skipped" in store_summary(store).dataset
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
    from conceptdict.activations.views import PatchRows

    patches = PatchRows(store)  # what cbm pools: patch tokens only
    assert patches.num_rows == 48 and (patches.position(0, 48) >= 0).all()
    assert patches.context_index(0, 48).tolist() == [i for i in range(3) for _ in range(16)]
    assert patches.labels("colour")[16] == "blue" and len(patches.labels("n")) == 48
    chunks = list(patches.iter_rows("vision.blocks.1.hook_out", chunk=20))
    torch.testing.assert_close(torch.cat([x for _, x in chunks]), patches.rows("vision.blocks.1.hook_out", 0, 48))
    torch.testing.assert_close(patches.rows("vision.blocks.1.hook_out", 15, 17),
                               store.rows("vision.blocks.1.hook_out", 16, 19)[[0, 2]])


@pytest.mark.parametrize("kind, rows_per_image", [("vit", 17), ("dinov2", 17), ("dinov2_with_registers", 17),
                                                  ("siglip", 16)])
def test_other_image_models_load_through_the_same_path(tmp_path, kind, rows_per_image):
    from fixtures_images import build_tiny_image_model

    handle = load_model(str(build_tiny_image_model(tmp_path / kind, kind)))
    assert handle.load_info["model_type"] == kind and handle.has_text == (kind == "siglip")
    pixels = vision.preprocess(handle, _images())
    got = vision.capture_images(handle, pixels, ["image.embed", "vision.blocks.0.hook_out"])
    with torch.no_grad():
        if kind == "siglip":
            want = handle.model.get_image_features(pixel_values=pixels)
            want = want if torch.is_tensor(want) else want.pooler_output
        else:
            want = handle.model(pixel_values=pixels).pooler_output
    torch.testing.assert_close(got["image.embed"], want)
    rows, pos = vision.patch_rows(handle, got["vision.blocks.0.hook_out"])
    assert rows.shape[0] == 3 * rows_per_image and pos[:rows_per_image].tolist()[-16:] == list(range(16))
    assert (pos[0] == -1) == (kind != "siglip")
    if kind == "siglip":
        assert embed_texts(handle, ["red", "a blue square"], "text.embed").shape == (2, 32)
    else:
        assert "text.embed" not in handle.hookpoints


def test_hub_shaped_records_decoded_images_and_byte_records(tmp_path, tiny_clip_dir):
    """A streamed hub image dataset yields decoded images or {"bytes", "path"} records: the same reader."""
    import io

    pngs = []
    for im in _images():
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    records = [{"image": _images()[0], "label": 0}, {"image": {"bytes": pngs[1], "path": "b.png"}, "label": 1},
               {"image": {"bytes": b"\x89PNG broken", "path": "c.png"}, "label": 2}]
    cfg = CacheConfig(model=str(tiny_clip_dir), hookpoints=["image.embed_normalized"], dataset="",
                      out=tmp_path / "store", progress=False)
    store = ActivationStore(cache_activations(cfg, records=records))
    assert store.num_rows == 2 and store.texts() == ["record 0", "b.png"] and store.labels("label") == [0, 1]
    assert store.manifest["images"]["skipped"][0][0] == "c.png"
    torch.testing.assert_close(store.rows("image.embed_normalized", 0, 2).float().norm(dim=-1), torch.ones(2))


def test_a_killed_image_cache_resumes_to_the_same_store(tmp_path, tiny_clip_dir, monkeypatch):
    from conceptdict.activations import images as images_mod

    root = make_shapes(tmp_path / "shapes", per_class=4)
    kwargs = dict(model=str(tiny_clip_dir), hookpoints=["vision.blocks.0.hook_out"], dataset=str(root),
                  batch_size=2, shard_rows=17 * 2, progress=False)
    whole = ActivationStore(cache_activations(CacheConfig(out=tmp_path / "whole", **kwargs)))
    real, calls = images_mod.decode, {"n": 0}

    def crash(record):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt
        return real(record)

    monkeypatch.setattr(images_mod, "decode", crash)
    with pytest.raises(KeyboardInterrupt):
        cache_activations(CacheConfig(out=tmp_path / "resumed", **kwargs))
    monkeypatch.setattr(images_mod, "decode", real)
    resumed = ActivationStore(cache_activations(CacheConfig(out=tmp_path / "resumed", **kwargs)))
    assert resumed.num_rows == whole.num_rows == 12 * 17
    for a, b in zip(whole.manifest["shards"], resumed.manifest["shards"]):
        assert a["sha256"] == b["sha256"]


def test_a_model_without_text_tower_is_named_with_the_packaged_encoder_and_a_warning(tmp_path, caplog):
    import transformers as tf
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    from conceptdict.naming.images import image_vocab_namer
    from conceptdict.naming.namers import NamingInputs

    torch.manual_seed(0)  # width 384: the packaged all-MiniLM-L6-v2's, so the two spaces can be compared at all
    tf.ViTModel(tf.ViTConfig(hidden_size=384, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(tmp_path / "vit")
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "vit")
    handle = load_model(str(tmp_path / "vit"))
    words = ["red", "circle", "river", "music"]
    (tmp_path / "words.txt").write_text("\n".join(words))
    with caplog.at_level(logging.WARNING):
        namer = image_vocab_namer(str(tmp_path / "words.txt"), "vit", "image.embed", lambda: handle, 1,
                                  tmp_path / "cache")
    assert "no text tower" in caplog.text and "not the image model's" in caplog.text
    text = embed_texts(load_model("default"), words, "sentence.mean_normalized")
    directions = text[[2, 0]] + 0.01 * torch.randn(2, 384)
    assert [r.name for r in namer(NamingInputs(directions))] == ["river", "red"]
