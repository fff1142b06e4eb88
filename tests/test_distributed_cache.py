"""Rank-sliced caching: 2 gloo ranks under torchrun make the store one process makes (the same rows as a
set: tokens, context indices, positions and activations), and a job whose rank 1 was killed resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conceptdict.activations import ActivationStore, CacheConfig, cache_activations
from conceptdict.activations.distributed import merge_parts, part_dir, rank_contexts
from conceptdict.activations.store import StoreError
from fixtures_models import tiny_corpus
from test_distributed_train import failure, torchrun

pytestmark = pytest.mark.equivalence  # `make test` runs these again under another ATen CPU capability


def _config(model_dir: Path, out: Path) -> dict:
    return {"model": str(model_dir), "hookpoints": ["blocks.0.hook_out", "blocks.1.hook_out"], "dataset": "",
            "out": str(out), "context_length": 32, "batch_size": 4, "shard_rows": 64, "progress": False}


def _rows(store: ActivationStore) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(key [N, 3] = context, position, token sorted by context and position, hookpoints in that order)."""
    n = store.num_rows
    key = torch.stack([store.context_index(0, n).long(), store.position(0, n).long(), store.tokens(0, n).long()], 1)
    order = torch.argsort(key[:, 0] * 10_000 + key[:, 1])
    return key[order], {h: store.rows(h, 0, n)[order] for h in store.hookpoints}


@pytest.mark.unit
def test_rank_contexts_round_robin_by_global_index():
    got = [list(rank_contexts("abcdefg", r, 3)) for r in range(3)]
    assert got == [[(0, "a"), (3, "d"), (6, "g")], [(1, "b"), (4, "e")], [(2, "c"), (5, "f")]]


@pytest.mark.unit
def test_merge_refuses_unfinished_parts(tmp_path):
    part_dir(tmp_path, 0, 2).mkdir(parents=True)
    with pytest.raises(StoreError, match="rank-00000-of-00002 is missing or unfinished"):
        merge_parts(tmp_path, 2, "x")


@pytest.mark.integration
def test_two_rank_cache_killed_and_resumed_equals_one_process(tmp_path, tiny_lm_dir):
    records = tiny_corpus(32)
    one = cache_activations(CacheConfig(**{**_config(tiny_lm_dir, tmp_path / "one"), "out": tmp_path / "one"}),
                            records=records)
    spec = {"config": _config(tiny_lm_dir, tmp_path / "two"), "records": records, "die_after": 1}
    killed = torchrun("cache", spec, tmp_path)
    assert killed.returncode != 0, "rank 1 was meant to die"
    part1 = json.loads((part_dir(tmp_path / "two", 1, 2) / "manifest.json").read_text())
    assert not part1["complete"] and part1["shards"], "rank 1 should have left complete shards of an unfinished part"
    assert not (tmp_path / "two" / "manifest.json").exists()

    proc = torchrun("cache", {**spec, "die_after": 0}, tmp_path)
    assert proc.returncode == 0, failure(proc)
    two = ActivationStore(tmp_path / "two")
    two.verify()
    ref = ActivationStore(one)
    assert two.num_rows == ref.num_rows
    for key in ("config_hash", "hookpoints", "dtype", "level"):
        assert two.manifest[key] == ref.manifest[key], key
    assert two.manifest["dataset"]["contexts"] == ref.manifest["dataset"]["contexts"]
    assert two.manifest["excluded_tokens"] == ref.manifest["excluded_tokens"]
    assert two.manifest["distributed"]["world_size"] == 2 and "part" not in two.manifest
    assert cache_activations(CacheConfig(**{**_config(tiny_lm_dir, tmp_path / "two"), "out": tmp_path / "two"}),
                             records=records) == tmp_path / "two", "one process must accept the merged store"
    assert not (tmp_path / "two" / "parts").exists()
    key_two, acts_two = _rows(two)
    key_ref, acts_ref = _rows(ref)
    assert torch.equal(key_two, key_ref), "the 2-rank store holds other rows than the 1-process store"
    for h in ref.hookpoints:
        assert torch.allclose(acts_two[h], acts_ref[h], atol=1e-5), h
    assert two.row_context(5).tokens and two.tokenizer is not None
