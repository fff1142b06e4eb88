"""Transcoders against an SAE of the same size on a causal LM's MLP, through the command line.

The LM (``--lm trained``, the default) is a 2-layer GPT-2 (d_model 64, a word-level tokenizer over the 2000 most
frequent words) trained here for ``--lm-steps`` steps on the running Python's docstrings (``stdlib-docstrings``,
offline on every machine), so that its MLPs carry what it learned: zeroing layer 0's MLP raises its held-out loss
from 5.26 to 5.63 nats (printed each run), so CE loss recovered, whose denominator is CE_zero - CE_clean, is well
conditioned. ``--lm random`` takes the random-init 2-layer GPT-2
of the tests (tests/fixtures_models.py, d_model 32) over their tiny corpus instead: its MLP barely matters to its
loss (zeroing it may even lower the CE), so CE loss recovered is ill-conditioned there and the KL score is the one
to read.

The LM is cached at one MLP's input and output hookpoints in one store; then ``conceptdict train`` fits a
``transcoder`` and a ``skip-transcoder`` (input -> output) and a ``topk`` SAE on the output, all with the same L
and k, and ``conceptdict compare --model`` prints them side by side on the same held-out rows: FVU against the MLP
output, L0, dead latents, spliced CE loss recovered and KL score (the SAE replaces the output with its
reconstruction, a transcoder replaces it with its prediction from the input). The baseline is the SAE, measured in
the same run. Nothing is downloaded.

    .venv/bin/python bench/transcoder_mlp.py                  # trained LM, layer 0, L=256, k=8
    .venv/bin/python bench/transcoder_mlp.py --lm random      # the tests' random-init LM, L=128, k=8
    .venv/bin/python bench/transcoder_mlp.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/fixtures_models.py: the tiny LM and the word-level tokenizer
SPECIALS = ["<|endoftext|>", "<pad>", "<unk>"]


def word_tokenizer(texts: list[str], size: int):
    """The tests' word-level tokenizer (tests/fixtures_models.py) over the ``size`` - 3 most frequent words (and
    punctuation) of ``texts``, split as it splits them."""
    from fixtures_models import word_tokenizer as over_vocab
    from tokenizers import normalizers, pre_tokenizers

    norm, pre = normalizers.Lowercase(), pre_tokenizers.Whitespace()
    counts = Counter(w for t in texts for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)))
    return over_vocab(SPECIALS + [w for w, _ in counts.most_common(size - len(SPECIALS))])


def train_lm(directory: Path, steps: int, layer: int | None, *, vocab: int = 2000, d_model: int = 64,
             context: int = 64, batch: int = 32, lr: float = 3e-3, seed: int = 0, n_layer: int = 2) -> dict:
    """Train an ``n_layer`` GPT-2 on the docstrings of the running Python (next-token loss, AdamW, linear decay), save
    it with its tokenizer under ``directory``, and return its held-out loss with and without ``layer``'s MLP (None:
    every MLP zeroed at once)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from conceptdict.activations.data import stdlib_docstrings

    texts = [r["text"] for r in stdlib_docstrings()]
    tok = word_tokenizer(texts, vocab)
    ids = torch.tensor([i for t in texts for i in [tok.eos_token_id, *tok(t)["input_ids"]]])
    split = int(0.9 * len(ids))
    cfg = GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=4, n_positions=2 * context, vocab_size=len(tok),
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    g = torch.Generator().manual_seed(seed)

    def windows(lo: int, hi: int, n: int):
        starts = torch.randint(lo, hi - context, (n,), generator=g)
        return torch.stack([ids[s:s + context] for s in starts])

    for _ in range(steps):
        x = windows(0, split, batch)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    held = windows(split, len(ids), 256)
    with torch.no_grad():
        clean = float(model(input_ids=held, labels=held).loss)
        hooks = [model.transformer.h[i].mlp.register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
                 for i in ([layer] if layer is not None else range(n_layer))]
        ablated = float(model(input_ids=held, labels=held).loss)
        for hook in hooks:
            hook.remove()
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return {"tokens": len(ids), "steps": steps, "loss": clean, "loss_mlp_zeroed": ablated}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm", choices=("trained", "random"), default="trained")
    p.add_argument("--lm-steps", type=int, default=1500, help="training steps of the trained LM (batches of 32 x 64)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--docs", type=int, default=400, help="--lm random: documents of the tiny corpus to cache")
    p.add_argument("--cache-tokens", type=int, default=65536, help="--lm trained: tokens of docstrings to cache")
    p.add_argument("--latents", type=int, default=None, help="default: 4 x d_model (256 trained, 128 random)")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="default: 400 trained, 100 random")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from fixtures_models import build_tiny_lm, build_tiny_lm_store

    from conceptdict.activations.cache import CacheConfig, cache_activations
    from conceptdict.cli.main import main as cli

    logging.disable(logging.INFO)
    trained = args.lm == "trained"
    latents = args.latents or (256 if trained else 128)
    steps = args.steps or (400 if trained else 100)
    hooks = [f"blocks.{args.layer}.mlp.hook_in", f"blocks.{args.layer}.mlp.hook_out"]
    lm_stats = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if trained:
            lm_stats = train_lm(root / "lm", args.lm_steps, args.layer)
            lm = root / "lm"
            print(f"LM: {lm_stats['steps']} steps on {lm_stats['tokens']} docstring tokens; held-out loss "
                  f"{lm_stats['loss']:.3f}, {lm_stats['loss_mlp_zeroed']:.3f} with layer {args.layer}'s MLP zeroed",
                  flush=True)
            store = cache_activations(CacheConfig(model=str(lm), hookpoints=hooks, dataset="stdlib-docstrings",
                                                  out=root / "store", context_length=64, batch_size=16,
                                                  tokens=args.cache_tokens, shard_rows=16384, progress=False))
        else:
            lm = build_tiny_lm(root / "lm")
            store = build_tiny_lm_store(root / "store", lm, n_docs=args.docs, hookpoints=hooks)
        common = ["--store", str(store), "--latents", str(latents), "--k", str(args.k), "--batch-size",
                  str(args.batch_size), "--tokens", str(args.batch_size * steps), "--eval-batches", "2"]
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
        args.json.write_text(json.dumps({**result, "lm": lm_stats}, indent=2))


if __name__ == "__main__":
    main()
