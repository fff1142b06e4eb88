"""Caching throughput vs the bare forward pass, same model and same tokens, measured in one run.

    .venv/bin/python bench/cache_throughput.py [--contexts 64] [--context-length 128] [--batch-size 32]
        [--hookpoint blocks.5.hook_out] [--repeats 3] [--json PATH]

Baseline: the Hugging Face encoder the model directory holds (for all-MiniLM-L6-v2: ``BertModel``, what
sentence-transformers runs), ``torch.inference_mode``, on the same padded batches; no hooks, no copies.
Cache: ``conceptdict cache``'s loop (tokenised records -> batches -> capture through TransformerBridge ->
background writer -> safetensors shards with fsync and hashes) over the same token ids, model already
loaded (steady state); the end-to-end wall time including model loading is reported too.
A second baseline is the same TransformerBridge capture forward with nothing stored (isolates the
writer's cost). The three kinds run ``--repeats`` times each, in rotating order; medians are compared; ``ratio`` is against the
faster baseline. Process CPU seconds are reported too: on a shared machine they are the steadier
figure. Goal: ratio >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from conceptdict.activations import CacheConfig, DEFAULT_MODEL_DIR, cache_activations, load_model  # noqa: E402
from conceptdict.activations import cache as cache_mod  # noqa: E402
from conceptdict.activations.data import iter_contexts, stdlib_docstrings  # noqa: E402
from conceptdict.activations.models import capture  # noqa: E402
from conceptdict.activations.store import read_manifest  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR()))
    p.add_argument("--hookpoint", default="blocks.5.hook_out")
    p.add_argument("--contexts", type=int, default=64)
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def token_records(tokenizer, n: int, length: int) -> list[dict]:
    """``n`` packed contexts of stdlib docstrings, as pre-tokenised records (identical ids for both runs)."""
    contexts = iter_contexts(stdlib_docstrings(), tokenizer, context_length=length, packing=True)
    out = []
    for ctx in contexts:
        if len(ctx.ids) == length:
            out.append({"ids": ctx.ids})
        if len(out) == n:
            return out
    raise SystemExit(f"the docstring corpus gives fewer than {n} contexts of {length} tokens")


def bare_forward(hf_model, records: list[dict], batch_size: int) -> float:
    """(wall, process CPU) seconds for the bare HF forward over every batch."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for i in range(0, len(records), batch_size):
            ids = torch.tensor([r["ids"] for r in records[i:i + batch_size]])
            hf_model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return time.perf_counter() - start, time.process_time() - cpu


def bridge_forward(model, records: list[dict], batch_size: int, hookpoint: str) -> float:
    """(wall, process CPU) seconds for the same capture forward through TransformerBridge (stopped at the hookpoint), nothing kept."""
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(records), batch_size):
        ids = torch.tensor([r["ids"] for r in records[i:i + batch_size]])
        capture(model, ids, torch.ones_like(ids), [hookpoint])
    return time.perf_counter() - start, time.process_time() - cpu


def cache_loop(model, records: list[dict], args, out: Path) -> float:
    """(wall, process CPU) seconds for the cache loop (tokens -> store on disk) with the model already loaded."""
    cfg = CacheConfig(model=args.model, hookpoints=[args.hookpoint], dataset="", out=out, tokens_column="ids",
                      packing=False, context_length=args.context_length, batch_size=args.batch_size,
                      dtype=args.dtype, progress=False, sort_window=1)
    out.mkdir(parents=True)
    manifest = cache_mod._fresh_manifest(cfg, model, cache_mod.config_hash(cfg))  # noqa: SLF001 - bench internals
    start, cpu = time.perf_counter(), time.process_time()
    cache_mod._run(cfg, model, manifest, records, 0)  # noqa: SLF001
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> int:
    args = parse_args(argv)
    model = load_model(args.model)
    records = token_records(model.tokenizer, args.contexts, args.context_length)
    n_tokens = args.contexts * args.context_length
    hf_model = getattr(model.bridge.original_model, "base_model", model.bridge.original_model)
    tmp = Path(tempfile.mkdtemp(prefix="cache_bench_"))
    bare_forward(hf_model, records[: args.batch_size], args.batch_size)  # warm-up
    timings: dict[str, list[tuple[float, float]]] = {"bare": [], "bridge": [], "cache": []}
    runs = {
        "bare": lambda r: bare_forward(hf_model, records, args.batch_size),
        "bridge": lambda r: bridge_forward(model, records, args.batch_size, args.hookpoint),
        "cache": lambda r: cache_loop(model, records, args, tmp / f"run{r}"),
    }
    names = list(runs)
    for r in range(args.repeats):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order so no kind always runs first
            timings[name].append(runs[name](r))
    bare, bridged, cached = ([w for w, _ in timings[k]] for k in ("bare", "bridge", "cache"))
    cpu = {k: statistics.median(c for _, c in v) for k, v in timings.items()}
    start = time.perf_counter()
    cfg = CacheConfig(model=args.model, hookpoints=[args.hookpoint], dataset="", out=tmp / "e2e",
                      tokens_column="ids", packing=False, context_length=args.context_length,
                      batch_size=args.batch_size, dtype=args.dtype, progress=False, sort_window=1)
    cache_activations(cfg, records=records)
    e2e = time.perf_counter() - start
    rows = read_manifest(tmp / "run0")["num_rows"]
    result = {
        "model": args.model, "hookpoint": args.hookpoint, "tokens": n_tokens, "rows_stored": rows,
        "batch_size": args.batch_size, "context_length": args.context_length, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "bare_seconds": bare, "bridge_seconds": bridged, "cache_seconds": cached,
        "bare_tokens_per_s": n_tokens / statistics.median(bare),
        "bridge_tokens_per_s": n_tokens / statistics.median(bridged),
        "cache_tokens_per_s": n_tokens / statistics.median(cached),
        "ratio_vs_hf": statistics.median(bare) / statistics.median(cached),
        "ratio_vs_bridge": statistics.median(bridged) / statistics.median(cached),
        "ratio": min(statistics.median(bare), statistics.median(bridged)) / statistics.median(cached),
        "cpu_seconds_median": cpu,
        "cpu_ratio_vs_hf": cpu["bare"] / cpu["cache"], "cpu_ratio_vs_bridge": cpu["bridge"] / cpu["cache"],
        "end_to_end_seconds_with_model_load": e2e,
        "end_to_end_tokens_per_s": n_tokens / e2e,
    }
    print(f"model {Path(args.model).name}  hookpoint {args.hookpoint}  {n_tokens} tokens "
          f"({args.contexts} x {args.context_length}), batch {args.batch_size}, {result['threads']} threads")
    print(f"bare forward   {result['bare_tokens_per_s']:9.0f} tok/s   (runs: {', '.join(f'{s:.2f}s' for s in bare)})")
    print(f"bridge forward {result['bridge_tokens_per_s']:9.0f} tok/s   (runs: {', '.join(f'{s:.2f}s' for s in bridged)})")
    print(f"conceptdict    {result['cache_tokens_per_s']:9.0f} tok/s   (runs: {', '.join(f'{s:.2f}s' for s in cached)})")
    print(f"ratio vs HF encoder forward        {result['ratio_vs_hf']:.3f}")
    print(f"ratio vs bridge forward (no store) {result['ratio_vs_bridge']:.3f}")
    print(f"ratio (vs the faster baseline)     {result['ratio']:.3f}   (goal >= 0.90)")
    print(f"process CPU seconds (median): HF {cpu['bare']:.2f}, bridge {cpu['bridge']:.2f}, cache {cpu['cache']:.2f}"
          f" -> CPU ratio vs HF {result['cpu_ratio_vs_hf']:.3f}, vs bridge {result['cpu_ratio_vs_bridge']:.3f}"
          " (robust to other load on the machine)")
    print(f"end to end incl. model load: {result['end_to_end_tokens_per_s']:.0f} tok/s ({e2e:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
