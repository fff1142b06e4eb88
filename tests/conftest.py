"""Shared pytest set-up: offline hubs, tier markers, GPU skipping."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the planted ground truths live with the benchmarks (bench/generators), outside the installed library
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# `precision auto` (TrainConfig's default) trains in bf16 on a CPU with AVX512-BF16 or AMX: the suite pins it to
# float32 so that every test and golden number is the same on every CPU (saes/precision.py's PIN_ENV; inherited by
# the processes the tests start). Tests of auto itself unset it (tests/test_precision.py).
os.environ.setdefault("CONCEPTDICT_PRECISION", "float32")
# What `import conceptdict` sets for its users (api/__init__.py): OpenMP workers sleep after a parallel region
# instead of spinning. It must be set before torch is first imported, and test modules import torch before
# conceptdict, so without it here the whole run (and every subprocess it starts) spins: on a busy 2-core machine
# tiny training loops ran 10x slower (tests/test_tiebreak.py: 12 s a run with spinning workers, 1.4 s without).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (`make test` runs one worker per CPU) the workers share the cores: each worker's torch (and
# every process it starts, which inherits the variable) gets its share of intra-op threads, so that N workers x T
# threads do not oversubscribe the machine (2 cores: 1 thread a worker; a kernels/architectures/clt subset on 2
# workers took 87-98 s instead of 106-127 s on the busy machine). A value the user set is kept.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS_PER_WORKER = max(1, _CPUS // XDIST_WORKERS)
if XDIST_WORKERS > 1 and "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS_PER_WORKER))

import pytest  # noqa: E402


def pytest_runtest_setup(item):
    """Under pytest-xdist, each test starts with torch's share of the threads. numba's OpenMP pool, when it starts,
    sets the process's OpenMP thread count to numba's, torch's with it: conceptdict's numba kernels start it at import
    and keep torch's count (saes/kernels/numba_impl.py, tests/test_numba_threads.py), but a test that runs a numba
    kernel of its own first, or sets torch's count, would leave the worker on another count for the tests after it.
    Numba keeps its own thread count (the kernels' per-thread partials are tested as in one process)."""
    torch = sys.modules.get("torch")
    if XDIST_WORKERS > 1 and torch is not None and os.environ.get("OMP_NUM_THREADS") == str(THREADS_PER_WORKER):
        if torch.get_num_threads() != THREADS_PER_WORKER:
            torch.set_num_threads(THREADS_PER_WORKER)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def xdist_share():
    """(pytest-xdist workers of this run, torch threads each is given): (1, all CPUs) in one process."""
    return XDIST_WORKERS, THREADS_PER_WORKER


# ---------------------------------------------------------------- a planted store through `store import`


@pytest.fixture(scope="session")
def planted_store(tmp_path_factory):
    """A store imported through the command line from planted-atom rows (64 atoms in D=16, 3072 rows): what the
    sweep and compare CLI tests train on. Read-only for its users."""
    import torch
    from safetensors.torch import save_file

    from conceptdict.cli.main import main
    from generators.synthetic import SyntheticSpec, synthetic_batches

    root = tmp_path_factory.mktemp("planted_store")
    spec = SyntheticSpec(n_atoms=64, d=16, active=3, batch_size=256, n_batches=12, seed=5)
    save_file({"acts": torch.cat(list(synthetic_batches(spec))).contiguous()}, str(root / "acts.safetensors"))
    assert main(["store", "import", str(root / "acts.safetensors"), "--out", str(root / "store")]) == 0
    return root / "store"


# ---------------------------------------------------------------- tiny models and stores (activations/ owner)
# Built once per session from tests/fixtures_models.py; everything is random-init and offline.


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """Directory of a random-init 2-layer GPT-2 (d_model 32) with a word-level tokenizer."""
    from fixtures_models import build_tiny_lm

    return build_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """Directory of a random-init 2-layer BERT encoder (d_model 32) with [CLS]/[SEP] wrapping."""
    from fixtures_models import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def tiny_lm_store(tmp_path_factory, tiny_lm_dir):
    """(store path, model dir): token-level store of the tiny LM over 60 tiny documents, hookpoints
    blocks.0.hook_out and blocks.1.hook_out (D = 32), a few hundred rows in several shards."""
    from fixtures_models import build_tiny_lm_store

    return build_tiny_lm_store(tmp_path_factory.mktemp("tiny_lm_store") / "store", tiny_lm_dir), tiny_lm_dir


@pytest.fixture(scope="session")
def tiny_sentence_store(tmp_path_factory, tiny_bert_dir):
    """(store path, model dir): sequence-level store (sentence.mean_normalized, D = 32) of the tiny BERT over
    60 tiny documents, with a per-row ``topic`` label (store.labels("topic"))."""
    from conceptdict.activations.cache import CacheConfig, cache_activations
    from fixtures_models import tiny_corpus

    out = tmp_path_factory.mktemp("tiny_sentence_store") / "store"
    cfg = CacheConfig(model=str(tiny_bert_dir), hookpoints=["sentence.mean_normalized"], dataset="", out=out,
                      context_length=48, batch_size=16, progress=False)
    return cache_activations(cfg, records=tiny_corpus(60)), tiny_bert_dir


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """Directory of a random-init CLIPModel (2-block towers, width 32, 32x32 images in 8x8 patches,
    projection 16) saved with its CLIPProcessor (tests/fixtures_images.py)."""
    from fixtures_images import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))
