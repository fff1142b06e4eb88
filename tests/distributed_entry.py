"""torchrun entry script for tests/test_distributed*.py (gloo on CPU; not collected by pytest).

    torchrun --nproc_per_node=2 tests/distributed_entry.py train SPEC.json
    torchrun --nproc_per_node=2 tests/distributed_entry.py cache SPEC.json
    torchrun --nproc_per_node=2 tests/distributed_entry.py cli SPEC.json
    torchrun --nproc_per_node=2 tests/distributed_entry.py eval SPEC.json

``train``: for each run in the spec (``interrupt_at``: every rank stops before that global batch), train
data-parallel, latent-sharded with its config's ``latent_shards`` (``saes.train`` over
``saes.distributed.process_group_comm``) on this rank's data part (``stream_batches(part=...)``) and, on rank 0,
save the weights (other ranks: WEIGHTS.rankN; latent shards: the shards joined); a run with ``sweep`` (configs)
trains them in one ``train_sweep`` pass into its ``outs``. ``cache``: ``cache_distributed`` of the spec's
CacheConfig over the spec's in-memory records; with ``die_after`` rank 1 exits hard after that many
full-size forwards, once its first shard is listed (a killed rank). ``cli``: the command line
``conceptdict SPEC["argv"]`` (its exit status is the process's). ``eval``: ``cd.evaluate`` of each of the spec's
``jobs`` (``dictionary`` and its ``settings``), each rank writing what its dictionary read (``reads``.rankN: its range
``part`` and ``read_ranges``), then the command line ``SPEC["argv"]`` when given (last: it leaves the job). The job is joined as the command line joins it
(``conceptdict.ranks.join``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cache(spec: dict) -> None:
    from conceptdict.activations import CacheConfig
    from conceptdict.activations import distributed as adist
    from conceptdict.activations import models
    from conceptdict import ranks

    cfg = CacheConfig(**{k: Path(v) if k == "out" else v for k, v in spec["config"].items()})
    w = ranks.current()
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
    adist.cache_distributed(cfg, records=spec["records"], rank=w.rank, world_size=w.size, barrier=ranks.barrier)


def run_train(spec: dict) -> None:
    from safetensors.torch import save_file

    from conceptdict.activations import ActivationStore, stream_batches
    from conceptdict import ranks
    from conceptdict.saes import train, train_config
    from conceptdict.saes.distributed import process_group_comm
    from conceptdict.saes.training import train_sweep
    from test_distributed_train import held_apart

    w = ranks.current()
    comms = {}  # one seam per latent-shard count (its groups are made once, by every rank alike)

    for run in spec["runs"]:
        sweep = [train_config(**c) for c in run.get("sweep", [])]  # several dictionaries on one pass (train_sweep)
        cfg = sweep[0] if sweep else train_config(**run["config"])
        stores = [ActivationStore(p) for p in run["stores"]]
        hps = run["hookpoints"]
        comm = comms.setdefault(cfg.latent_shards, process_group_comm(cfg.latent_shards))

        held = [ActivationStore(p) for p in run.get("held_out", [])]  # held-out batches from stores of their own

        def batches(start, stores=stores, hps=hps, cfg=cfg, stop=run.get("interrupt_at"), comm=comm, held=held):
            it = held_apart(stores, held, hps, cfg, start, part=(comm.rank, comm.size)) if held else stream_batches(
                stores, hps, cfg.batch_size, seed=cfg.seed, epochs=None, start_batch=start,
                part=(comm.rank, comm.size))  # this rank's data part (its shards read it too)
            for position, x in enumerate(it, start):
                if stop is not None and position >= stop:
                    raise KeyboardInterrupt  # the job is killed before reading this global batch
                yield x

        if sweep:
            train_sweep(sweep, batches, outs=run["outs"], comm=comm)  # the artifacts in outs are what the test reads
            continue
        try:
            model = train(cfg, batches, out=run.get("out"), resume=run.get("resume", False), comm=comm)
        except KeyboardInterrupt:
            if run.get("interrupt_at") is None:
                raise
            continue
        if cfg.latent_shards > 1:  # each rank returns its shard's latents: join them to compare the whole
            from conceptdict.saes.shards import gather_shards

            assert model.n_latents == cfg.latents // cfg.latent_shards, (model.n_latents, cfg.latents)
            model = gather_shards(model, comm.shards)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if w.main:
            save_file(state, run["weights"])
        else:  # every rank must hold the same dictionary
            save_file(state, run["weights"] + f".rank{w.rank}")


def run_eval(spec: dict) -> int:
    import conceptdict as cd
    from conceptdict import ranks

    rank = ranks.current().rank
    for job in spec["jobs"]:
        lazy = cd.evaluate(job["dictionary"], **job["settings"]).dictionary
        Path(f"{job['reads']}.rank{rank}").write_text(json.dumps(
            {"part": list(lazy.part), "read_ranges": sorted([k, a, b] for k, a, b in lazy.read_ranges)}))
    if spec.get("argv"):
        from conceptdict.cli.main import main as cli_main

        return cli_main(spec["argv"])
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    mode, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from conceptdict import ranks

    ranks.join("gloo")
    try:
        if mode == "cli":
            from conceptdict.cli.main import main as cli_main

            return cli_main(spec["argv"])
        if mode == "eval":
            return run_eval(spec)
        run_cache(spec) if mode == "cache" else run_train(spec)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every result is on disk and the process group is destroyed: leave without the interpreter's teardown. About
    # one launch in ten on a loaded 2-core machine aborted with "terminate called without an active exception"
    # (what a C++ thread still joinable at static destruction prints); the cause is not proven to be teardown.
    # An exception in main() still propagates and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
