"""Every one-space kind x the field's yardsticks (`eval --metrics all`): the table of docs/results/yardsticks.md.

Planted data (``generators.synthetic``, hierarchical: families of a parent and 3 children, Zipf-like firing,
log-normal magnitudes): the rows go through ``store import`` with their true features (``--true-features``, the
atoms) and true codes (``--true-codes``: which atoms fired in each row) and a label column ``parent`` (the first of
parents 0-3 active in the row, 4 when none is), so ``ground-truth``, ``sparse-probing`` and ``core`` all run. Each
kind trains with the CLI's defaults, only ``--latents``, ``--k`` and the row budget given, and is evaluated on the
batches its training held out (core) and on the store's first rows (sparse-probing, ground-truth).

``--real STORE``: also every kind on a real store with a label column (e.g. the demo's ``runs/demo/store``,
MiniLM sentence embeddings labelled by module family): core and sparse-probing.

``--absorption``: also every kind on the tiny letter LM of ``generators.letter_lm`` (a 1-layer GPT-2 whose word
embeddings carry their first letter; a token store of it at blocks.0.hook_out): core and absorption.

``--lm``: also every kind on a causal-LM store with a label column, so that every column of ``eval --metrics all``
that a token store can have is filled: the letter LM, trained for a few hundred steps (its letter-carrying input
embeddings frozen, its output layer untied) on documents of :data:`TOPICS` topics (each topic its own Zipf order of the words), cached at
blocks.0.hook_out one document per context with its ``topic`` as the label column. ``eval --metrics all`` then
splices each dictionary into the model (KL and CE scores against zero ablation), probes ``topic`` on mean-pooled
contexts (sparse probing) and runs absorption on the model's vocabulary; there are no true features (no MCC, F1).

    .venv/bin/python bench/yardsticks_table.py --out runs/yardsticks              # planted only
    .venv/bin/python bench/yardsticks_table.py --out runs/yardsticks --real runs/demo/store --seeds 0 1
    .venv/bin/python bench/yardsticks_table.py --out runs/yardsticks --real runs/demo/store --no-planted
    .venv/bin/python bench/yardsticks_table.py --out runs/yardsticks --absorption --no-planted
    .venv/bin/python bench/yardsticks_table.py --out runs/yardsticks --lm --no-planted --seeds 0 1 2
    .venv/bin/python bench/yardsticks_table.py --out runs/inner0.3 --real runs/demo/store --no-planted \
        --kinds matryoshka --set matryoshka_inner_weight=0.3        # a kind setting for every training
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import conceptdict as cd
import numpy as np
import torch
from conceptdict.activations.cache import CacheConfig, cache_activations
from conceptdict.saes.kinds import KINDS, trainable_kinds
from generators.letter_lm import HOOKPOINT, build_letter_lm, letter_store
from generators.synthetic import SyntheticSpec, planted_atoms, synthetic_batch_and_atoms

COLUMNS = (("core", "explained_variance", "EV"), ("core", "kl_div_score", "KL score"),
           ("core", "ce_loss_score", "CE score"), ("sparse-probing", "sae_top_1_test_accuracy", "probe top-1"),
           ("sparse-probing", "sae_top_5_test_accuracy", "probe top-5"),
           ("sparse-probing", "llm_top_5_test_accuracy", "raw top-5"), ("ground-truth", "mcc", "MCC"),
           ("ground-truth", "f1_score", "F1"), ("ground-truth", "uniqueness", "uniqueness"), ("core", "l0", "L0"))
ABSORPTION_COLUMNS = (("core", "explained_variance", "EV"),
                      ("absorption", "mean_absorption_fraction_score", "absorption fraction"),
                      ("absorption", "mean_full_absorption_score", "full absorption"),
                      ("absorption", "mean_num_split_features", "split features"), ("core", "l0", "L0"))

LM_COLUMNS = (("core", "explained_variance", "EV"), ("core", "explained_variance_textbook", "1 - FVU"),
              ("core", "kl_div_score", "KL score"),
              ("core", "ce_loss_score", "CE score"), ("sparse-probing", "sae_top_1_test_accuracy", "probe top-1"),
              ("sparse-probing", "sae_top_5_test_accuracy", "probe top-5"),
              ("sparse-probing", "llm_top_5_test_accuracy", "raw top-5"),
              ("absorption", "mean_absorption_fraction_score", "absorption fraction"), ("core", "l0", "L0"))
TOPICS = 4
"""Topics of the ``--lm`` store's documents (its label column ``topic``)."""


def one_space_kinds() -> list[str]:
    """The trainable kinds that code one space (no crosscoders, transcoders or cross-layer transcoders)."""
    return [k for k in trainable_kinds() if KINDS[k].sources == "one" and not KINDS[k].transcodes
            and not KINDS[k].layered]


def planted_store(out: Path, seed: int, batches: int) -> Path:
    spec = SyntheticSpec(n_atoms=64, d=32, active=4, batch_size=1024, n_batches=batches, seed=seed, children=3,
                         coef_sigma=0.5)
    atoms = planted_atoms(spec)
    xs, masks = zip(*(synthetic_batch_and_atoms(spec, i, atoms) for i in range(batches)))
    x, mask = torch.cat(xs), torch.cat(masks)
    parents = mask[:, :4].int()
    label = torch.where(parents.any(1), parents.argmax(1), torch.full((len(x),), 4))
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "rows.npz", acts=x.numpy().astype(np.float32), parent=label.numpy().astype(np.int64))
    np.save(out / "F.npy", atoms.numpy().astype(np.float32))
    np.save(out / "C.npy", mask.numpy().astype(np.float32))
    return cd.import_array(out / "rows.npz", out=out / "store", key="acts", true_features=out / "F.npy",
                           true_codes=out / "C.npy", overwrite=True).path


def topic_lm_store(out: Path, documents: int = 400, steps: int = 600, seed: int = 1) -> Path:
    """The ``--lm`` store: the letter LM trained ``steps`` Adam steps (lr 1e-2, 32 documents a batch; the input word
    embeddings frozen so the hookpoint keeps each word's first letter, the output layer untied and trained) on ``documents`` documents of 20 words, document i of
    topic i % TOPICS with the words drawn with weight 1 / rank in that topic's own seeded order of the vocabulary;
    then a token store at HOOKPOINT, one document per context, labelled by ``topic``."""
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    lm = build_letter_lm(out / "model")
    rng = random.Random(seed)
    words = sorted(lm.own)
    orders = [rng.sample(words, len(words)) for _ in range(TOPICS)]
    weights = [1 / r for r in range(1, len(words) + 1)]
    records = [{"text": " ".join(rng.choices(orders[i % TOPICS], weights, k=20)), "topic": i % TOPICS}
               for i in range(documents)]
    tok = PreTrainedTokenizerFast.from_pretrained(lm.path)
    model = GPT2LMHeadModel.from_pretrained(lm.path)
    model.transformer.wte.weight.requires_grad_(False)
    model.config.tie_word_embeddings = False  # the output layer learns on its own, from the embeddings' copy
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    ids = torch.tensor([[tok.bos_token_id] + tok(r["text"])["input_ids"] for r in records])
    opt = torch.optim.Adam([w for w in model.parameters() if w.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        batch = ids[torch.randint(len(ids), (32,), generator=g)]
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(lm.path)
    print(f"lm: trained {steps} steps, last batch's loss {loss.item():.3f} (uniform over the vocabulary: "
          f"{torch.log(torch.tensor(float(len(tok)))).item():.3f})", flush=True)
    cfg = CacheConfig(model=str(lm.path), hookpoints=[HOOKPOINT], dataset="", out=out / "store", context_length=32,
                      batch_size=8, progress=False, packing=False, label_columns=["topic"])
    return Path(cache_activations(cfg, records=records))


def measure(store: Path, kind: str, out: Path, latents: int, k: int, tokens: int, seed: int, metrics: str = "all",
            columns=COLUMNS, **more) -> dict:
    t0 = time.time()
    sae = cd.train(store=store, kind=kind, latents=latents, k=k, tokens=tokens, out=out, seed=seed, overwrite=True,
                   **more)
    t1 = time.time()
    ev = cd.evaluate(sae.path, metrics=metrics, rows=16384, contexts=0 if metrics != "all" else 32)
    flat = ev.yardsticks.flat()
    return {label: flat.get(f"{m}.{key}") for m, key, label in columns} | {
        "FVU": 1 - flat["core.explained_variance_textbook"], "seconds": time.time() - t0,
        "eval seconds": time.time() - t1}


def table(rows: dict[str, list[dict]], columns=COLUMNS) -> str:
    labels = [label for *_, label in columns]
    show = lambda vs: "-" if any(v is None for v in vs) else f"{statistics.mean(vs):.3f}"
    lines = ["| kind | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for kind, runs in rows.items():
        lines.append(f"| {kind} | " + " | ".join(show([r[c] for r in runs]) for c in labels) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/yardsticks"))
    p.add_argument("--kinds", nargs="+", default=None, help="default: every one-space kind")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--batches", type=int, default=24, help="planted rows: batches of 1024")
    p.add_argument("--tokens", type=int, default=200_000, help="training rows per dictionary")
    p.add_argument("--real", type=Path, default=None, help="a real store with a label column")
    p.add_argument("--real-tokens", type=int, default=46080, help="training rows on the real store (the demo's)")
    p.add_argument("--no-planted", action="store_true", help="only the --real store")
    p.add_argument("--absorption", action="store_true", help="every kind on the tiny letter LM: core, absorption")
    p.add_argument("--lm", action="store_true",
                   help="every kind on the trained letter LM's labelled token store: core with KL/CE, sparse probing, "
                        "absorption")
    p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="a kind setting given to every training, e.g. matryoshka_inner_weight=0.3 (a number)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    kinds = args.kinds or one_space_kinds()
    settings = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            settings[key] = float(value)
        except ValueError:
            raise SystemExit(f"--set {item!r}: expected FIELD=NUMBER, e.g. matryoshka_inner_weight=0.3") from None
    results: dict[str, dict[str, list[dict]]] = {} if args.no_planted else {"planted": {k: [] for k in kinds}}
    for seed in [] if args.no_planted else args.seeds:
        store = planted_store(args.out / f"planted-{seed}", seed, args.batches)
        for kind in kinds:
            r = measure(store, kind, args.out / f"planted-{seed}" / kind, 128, 4, args.tokens, seed, **settings)
            results["planted"][kind].append(r)
            print(f"planted seed {seed} {kind}: " + ", ".join(f"{c} {v:.3f}" for c, v in r.items()
                                                              if isinstance(v, float)), flush=True)
    if args.real:
        results["real"] = {k: [] for k in kinds}
        for seed in args.seeds:
            for kind in kinds:
                r = measure(args.real, kind, args.out / f"real-{seed}" / kind, 1024, 16, args.real_tokens, seed,
                            batch_size=256, **settings)  # the demo's dictionary: 1024 latents, k 16, batches of 256
                results["real"][kind].append(r)
                print(f"real seed {seed} {kind}: " + ", ".join(f"{c} {v:.3f}" for c, v in r.items()
                                                               if isinstance(v, float)), flush=True)
    if args.absorption:
        results["absorption"] = {k: [] for k in kinds}
        lm = build_letter_lm(args.out / "letter-lm" / "model")
        store = letter_store(args.out / "letter-lm" / "store", lm, documents=400)
        for seed in args.seeds:
            for kind in kinds:
                r = measure(store, kind, args.out / f"letter-{seed}" / kind, 128, 4, args.tokens, seed,
                            metrics="core,absorption", columns=ABSORPTION_COLUMNS, hookpoint=HOOKPOINT,
                            **settings)
                results["absorption"][kind].append(r)
                print(f"absorption seed {seed} {kind}: " + ", ".join(f"{c} {v:.3f}" for c, v in r.items()
                                                                     if isinstance(v, float)), flush=True)
    if args.lm:
        results["lm"] = {k: [] for k in kinds}
        store = topic_lm_store(args.out / "topic-lm")
        for seed in args.seeds:
            for kind in kinds:
                r = measure(store, kind, args.out / f"lm-{seed}" / kind, 128, 4, args.tokens, seed,
                            columns=LM_COLUMNS, hookpoint=HOOKPOINT, **settings)
                results["lm"][kind].append(r)
                print(f"lm seed {seed} {kind}: " + ", ".join(f"{c} {v:.3f}" for c, v in r.items()
                                                             if isinstance(v, float)), flush=True)
    for name, rows in results.items():
        columns = {"absorption": ABSORPTION_COLUMNS, "lm": LM_COLUMNS}.get(name, COLUMNS)
        print(f"\n{name} (mean over seeds {args.seeds}):\n{table(rows, columns)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
