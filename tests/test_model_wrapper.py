"""The model wrapper (issue 51 item 4): tokens in and out, run_with_cache, run_with_saes (one splice with
cd.splice), embed_texts / embed_images, and a one-line repr, on the tiny local models."""

from __future__ import annotations

import pytest
import torch
from fixtures_images import COLOURS, draw

import conceptdict as cd
from conceptdict.activations.models import capture
from conceptdict.saes import SparseCoder

pytestmark = pytest.mark.integration

TEXTS = ["cat dog", "the cat and the dog with bread"]


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    return cd.load_model(str(tiny_lm_dir))


@pytest.fixture(scope="module")
def clip(tiny_clip_dir):
    return cd.load_model(str(tiny_clip_dir))


def _sae(hookpoint: str, d: int = 32, latents: int = 64, seed: int = 0) -> SparseCoder:
    torch.manual_seed(seed)
    sae = SparseCoder(d, latents, 4, kind="topk").eval()
    sae.config = {"hookpoints": [hookpoint]}
    return sae


def _identity_sae(hookpoint: str, d: int = 32) -> SparseCoder:
    """A ReLU dictionary whose reconstruction is x itself: latents +e_i and -e_i, relu(x) - relu(-x) = x."""
    sae = SparseCoder(d, 2 * d, 1, kind="relu").eval()
    eye = torch.eye(d)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], dim=1))
        sae.W_dec.copy_(torch.cat([eye, -eye], dim=0))
    sae.config = {"hookpoints": [hookpoint]}
    return sae


def test_repr_is_one_short_line(lm, clip):
    from conceptdict.activations import Model

    default = cd.load_model("default")
    for model, family in ((lm, "text"), (clip, "image"), (default, "text")):
        assert isinstance(model, Model) and model.family == family
        text = repr(model)
        assert len(text) < 200 and "\n" not in text and f"family={family!r}" in text, text
    assert repr(default).startswith("ModelHandle('default', family='text', model_type='bert', device='cpu', "
                                    "dtype='float32', hookpoints=")


def test_to_tokens_pads_wraps_and_round_trips(lm):
    one = lm.to_tokens("cat dog")
    assert one.shape == (1, 3) and int(one[0, 0]) == lm.tokenizer.bos_token_id  # a causal LM's BOS, as the cache
    ids, mask = lm.to_tokens(TEXTS, return_mask=True)
    assert ids.shape == mask.shape == (2, 8) and mask.sum(1).tolist() == [3, 8]
    assert (ids[0, 3:] == lm.bos_pad_ids()[1]).all()
    assert lm.to_string(one[0]) == "<|endoftext|> cat dog"
    assert lm.to_string(ids)[1] == "<|endoftext|> the cat and the dog with bread"
    assert lm.to_tokens(TEXTS[1], max_length=2).shape == (1, 3)
    with pytest.raises(TypeError, match="a text or a non-empty list of texts"):
        lm.to_tokens([1, 2])


def test_run_with_cache_gives_the_same_from_texts_and_ids(lm):
    names = ["blocks.0.hook_out", "blocks.1.mlp.hook_post", "sentence.mean"]
    logits, cache = lm.run_with_cache(TEXTS, names=names)
    tokens = lm.to_tokens(TEXTS, return_mask=True)
    logits_ids, cache_ids = lm.run_with_cache(tokens.ids, names=names, mask=tokens.mask)
    assert logits.shape == (2, 8, lm.vocab_size)
    assert cache["blocks.0.hook_out"].shape == (2, 8, 32) and cache["blocks.1.mlp.hook_post"].shape == (2, 8, 128)
    assert cache["sentence.mean"].shape == (2, 32)
    torch.testing.assert_close(logits, logits_ids)
    for name in names:
        torch.testing.assert_close(cache[name], cache_ids[name])
    staged = capture(lm, tokens.ids, tokens.mask, names)  # what the cache stage stores
    for name in names:
        torch.testing.assert_close(cache[name], staged[name])
    alone, one = lm.run_with_cache(TEXTS[0], names="blocks.0.hook_out")  # right padding leaves a causal LM's rows
    torch.testing.assert_close(one["blocks.0.hook_out"][0], cache["blocks.0.hook_out"][0, :3])
    torch.testing.assert_close(alone[0], logits[0, :3])
    torch.testing.assert_close(lm(TEXTS), logits)


def test_run_with_cache_defaults_to_every_cacheable_hookpoint(lm):
    _, cache = lm.run_with_cache("cat dog")
    assert set(cache) == set(cd.hookpoints(lm).names()) - {h.name for h in cd.hookpoints(lm) if h.d is None}
    assert all(v.shape[:2] == (1, 3) or v.shape == (1, 32) for v in cache.values())
    cache["blocks.0.hook_out"][:, 0] = 0  # plain tensors a user may edit (not inference-mode ones)


def test_run_with_saes_codes_are_the_encoding_of_the_cached_activations(lm):
    saes = [_sae("blocks.0.hook_out", seed=1), _sae("blocks.1.hook_out", seed=2)]
    logits, codes = lm.run_with_saes(TEXTS, saes=saes, return_codes=True)
    _, clean = lm.run_with_cache(TEXTS, names=["blocks.0.hook_out"])
    x = clean["blocks.0.hook_out"]
    assert codes["blocks.0.hook_out"].shape == codes["blocks.1.hook_out"].shape == (2, 8, 64)
    torch.testing.assert_close(codes["blocks.0.hook_out"], saes[0].encode(x.reshape(-1, 32)).reshape(2, 8, 64))
    # the second dictionary reads block 1's output of the forward the first one edited
    with cd.splice(lm, saes[0]):
        _, edited = lm.run_with_cache(TEXTS, names=["blocks.1.hook_out"])
    torch.testing.assert_close(codes["blocks.1.hook_out"],
                               saes[1].encode(edited["blocks.1.hook_out"].reshape(-1, 32)).reshape(2, 8, 64))
    with cd.splice(lm, saes[0]), cd.splice(lm, saes[1]):  # the context-manager form: the same splice
        torch.testing.assert_close(lm(TEXTS), logits)
    assert not torch.allclose(logits, lm(TEXTS), atol=1e-3)  # a random dictionary changes the logits
    torch.testing.assert_close(lm.run_with_saes(TEXTS, {"blocks.0.hook_out": saes[0]}),
                               lm.run_with_saes(TEXTS, saes[0]))


def test_an_identity_dictionary_leaves_the_logits(lm):
    sae = _identity_sae("blocks.0.hook_out")
    torch.testing.assert_close(lm.run_with_saes(TEXTS, [sae]), lm(TEXTS), atol=1e-5, rtol=1e-5)
    ids = lm.to_tokens(TEXTS[1])
    torch.testing.assert_close(lm.run_with_saes(ids, [sae]), lm.run_with_saes(TEXTS[1], [sae]))


def test_splicing_a_pooled_hookpoint_points_to_embed_texts(lm):
    with pytest.raises(ValueError, match=r"model\.embed_texts\(texts, hookpoint='sentence\.mean'\) \(or "
                                         r"cd\.embed_texts\(model, texts, 'sentence\.mean'\)\)"):
        lm.run_with_saes("cat dog", [_sae("sentence.mean")])


def test_embed_texts_is_the_pooled_row_a_sentence_dictionary_encodes(tiny_bert_dir):
    bert = cd.load_model(str(tiny_bert_dir))
    got = cd.embed_texts(bert, TEXTS)
    _, cache = bert.run_with_cache(TEXTS, names=["sentence.mean_normalized"])
    assert got.shape == (2, 32)
    torch.testing.assert_close(got, cache["sentence.mean_normalized"])
    torch.testing.assert_close(bert.embed_texts(TEXTS, hookpoint="sentence.mean"),
                               cd.embed_texts(str(tiny_bert_dir), TEXTS, "sentence.mean"))


def test_image_models_cache_and_embed_images(clip, tmp_path):
    from conceptdict.activations import vision

    images = [draw("circle", COLOURS["red"]), draw("square", COLOURS["blue"])]
    images[1].save(tmp_path / "square.png")
    output, cache = clip.run_with_cache([images[0], tmp_path / "square.png"])
    want = vision.capture_images(clip, vision.preprocess(clip, images), ["image.embed", "vision.blocks.1.hook_out"])
    assert set(cache) == {h for h in clip.hookpoints if not h.startswith("text.")}
    torch.testing.assert_close(output, want["image.embed"])
    torch.testing.assert_close(cache["vision.blocks.1.hook_out"], want["vision.blocks.1.hook_out"])
    assert cache["vision.blocks.1.hook_out"].shape == (2, 17, 32)
    torch.testing.assert_close(cd.embed_images(clip, images), want["image.embed"])
    blocks = clip.embed_images(images, hookpoint="vision.blocks.1.hook_out")
    torch.testing.assert_close(blocks, want["vision.blocks.1.hook_out"].mean(1))  # CLS + 16 patches, no registers
    assert cd.embed_texts(clip, ["red", "a blue square"]).shape == (2, 16)  # the text tower, text.embed
    with pytest.raises(ValueError, match="dictionaries splice into the forward of a text model"):
        cd.splice(clip, _sae("vision.blocks.1.hook_out"))
    with pytest.raises(ValueError, match="is a text model: embed_images needs an image model"):
        cd.embed_images(cd.load_model("default"), images)
