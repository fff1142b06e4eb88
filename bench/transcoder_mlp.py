"""Transcoders against an SAE of the same size on a causal LM's MLP, through the command line.

A tiny random-init GPT-2 (tests/fixtures_models.py, built locally: nothing is downloaded) is cached at one MLP's
input and output hookpoints in one store; then ``conceptdict train`` fits a ``transcoder`` and a
``skip-transcoder`` (input -> output) and a ``topk`` SAE on the output, all with the same L and k, and
``conceptdict compare --model`` prints them side by side on the same held-out rows: FVU against the MLP output,
L0, dead latents, spliced CE loss recovered and KL score (the SAE replaces the output with its reconstruction,
a transcoder replaces it with its prediction from the input). The baseline is the SAE, measured in the same run.

A random-init model's MLP barely matters to its loss (zero-ablating it may even lower the CE), so CE loss
recovered, whose denominator is CE_zero - CE_clean, is ill-conditioned here; the KL score is the one to read.

    .venv/bin/python bench/transcoder_mlp.py                  # layer 0, L=128, k=8, 100 steps of 128 rows
    .venv/bin/python bench/transcoder_mlp.py --docs 800 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--latents", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_models import build_tiny_lm, build_tiny_lm_store

    from conceptdict.cli.main import main as cli

    logging.disable(logging.INFO)
    hooks = [f"blocks.{args.layer}.mlp.hook_in", f"blocks.{args.layer}.mlp.hook_out"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lm = build_tiny_lm(root / "lm")
        store = build_tiny_lm_store(root / "store", lm, n_docs=args.docs, hookpoints=hooks)
        common = ["--store", str(store), "--latents", str(args.latents), "--k", str(args.k), "--batch-size",
                  str(args.batch_size), "--tokens", str(args.batch_size * args.steps), "--eval-batches", "2"]
        runs = {"topk": hooks[1:], "transcoder": hooks, "skip-transcoder": hooks}
        for kind, hps in runs.items():
            assert cli(["train", "--kind", kind, "--out", str(root / kind), *common,
                        *[a for h in hps for a in ("--hookpoint", h)]]) == 0
        assert cli(["compare", *(str(root / k) for k in runs), "--store", str(store), "--model", str(lm),
                    "--out", str(root / "compare")]) == 0
        result = json.loads((root / "compare" / "compare.json").read_text())
    base = result["dictionaries"][0]["metrics"]
    for row in result["dictionaries"][1:]:
        m = row["metrics"]
        print(f"{row['kind']:<16} ratio to the SAE: FVU {m['fvu'] / base['fvu']:.3f}, "
              f"KL score {m['kl_score'] / base['kl_score']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
