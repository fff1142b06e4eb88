"""DN-CBM through the CLI on a tiny random CLIP and shapes drawn in the test: cache (image embedding and patch
hookpoints) -> train -> name with the model's text tower -> cbm from the image store (SuperActivator pooling
over patches) -> HTML report with thumbnails and patch heat maps, rendered in headless Chromium."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from fixtures_images import COLOURS, SHAPES, make_shapes
from test_report import OFFLINE_FLAGS, chromium_binary

from conceptdict.activations import ActivationStore, embed_texts, load_model
from conceptdict.cli.main import main

pytestmark = pytest.mark.integration
WORDS = list(COLOURS) + list(SHAPES) + ["grey", "sky", "tree", "car"]


@pytest.fixture(scope="module")
def flow(tmp_path_factory, tiny_clip_dir):
    tmp = tmp_path_factory.mktemp("dncbm")
    images = make_shapes(tmp / "shapes", per_class=24)
    (tmp / "words.txt").write_text("\n".join(WORDS) + "\n")
    cache = ["--cache-dir", str(tmp / "vocab-cache")]
    for name, hookpoint in (("embed", "image.embed"), ("patch", "vision.blocks.1.hook_out")):
        assert main(["cache", "--model", str(tiny_clip_dir), "--hookpoint", hookpoint, "--dataset", str(images),
                     "--batch-size", "8", "--out", str(tmp / name / "store")]) == 0
        assert main(["train", "--store", str(tmp / name / "store"), "--latents", "32", "--k", "4",
                     "--batch-size", "8", "--out", str(tmp / name / "sae")]) == 0
        assert main(["name", str(tmp / name / "sae"), "--vocab", str(tmp / "words.txt"), *cache,
                     "--top-k", "8", "--out", str(tmp / name / "concepts")]) == 0
        assert main(["cbm", str(tmp / name / "concepts"), "--label-column", "label", "--pooling", "super",
                     "--out", str(tmp / name / "cbm")]) == 0
    return tmp


def test_names_come_from_the_models_text_tower(flow, tiny_clip_dir):
    doc = json.loads((flow / "embed" / "concepts" / "concepts.json").read_text())
    assert doc["meta"]["namer"] == "vocab" and doc["meta"]["hookpoint"] == "image.embed"
    from conceptdict.saes import load_dictionary

    dirs = load_dictionary(flow / "embed" / "sae").decoder_directions().detach().float()
    handle = load_model(str(tiny_clip_dir))
    text = torch.nn.functional.normalize(embed_texts(handle, WORDS, "text.embed"), dim=-1)
    cos = torch.nn.functional.normalize(dirs, dim=-1) @ text.T
    for c in doc["concepts"]:  # DN-CBM: argmax over the vocabulary of cos(CLIP text embedding, decoder row)
        assert c["name"] == WORDS[int(cos[c["id"]].argmax())]
        assert c["score"] == pytest.approx(float(cos[c["id"]].max()), abs=1e-5)
    example = next(c for c in doc["concepts"] if c["top_examples"])["top_examples"][0]
    assert example["image"]["heat"] is None and example["text"].endswith(".png")
    assert all(v.startswith("data:image/png;base64,") for v in doc["meta"]["thumbnails"].values())


def test_patch_dictionary_has_heat_maps_and_the_cbm_pools_patches(flow):
    doc = json.loads((flow / "patch" / "concepts" / "concepts.json").read_text())
    assert doc["meta"]["patch_grid"] == [4, 4]
    fired = [c for c in doc["concepts"] if c["top_examples"]]
    ex = fired[0]["top_examples"][0]
    assert len(ex["image"]["heat"]) == 16 and max(ex["image"]["heat"]) <= 255
    if ex["text"].split(" \u00b7 ")[-1].startswith("patch"):  # the top row is a patch: it is the image's hottest
        assert ex["image"]["heat"][int(ex["text"].split("patch ")[1].split()[0])] == 255
    cbm = json.loads((flow / "patch" / "cbm" / "cbm.json").read_text())
    assert cbm["meta"]["pooling"] == "super" and sorted(cbm["classes"]) == sorted(COLOURS)
    store = ActivationStore(flow / "patch" / "store")
    assert store.num_rows == 72 * 17 and cbm["metrics"]["n_train"] + cbm["metrics"]["n_val"] + \
        cbm["metrics"]["n_test"] == 72


def test_report_shows_thumbnails_and_heat_maps_in_headless_chromium(flow, tmp_path):
    report = flow / "patch" / "cbm" / "report"
    index = (report / "index.html").read_text()
    assert '<image href="thumbs/' in index and 'fill="#ffd400"' in index
    assert len(list((report / "thumbs").glob("*.png"))) >= 1
    assert '<img src="thumbs/' in (flow / "embed" / "cbm" / "report" / "index.html").read_text()
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install -y chromium)")
    shot = tmp_path / "shot.png"
    common = [binary, *OFFLINE_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    run = subprocess.run([*common, f"--screenshot={shot}", (report / "index.html").as_uri()], capture_output=True,
                         timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, run.stderr.decode()[-2000:]
    dom = subprocess.run([*common, "--dump-dom", (report / "index.html").as_uri()], capture_output=True,
                         timeout=120).stdout.decode()
    assert "<svg" in dom and "thumbs/" in dom and "<script" not in dom.lower()
