"""Replacement models on a 4-layer causal LM trained here: per-layer transcoders (PLTs), skip PLTs and cross-layer
transcoders (CLTs) at matched total L0, every MLP replaced at once.

The LM is bench/transcoder_mlp.py's GPT-2 (d_model 64, word-level tokenizer) with ``--layers`` layers, trained for
``--lm-steps`` steps on the running Python's docstrings (offline), cached at every layer's MLP input and output in
one store. Then ``conceptdict train --layers all`` fits, with the same latents per layer and k per layer (so the
same total latents and the same total L0 = layers x k): ``transcoder`` and ``skip-transcoder`` (one per MLP, one
read of each batch), ``clt`` (TopK per layer) and ``clt-batchtopk`` (BatchTopK per layer, a calibrated JumpReLU
threshold per layer). ``conceptdict eval --model`` splices every MLP at once: CE loss recovered and KL score of the
replacement model (errors not kept), per-layer FVU, total L0, dead latents, and the error-kept check (max |logit -
clean logit|). Training time is the wall clock of the train command (CPU; the machine may be shared).

    .venv/bin/python bench/replacement_models.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("transcoder", "skip-transcoder", "clt", "clt-batchtopk")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lm-steps", type=int, default=1500)
    p.add_argument("--cache-tokens", type=int, default=65536)
    p.add_argument("--latents", type=int, default=256, help="latents per layer")
    p.add_argument("--k", type=int, default=8, help="kept per layer and token")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--contexts", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from transcoder_mlp import train_lm

    import conceptdict as cd
    from conceptdict.activations.cache import CacheConfig, cache_activations
    from conceptdict.cli.main import main as cli

    logging.disable(logging.INFO)
    S = args.layers
    hooks = [f"blocks.{l}.mlp.hook_{w}" for w in ("in", "out") for l in range(S)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lm_stats = train_lm(root / "lm", args.lm_steps, None, n_layer=S)
        print(f"LM: {S} layers, {lm_stats['steps']} steps on {lm_stats['tokens']} docstring tokens; held-out loss "
              f"{lm_stats['loss']:.3f}, {lm_stats['loss_mlp_zeroed']:.3f} with every MLP zeroed", flush=True)
        store = cache_activations(CacheConfig(model=str(root / "lm"), hookpoints=hooks, dataset="stdlib-docstrings",
                                              out=root / "store", context_length=64, batch_size=16,
                                              tokens=args.cache_tokens, shard_rows=16384, progress=False))
        for kind in KINDS:
            total = args.latents * (S if kind.startswith("clt") else 1)  # a CLT's --latents is its total
            t0 = time.perf_counter()
            assert cli(["train", "--kind", kind, "--layers", "all", "--out", str(root / kind), "--store", str(store),
                        "--latents", str(total), "--k", str(args.k), "--batch-size", str(args.batch_size),
                        "--tokens", str(args.batch_size * args.steps), "--eval-batches", "4"]) == 0
            seconds = time.perf_counter() - t0
            m = cd.evaluate(root / kind, model=str(root / "lm"), contexts=args.contexts).metrics
            rows[kind] = {"ce_loss_recovered": m.ce_loss_recovered, "kl_score": m.kl_score, "fvu": m.fvu,
                          "per_layer_fvu": list(m.per_source_fvu), "l0": m.l0, "per_layer_l0": list(m.per_layer_l0),
                          "dead": m.dead_fraction, "train_s": seconds, "splice": m.splice}
            print(f"{kind:<16} CE rec {m.ce_loss_recovered:.3f} | KL {m.kl_score:.3f} | FVU {m.fvu:.3f} "
                  f"[{', '.join(f'{v:.3f}' for v in m.per_source_fvu)}] | L0 {m.l0:.1f} | dead {m.dead_fraction:.3f} "
                  f"| train {seconds:.0f} s | error-kept max |dlogit| {m.splice['max_logit_diff_with_errors']:.2g}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "lm": lm_stats,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
