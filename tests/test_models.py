"""Model loading, hookpoint capture, sentence pooling, embeddings and spliced losses on tiny local models."""

from __future__ import annotations

import pytest
import torch

from conceptdict.activations import embed_texts, load_model, spliced_losses
from conceptdict.activations.models import capture

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    return load_model(str(tiny_lm_dir))


@pytest.fixture(scope="module")
def bert(tiny_bert_dir):
    return load_model(str(tiny_bert_dir))


def test_load_records_how(lm):
    info = lm.load_info
    assert info["loader"].endswith("TransformerBridge.boot_transformers")
    assert info["weight_processing"].startswith("none")
    assert info["dtype"] == "float32" and info["kind"] == "local directory" and info["model_type"] == "gpt2"
    assert {"torch", "transformers", "transformer-lens"} <= set(info["versions"])
    assert lm.is_causal and "blocks.1.hook_out" in lm.hookpoints and "sentence.mean" in lm.hookpoints
    assert lm.d_model("blocks.1.hook_out") == 32 and lm.d_model("blocks.0.mlp.hook_post") == 128
    assert lm.unembed().shape == (32, len(lm.tokenizer))
    assert lm.decode(lm.tokenizer("cat dog", add_special_tokens=False)["input_ids"]) == ["cat", "dog"]


def test_unknown_hookpoint_lists_closest(lm):
    with pytest.raises(ValueError, match=r"unknown hookpoint 'blocks\.1\.hook_ot'.*blocks\.1\.hook_out"):
        lm.d_model("blocks.1.hook_ot")


def test_capture_matches_hf_and_stops_early(lm, tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(5, 200, (3, 11))
    mask = torch.ones_like(ids)
    fired = []
    lm.bridge.hook_dict["blocks.1.hook_out"].add_hook(lambda t, hook: fired.append(1))
    try:
        got = capture(lm, ids, mask, ["blocks.0.hook_out", "blocks.0.hook_resid_post"])
    finally:
        lm.bridge.reset_hooks()
    assert not fired, "the forward went past the deepest requested hookpoint"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)).eval()
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
    assert got["blocks.0.hook_out"].shape == (3, 11, 32)
    torch.testing.assert_close(got["blocks.0.hook_out"], hidden[1])
    torch.testing.assert_close(got["blocks.0.hook_resid_post"], hidden[1])
    pooled = capture(lm, ids, mask, ["sentence.mean"])["sentence.mean"]
    torch.testing.assert_close(pooled, hidden[-1].mean(1))  # GPT-2: last hidden state is after ln_f


def test_sentence_pooling_ignores_padding(bert, tiny_bert_dir):
    from transformers import AutoModel

    enc = bert.tokenizer(["cat dog bird", "rain snow wind sun cloud fog"], padding=True, return_tensors="pt")
    got = capture(bert, enc["input_ids"], enc["attention_mask"], ["sentence.mean", "sentence.mean_normalized"])
    hf = AutoModel.from_pretrained(str(tiny_bert_dir)).eval()
    with torch.no_grad():
        last = hf(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    want = (last * m).sum(1) / m.sum(1)
    torch.testing.assert_close(got["sentence.mean"], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["sentence.mean_normalized"], torch.nn.functional.normalize(want, dim=-1),
                               atol=1e-5, rtol=1e-5)
    short = bert.tokenizer(["cat dog bird"], return_tensors="pt")
    alone = capture(bert, short["input_ids"], short["attention_mask"], ["sentence.mean"])["sentence.mean"]
    torch.testing.assert_close(alone[0], got["sentence.mean"][0], atol=1e-5, rtol=1e-5)


def test_embed_texts(bert):
    texts = ["cat dog", "rain snow wind", "bread apple cheese rice"]
    emb = embed_texts(bert, texts, "sentence.mean_normalized", batch_size=2)
    assert emb.shape == (3, 32) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    tok = embed_texts(bert, texts, "blocks.0.hook_out")
    assert tok.shape == (3, 32)


def test_spliced_losses(lm):
    ids = torch.randint(5, 200, (4, 16))
    ids[:, 0] = lm.tokenizer.bos_token_id
    same = spliced_losses(lm, "blocks.0.hook_out", ids, lambda x: x)
    assert same.ce_replaced == pytest.approx(same.ce_clean, abs=1e-5)
    assert same.kl_replaced == pytest.approx(0.0, abs=1e-5)
    assert same.kl_zero > 0 and same.ce_zero != pytest.approx(same.ce_clean)
    noisy = spliced_losses(lm, "blocks.0.hook_out", ids, lambda x: x + torch.randn_like(x))
    assert noisy.kl_replaced > 0


def test_spliced_losses_needs_causal_lm(bert):
    with pytest.raises(ValueError, match="causal"):
        spliced_losses(bert, "blocks.0.hook_out", torch.randint(5, 100, (1, 5)), lambda x: x)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model-dir: no such file or directory .*not looked up on the Hub"):
        load_model(str(tmp_path / "no-such-model-dir"))
