"""Model families (issue 51 item 7a): a new family is its module, one line in ``FAMILIES`` and its tests.

The toy family here is that module: a bag-of-words network with two residual blocks and a word-level tokenizer,
saved as ``toy.json`` + ``toy.safetensors`` + the tokenizer's files. Registered with ONE line (``FAMILIES["toy"] =
ToyFamily()``, as a monkeypatch so it stays inside the test), it loads through ``cd.load_model``, lists its
hookpoints through ``cd.hookpoints``, caches into a store through ``cd.cache`` (the text family's cache path, which
asks the handle only), embeds through ``cd.embed_texts`` and keeps the protocol ``families.Model``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixtures_models import SPECIALS, TOPICS, tiny_corpus, word_tokenizer
from torch import Tensor, nn

import conceptdict as cd
from conceptdict.activations import families
from conceptdict.activations.listing import HookpointInfo
from conceptdict.activations.wrapper import Cached, Tokens

D = 16
POOLED = "toy.mean"


class ToyNet(nn.Module):
    def __init__(self, vocab: int, d: int = D, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, ids: Tensor) -> dict[str, Tensor]:
        h = self.embed(ids)
        out = {"toy.embed": h}
        for i, block in enumerate(self.blocks):
            h = h + torch.tanh(block(h))
            out[f"toy.blocks.{i}"] = h
        return out


@dataclass(repr=False)
class ToyHandle:
    name: str
    net: ToyNet
    tokenizer: object
    device: str
    dtype: str
    load_info: dict
    hookpoints: list[str]
    family = "toy"
    is_causal = False

    def __repr__(self) -> str:
        return f"ToyHandle({self.name!r}, hookpoints={len(self.hookpoints)})"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def d_model(self, hookpoint: str) -> int:
        return D

    def level(self, hookpoint: str) -> str:
        return "sequence" if hookpoint == POOLED else "token"

    def special_ids(self) -> list[int]:
        return sorted(set(self.tokenizer.all_special_ids) - {self.tokenizer.unk_token_id})

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([int(i)]) for i in ids]

    def unembed(self) -> None:
        return None

    def capture(self, input_ids: Tensor, attention_mask: Tensor, hookpoints: Sequence[str]) -> dict[str, Tensor]:
        with torch.no_grad():
            acts = self.net(input_ids)
        mask = attention_mask.unsqueeze(-1).float()
        acts[POOLED] = (acts["toy.blocks.1"] * mask).sum(1) / mask.sum(1)
        return {h: acts[h] for h in hookpoints}

    def hookpoint_rows(self) -> list[HookpointInfo]:
        return [HookpointInfo(h, f"[{D}]" if h == POOLED else f"[T, {D}]", D, self.level(h)) for h in self.hookpoints]

    def to_tokens(self, texts, return_mask=False, max_length=None):
        enc = self.tokenizer([texts] if isinstance(texts, str) else list(texts), padding=True, return_tensors="pt")
        return Tokens(enc["input_ids"], enc["attention_mask"]) if return_mask else enc["input_ids"]

    def to_string(self, ids):
        return self.tokenizer.decode(list(ids))

    def run_with_cache(self, inputs, names=None):
        ids, mask = self.to_tokens(inputs, return_mask=True)
        cache = self.capture(ids, mask, names or self.hookpoints)
        return Cached(self.capture(ids, mask, ["toy.blocks.1"])["toy.blocks.1"], cache)

    def run_with_saes(self, inputs, saes, return_codes=False):
        raise ValueError("the toy family's forward takes no dictionaries")

    def embed_images(self, images, hookpoint=None, batch_size=64):
        raise ValueError("the toy family reads no images")

    def embed_texts(self, texts, hookpoint=None, batch_size=64) -> Tensor:
        hookpoint = hookpoint or POOLED
        enc = self.tokenizer(list(texts), padding=True, return_tensors="pt")
        acts = self.capture(enc["input_ids"], enc["attention_mask"], [hookpoint])[hookpoint]
        return acts if acts.dim() == 2 else acts.mean(1)


class ToyFamily:
    name = "toy"
    modality = "text"
    pooled_hookpoints = (POOLED,)

    def recognises(self, name_or_dir: str) -> bool:
        return (Path(name_or_dir) / "toy.json").exists()

    def load(self, name_or_dir: str, device: str, dtype: str, tokenizer: str | None = None) -> ToyHandle:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        config = json.loads((Path(name_or_dir) / "toy.json").read_text())
        net = ToyNet(config["vocab"])
        net.load_state_dict(load_file(str(Path(name_or_dir) / "toy.safetensors")))
        hookpoints = ["toy.embed", "toy.blocks.0", "toy.blocks.1", POOLED]
        return ToyHandle(name_or_dir, net.eval(), AutoTokenizer.from_pretrained(tokenizer or name_or_dir), device,
                         dtype, {"id": name_or_dir, "family": "toy", "model_type": "toy"}, hookpoints)

    def cache(self, cfg, records, part):
        from conceptdict.activations.cache import cache_text

        return cache_text(cfg, records, part)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("toy")
    words = sorted({w for doc in tiny_corpus(60) for w in doc["text"].split()}
                   | {w for topic in TOPICS.values() for w in topic})
    tok = word_tokenizer(SPECIALS + words)
    torch.manual_seed(0)
    save_file(ToyNet(len(tok)).state_dict(), str(directory / "toy.safetensors"))
    (directory / "toy.json").write_text(json.dumps({"vocab": len(tok)}))
    tok.save_pretrained(str(directory))
    return directory


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "toy", ToyFamily())  # the one registry line of a new family


@pytest.mark.unit
def test_the_registry_dispatches_by_recognition_and_falls_back_to_text(tmp_path, monkeypatch):
    (tmp_path / "toy.json").write_text("{}")
    assert families.family_of(tmp_path).name == "text"  # not registered: the text family takes any model
    monkeypatch.setitem(families.FAMILIES, "toy", ToyFamily())
    assert families.family_of(tmp_path).name == "toy" and families.family_of("default").name == "text"
    assert families.hookpoint_level(POOLED) == "sequence" and families.hookpoint_level("toy.blocks.0") == "token"
    assert families.hookpoint_level("sentence.mean") == families.hookpoint_level("image.embed") == "sequence"


@pytest.mark.integration
def test_a_toy_family_loads_lists_caches_and_embeds(toy, toy_dir, tmp_path):
    model = cd.load_model(str(toy_dir))
    assert isinstance(model, ToyHandle) and isinstance(model, families.Model)
    assert cd.hookpoints(model).names() == ["toy.embed", "toy.blocks.0", "toy.blocks.1", POOLED]
    _, cache = model.run_with_cache(["cat dog", "rain snow wind"], names=["toy.blocks.0", POOLED])
    assert cache["toy.blocks.0"].shape == (2, 3, D) and cache[POOLED].shape == (2, D)
    assert cd.embed_texts(model, ["cat dog"]).shape == (1, D)

    docs = tiny_corpus(12)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    store = cd.cache(model=str(toy_dir), hookpoint="toy.blocks.1", dataset=str(tmp_path / "docs.jsonl"),
                     out=tmp_path / "store", context_length=16, batch_size=4, progress=False)
    assert store.level == "token" and store.manifest["model"]["family"] == "toy" and store.num_rows > 12
    tokens = store.tokens(0, store.num_rows).long()  # BOS and pads never stored; the toy mixes no positions
    want = model.capture(tokens[None], torch.ones_like(tokens)[None], ["toy.blocks.1"])["toy.blocks.1"][0]
    torch.testing.assert_close(store.rows("toy.blocks.1", 0, store.num_rows), want)
    assert model.tokenizer.bos_token_id not in tokens.tolist()

    sentences = cd.cache(model=str(toy_dir), hookpoint=POOLED, dataset=str(tmp_path / "docs.jsonl"),
                         out=tmp_path / "sentences", context_length=16, progress=False)
    assert sentences.level == "sequence" and sentences.num_rows == len(docs)
