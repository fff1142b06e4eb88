"""Erasure table and steering ratios on the default sentence encoder (issue 17's closing numbers).

1. Erasure: the standard library's docstrings (the demo's corpus) cached with all-MiniLM-L6-v2 at
   ``sentence.mean_normalized``; Y = the docstring's module family (8 classes), C = a concept derived from the
   text: whether the docstring mentions "return" (977 of 2196). ``conceptdict erase`` runs every method (SAE
   ablation with the demo's dictionary) and prints the method x metric table; ``none`` is the baseline row.
2. Steering: for the most frequent uniquely named latents of the demo's sentence dictionary, ``add alpha * d_j``
   to the embeddings of docstrings and measure the cosine shift toward the embedding of the latent's name,
   against random directions of the same norm (``naming.steerability``; ratio = effect / mean |random effect|).
   The demo dictionary's decoder rows have norm 0.051 (it was trained on scaled inputs), so alpha 8 adds a
   vector of length 0.41 to embeddings of length 1.
   One latent also goes through ``conceptdict steer``.

Needs ``make demo`` first (runs/demo/concepts, runs/demo/sae). Run from the repository root:
``python bench/erase_steer.py [--latents 20] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HP = "sentence.mean_normalized"


def corpus(path: Path) -> Path:
    from conceptdict.activations import stdlib_docstrings

    docs = stdlib_docstrings()
    with path.open("w") as f:
        for d in docs:
            mentions = "yes" if "return" in d["text"].lower() else "no"
            f.write(json.dumps({"text": d["text"], "family": d["family"], "mentions_return": mentions}) + "\n")
    return path


def erase_table(root: Path, concepts: Path) -> dict:
    from conceptdict.cli.main import main

    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    if not (store / "manifest.json").exists():
        assert main(["cache", "--model", "default", "--hookpoint", HP, "--dataset", str(corpus(root / "docs.jsonl")),
                     "--out", str(store)]) == 0
    if (root / "erase" / "erase.json").exists():
        return json.loads((root / "erase" / "erase.json").read_text())
    assert main(["erase", "--store", str(store), "--concept-column", "mentions_return", "--target-column", "family",
                 "--dictionary", str(concepts), "--out", str(root / "erase"), "--overwrite"]) == 0
    return json.loads((root / "erase" / "erase.json").read_text())


def steering(concepts: Path, n_latents: int, alphas=(2.0, 4.0, 8.0)) -> dict:
    from conceptdict.activations import load_model, stdlib_docstrings
    from conceptdict.naming import load_concepts
    from conceptdict.naming.interventions.steerability import steerability
    from conceptdict.saes import load_dictionary

    cd = load_concepts(concepts)
    counts: dict[str, int] = {}
    for c in cd.concepts:
        counts[c.name] = counts.get(c.name, 0) + 1
    chosen = sorted((c for c in cd.concepts if c.name and counts[c.name] == 1), key=lambda c: -c.frequency)[:n_latents]
    docs = stdlib_docstrings()
    texts = [d["text"] for d in docs[:: max(1, len(docs) // 64)]][:64]
    model = load_model("default")
    sae = load_dictionary(cd.meta["sae_dir"])
    scores = steerability(sae, model, HP, [c.id for c in chosen], [c.name for c in chosen], texts, alphas=alphas,
                          n_random=8)
    rows = [{"id": c.id, "name": c.name, **scores[c.id]} for c in chosen]
    return {"alphas": list(alphas), "n_texts": len(texts), "latents": rows,
            "median_ratio": statistics.median(r["ratio"] for r in rows),
            "share_ratio_above_1": sum(r["ratio"] > 1 for r in rows) / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concepts", type=Path, default=Path("runs/demo/concepts"))
    ap.add_argument("--root", type=Path, default=Path("runs/bench_erase"))
    ap.add_argument("--latents", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.time()
    from conceptdict.naming.interventions.erase import format_table

    table = erase_table(args.root, args.concepts)
    print(f"\nerasure of mentions_return (C) keeping family (Y), {table['n_train']} fit / {table['n_test']} test rows")
    print(format_table(table))
    steer = steering(args.concepts, args.latents)
    print(f"\nsteerability on {steer['n_texts']} docstrings, alphas {steer['alphas']} (cosine to the name's embedding)")
    print(f"{'id':>5} {'name':<14} {'effect/alpha':>13} {'random':>9} {'ratio':>7} {'damage':>8}")
    for r in steer["latents"]:
        print(f"{r['id']:>5} {r['name']:<14} {r['effect_per_alpha']:>13.4f} {r['random_effect_per_alpha']:>9.4f} "
              f"{r['ratio']:>7.2f} {r['damage']:>8.4f}")
    print(f"median ratio {steer['median_ratio']:.2f}; share of latents above 1: {steer['share_ratio_above_1']:.2f} "
          f"({time.time() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"erase": table, "steer": steer}, indent=1) + "\n")


if __name__ == "__main__":
    main()
