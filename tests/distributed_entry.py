"""torchrun entry script for tests/test_distributed*.py (gloo on CPU; not collected by pytest).

    torchrun --nproc_per_node=2 tests/distributed_entry.py train SPEC.json
    torchrun --nproc_per_node=2 tests/distributed_entry.py cache SPEC.json

``train``: for each run in the spec (``interrupt_at``: every rank stops before that global batch), train data-parallel (``saes.distributed.train``) on this rank's slices
(``activations.distributed.rank_batches``) and, on rank 0, save the weights. ``cache``: ``cache_distributed``
of the spec's CacheConfig over the spec's in-memory records; with ``die_after`` rank 1 exits hard after that
many full-size forwards, once its first shard is listed (a killed rank).

Until activations/cache.py takes ``part=(rank, world_size)`` (the hook in docs/distributed.md), this script
installs it from outside (:func:`install_cache_hook`).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def install_cache_hook() -> None:
    """Give cache_activations its ``part`` argument: iter_batches reads only this rank's contexts, numbered
    by their global index (the two-line hook of docs/distributed.md, applied from outside)."""
    import conceptdict.activations.cache as cm
    from conceptdict.activations.distributed import rank_contexts

    if "part" in inspect.signature(cm.cache_activations).parameters:
        return
    original = cm.cache_activations
    current = {"part": (0, 1)}

    def iter_batches(contexts, batch_size, pad_id, sort_window=1):
        window, index = [], 0
        for i, ctx in rank_contexts(contexts, *current["part"]):
            window.append((i, ctx))
            if len(window) == batch_size * sort_window:
                yield from cm._window_batches(window, index, batch_size, pad_id, sort_window > 1)
                index += -(-len(window) // batch_size)
                window = []
        if window:
            yield from cm._window_batches(window, index, batch_size, pad_id, sort_window > 1)

    def cache_activations(cfg, records=None, *, part=(0, 1)):
        current["part"] = tuple(part)
        return original(cfg, records)

    cm.iter_batches = iter_batches
    cm.cache_activations = cache_activations


def run_cache(spec: dict) -> None:
    from conceptdict.activations import CacheConfig
    from conceptdict.activations import distributed as adist
    from conceptdict.activations import models

    install_cache_hook()
    cfg = CacheConfig(**{k: Path(v) if k == "out" else v for k, v in spec["config"].items()})
    w = adist.world()
    if spec.get("die_after") and w.rank == 1:
        original, calls = models.capture, [0]
        manifest = adist.part_dir(cfg.out, 1, w.size) / "manifest.json"

        def capture(model, input_ids, *args, **kwargs):
            calls[0] += input_ids.shape[0] == cfg.batch_size  # real batches, not the loader's probes
            if calls[0] > spec["die_after"]:
                import time
                for _ in range(600):  # let the writer thread list the shards of the forwards so far
                    if manifest.exists() and json.loads(manifest.read_text())["shards"]:
                        break
                    time.sleep(0.1)
                os._exit(17)
            return original(model, input_ids, *args, **kwargs)

        models.capture = capture
    adist.cache_distributed(cfg, records=spec["records"])


def run_train(spec: dict) -> None:
    from safetensors.torch import save_file

    from conceptdict.activations import ActivationStore
    from conceptdict.activations.distributed import rank_batches
    from conceptdict.saes import TrainConfig
    from conceptdict.saes import distributed as sdist

    for run in spec["runs"]:
        cfg = TrainConfig(**run["config"])
        stores = [ActivationStore(p) for p in run["stores"]]
        hps = run["hookpoints"]

        def batches(start, stores=stores, hps=hps, cfg=cfg, stop=run.get("interrupt_at")):
            it = rank_batches(stores, hps, cfg.batch_size, seed=cfg.seed, epochs=None, start_batch=start)
            for position, x in enumerate(it, start):
                if stop is not None and position >= stop:
                    raise KeyboardInterrupt  # the job is killed before reading this global batch
                yield x

        try:
            model = sdist.train(cfg, batches, out=run.get("out"), resume=run.get("resume", False))
        except KeyboardInterrupt:
            if run.get("interrupt_at") is None:
                raise
            continue
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if sdist.world().main:
            save_file(state, run["weights"])
        else:  # every rank must hold the same dictionary
            save_file(state, run["weights"] + f".rank{sdist.world().rank}")


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    mode, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from conceptdict.saes import distributed as sdist

    sdist.init_from_env("gloo")
    try:
        run_cache(spec) if mode == "cache" else run_train(spec)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
