"""``torchrun --nproc_per_node=2 -m conceptdict.cli.main cache|train``: the commands themselves give the
one-process store and dictionary (the library paths are tested in test_distributed_cache.py and
test_distributed_train.py through tests/distributed_entry.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conceptdict.activations import ActivationStore
from fixtures_models import tiny_corpus
from test_distributed_train import TORCHRUN, failure, ulps

pytestmark = [pytest.mark.integration, pytest.mark.equivalence]


def _cli(args: list[str], nproc: int, cwd: Path, capsys) -> subprocess.CompletedProcess:
    """The command in this process (nproc=1) or under torchrun."""
    if nproc == 1:
        from conceptdict.cli.main import main

        capsys.readouterr()
        rc = main(args)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)
    launcher = [str(TORCHRUN), f"--nproc_per_node={nproc}", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*launcher, "-m", "conceptdict.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cache_and_train_commands_under_torchrun(tmp_path, tiny_lm_dir, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in tiny_corpus(30)))
    stores = {}
    for n in (1, 2):
        out = tmp_path / f"store{n}"
        proc = _cli(["cache", "--model", str(tiny_lm_dir), "--hookpoint", "blocks.1.hook_out", "--dataset", str(data),
                     "--context-length", "32", "--batch-size", "4", "--shard-rows", "128", "--out", str(out)],
                    n, tmp_path, capsys)
        assert proc.returncode == 0, failure(proc)
        stores[n] = ActivationStore(out)
        assert proc.stdout.count("rows") >= 1  # rank 0's summary
    keys = []
    for s in stores.values():
        key = torch.stack([s.context_index(0, s.num_rows).long(), s.position(0, s.num_rows).long(),
                           s.tokens(0, s.num_rows).long()], 1)
        keys.append(key[torch.argsort(key[:, 0] * 10_000 + key[:, 1])])
    assert torch.equal(keys[0], keys[1])
    weights = {}
    for n in (1, 2):
        out = tmp_path / f"sae{n}"
        # the default kind (BatchTopK, its global cut through the seam) in float64: in float32 the two runs'
        # last-bit differences can resolve a near-tie at the cut differently (docs/guide/distributed.md)
        proc = _cli(["train", "--store", str(stores[1].path), "--latents", "64", "--k", "4", "--batch-size", "64",
                     "--tokens", "640", "--seed", "1", "--device", "cpu", "--precision", "float64", "--out", str(out)],
                    n, tmp_path, capsys)
        assert proc.returncode == 0, failure(proc)
        assert sum(ln.startswith("dictionary:") for ln in proc.stdout.splitlines()) == 1, "only rank 0 prints"
        weights[n] = load_file(out / "weights.safetensors")
    diff, key = max((ulps({k: weights[1][k]}, {k: weights[2][k]}), k) for k in weights[1])
    assert diff <= 1, f"`conceptdict train` on 2 ranks differs from 1 process by {diff:.3g} float32 units (in {key})"
