"""What a CBM's inputs could be, on one labelled corpus: how much of the raw probe's accuracy each set of concept
activations can carry at all, and what the CBM makes of it.

Per candidate and split (``cbm --seed 0..N-1``, the stores and own dictionaries ``bench/cbm_accuracy.py`` left in
``--work``), two figures beside the raw probe (``conceptdict cbm``'s baseline: standardised raw activations, L2 by
the same 5-fold cross-validation):

- **ceiling**: the same probe fitted on the candidate's concept activations instead of the raw ones (dense, every
  concept, L2 chosen the same way). A CBM reads the same activations through a sparse layer, so what the ceiling
  misses of the raw probe no choice of lambda, refit or scale can recover: it is lost in the features.
- **CBM** (``--cbm``): ``naming.bottleneck.cbm.train_cbm`` on those activations with every ``conceptdict cbm``
  default (the probe scale from the candidate's decoder directions, the lambda path, refits, 5-fold choice):
  accuracy, gap to the raw probe, concepts used, and concepts per prediction (median over the test inputs:
  contributing at all / making up 90% of the predicted class's positive contribution).

Candidates (``--candidate``, repeat):

- ``own``: the encoder's ReLU activations of the own dictionary (``cbm --codes relu``, the default);
  ``sparse``: its TopK code (``--codes sparse``);
- ``signed``: the own encoder's pre-activations split into two non-negative concepts each, ``relu(pre)`` and
  ``relu(-pre)`` (a linear layer on them reads every direction the encoder spans);
- ``LxxxKyy``: a dictionary of xxx latents and k yy trained on the corpus's store (``conceptdict train --latents
  xxx --k yy``, every other setting at its default; written under ``--work``), its ReLU activations;
- ``broad``: the broad dictionary's ReLU activations (``conceptdict broad``, cached); ``union``: the own and the
  broad dictionaries' concepts side by side;
- ``names``: the own concepts plus, per class, the cosine between a row's embedding and the embedding of the
  class's name (:data:`CLASS_NAMES`; the concept supervision of CB-SAE, ``conceptdict cbsae``, in its plainest form:
  what a bottleneck latent aligned to that text could add);
- ``addedN`` (e.g. ``added4``): the own concepts plus those ``conceptdict cbm --add-pairs N`` adds where the classes
  need them (``naming.bottleneck.added``: per class pair the own concepts confuse most, out of fold on the split's
  fitting rows, the shrinkage-LDA direction of the raw activations (``--add-reads error``: of the dictionary's
  reconstruction error), as two non-negative halves),
  fitted per split on that split's fitting rows only; the CBM is ``train_cbm(own, ..., add_pairs=N)``, so its row
  also says how many it added and how many it uses.
- ``pooledmean``, ``pooledmax``, ``pooledsuper`` (pooled token evidence, optionally ``@B`` for block B, default
  the last, 5): the corpus's texts cached at the token-level hookpoint ``blocks.B.hook_out`` (``conceptdict cache
  --packing false``: one text per context; the store keeps no row for padding or for the tokenizer's special
  tokens, [CLS] and [SEP]), a dictionary trained on those token rows (``conceptdict train --latents 1024 --k 16``,
  every other setting at its default; under ``--work``), every token encoded (the encoder's ReLU activations) and
  pooled per text by ``naming.bottleneck.features.store_features``, as ``conceptdict cbm`` pools a token-level store:
  mean, max, or ``super`` (per concept the mean of the text's top 10% token activations, at least one). The CBM's
  probe scale reads the dictionary's decoder directions for block 5 (the sentence embedding is the normalised mean
  of block 5's tokens, so the same space) and falls back to ``std`` for another block. ``-sparse`` (e.g.
  ``pooledmax-sparse``): the tokens' TopK code pooled instead (``cbm --codes sparse``; k per token, so fewer per
  text).
- several joined by ``+`` (e.g. ``own+pooledsuper@5``, ``own+pooledsuper-sparse@5``: both routes' concepts in one
  bottleneck): the parts' activations side by side, as ``union`` joins own and broad, each concept named after its
  part (``own:12``, ``pooledsuper@5:7``; the row's ``used_by_part`` counts each part's used concepts). The CBM's one
  probe scale over the joined concepts would normalise them together, and parts in other units (sentence against
  token activations) would then differ in cost under the one L1 penalty (on man2 the token part's scaled std
  averages 6x the own part's); so each part is first divided by the spread its own probe scale normalises by, on the
  split's fitting rows (:func:`part_scales`), and each part gets the scale it gets alone. Without every part's
  decoder directions the CBM falls back to ``std`` (per concept) and nothing is divided.
- ``tokenmean`` (``@B``): no concepts, the mean of the text's token rows at ``blocks.B.hook_out``: its ceiling is
  the raw probe ``conceptdict cbm`` fits on a token-level store (beside the sentence embedding's raw probe here).

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python bench/cbm_accuracy.py --corpus msglang      # store, own dictionary
    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python bench/cbm_candidates.py --corpus msglang --candidate own \\
        --candidate signed --candidate L1024K32 --candidate union --candidate names --seeds 3
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/cbm_candidates.py --corpus msglang \
        --candidate own --candidate tokenmean --candidate pooledsuper --candidate pooledmax --candidate pooledmean \
        --seeds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conceptdict as cd
from cbm_accuracy import FLAGS, mean_se, task_store
from cbm_corpora import CORPORA, HOOKPOINT
from conceptdict.naming.bottleneck.added import add_needed_concepts, cbm_residual
from conceptdict.naming.bottleneck.baseline import concept_scale, fit_raw_probe, fitting_rows
from conceptdict.naming.bottleneck.cbm import CbmConfig, encode_labels, train_cbm
from conceptdict.naming.bottleneck.features import concept_directions, row_inputs, store_features
from conceptdict.saes import open_dictionary
from conceptdict.saes.kinds.common import pre_activations

CLASS_NAMES = {"ca": "Catalan", "da": "Danish", "de": "German", "es": "Spanish", "fr": "French", "it": "Italian",
               "nb": "Norwegian", "nl": "Dutch", "pt_BR": "Portuguese", "sv": "Swedish"}
"""The ``names`` candidate's text per class (msglang's languages); classes without one are left out."""
SIZED = re.compile(r"L(\d+)K(\d+)$")
ADDED = re.compile(r"added(\d+)$")
POOLED = re.compile(r"(pooled(mean|max|super)(-sparse)?|tokenmean)(?:@(\d+))?$")
LAST_BLOCK = 5
"""The default model's last block: its token rows are what the sentence embedding averages."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="msglang", choices=sorted(CORPORA))
    p.add_argument("--candidate", action="append",
                   help="own, sparse, signed, LxxxKyy, broad, union, names, addedN, pooledmean, pooledmax, "
                        "pooledsuper, pooledX-sparse, tokenmean (the pooled ones with @B: block B), or several "
                        "joined by + (e.g. own+pooledsuper@5); repeat")
    p.add_argument("--work", type=Path, default=Path("runs/bench/cbm-accuracy"))
    p.add_argument("--seeds", type=int, default=3, help="splits 0..N-1")
    p.add_argument("--cbm", action="store_true", help="also fit the CBM on each candidate (slow: the whole path)")
    p.add_argument("--cv-folds", type=int, default=CbmConfig.cv_folds,
                   help="the CBM's cv_folds (0: one validation split, about a sixth of the fits)")
    p.add_argument("--add-reads", default=CbmConfig.add_reads, choices=["raw", "error"],
                   help="addedN: what the added directions read (CbmConfig.add_reads)")
    p.add_argument("--lam", type=float, action="append", default=None,
                   help="the CBM's lambdas (repeat; default: CbmConfig's grid), e.g. larger ones for fewer concepts")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def relu_of(sae, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the encoder's ReLU activations of raw [N, D] through dictionary ``sae``, its decoder directions [L, D])."""
    model, _ = open_dictionary(sae)
    with torch.no_grad():
        return model.dense_activations(raw).float(), concept_directions(model, raw.shape[1])


def candidate(name: str, corpus: str, store: Path, raw: torch.Tensor, labels: list, work: Path):
    """(concept activations [N, L'], decoder directions [L', D] or None) of candidate ``name``."""
    own = work / "runs" / corpus / "sae"
    if name in ("own", "sparse", "signed") or ADDED.match(name):
        model, _ = open_dictionary(own)
        dirs = concept_directions(model, raw.shape[1])
        with torch.no_grad():
            if name == "sparse":
                return model.encode(raw).float(), dirs
            if name == "own" or ADDED.match(name):
                return model.dense_activations(raw).float(), dirs
            pre = pre_activations(model, raw).float()  # relu(pre) - relu(-pre) = pre: every direction it spans
            return torch.cat([pre.clamp_min(0), (-pre).clamp_min(0)], 1), torch.cat([dirs, -dirs])
    if m := SIZED.match(name):
        out = work / "runs" / corpus / f"sae-{name}"
        if not (out / "config.json").exists():
            cd.train(store=[store], hookpoint=[HOOKPOINT], out=out, overwrite=True, latents=int(m[1]), k=int(m[2]))
        return relu_of(out, raw)
    if name in ("broad", "union"):
        broad = cd.cached_broad_dictionary()
        if broad is None:
            raise SystemExit("no broad dictionary is cached; run `conceptdict broad` first")
        b, bdirs = relu_of(broad.sae, raw)
        if name == "broad":
            return b, bdirs
        o, odirs = relu_of(own, raw)
        return torch.cat([o, b], 1), torch.cat([odirs, bdirs])
    if name == "names":
        from conceptdict.naming.scoring import model_embedder

        classes = sorted({str(v) for v in labels} & set(CLASS_NAMES))
        text = model_embedder("default", HOOKPOINT)([CLASS_NAMES[c] for c in classes])
        o, _ = relu_of(own, raw)
        unit = raw / raw.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return torch.cat([o, unit @ text.T], 1), None
    if m := POOLED.match(name):
        return pooled(corpus, store, labels, work, m[2] or "mean", int(m[4] or LAST_BLOCK),
                      raw_only=m[1] == "tokenmean", codes="sparse" if m[3] else "relu")
    raise SystemExit(f"unknown candidate {name!r}: one of own, sparse, signed, LxxxKyy (e.g. L1024K32), broad, "
                     "union, names, addedN, pooledmean, pooledmax, pooledsuper (each also -sparse), tokenmean (the "
                     "pooled ones with @B: block B), or several joined by + (e.g. own+pooledsuper@5)")


def joined(name: str, corpus: str, store: Path, raw: torch.Tensor, labels: list, work: Path):
    """(activations [N, L'], directions [L', D] or None, each part's name and width) of ``name``: one candidate, or
    several joined by ``+`` side by side (as ``union`` joins own and broad)."""
    parts = name.split("+")
    got = [candidate(part, corpus, store, raw, labels, work) for part in parts]
    dirs = [d for _, d in got]
    return (torch.cat([x for x, _ in got], 1), torch.cat(dirs) if all(d is not None for d in dirs) else None,
            [(part, x.shape[1]) for part, (x, _) in zip(parts, got)])


def part_scales(x: torch.Tensor, dirs: torch.Tensor | None, widths: list[int], probe, rows: torch.Tensor):
    """x [N, L'] of a joined candidate (parts ``widths`` wide, side by side) with each part divided by the spread its
    own ``probe`` scale normalises by on ``rows`` (``baseline.concept_scale``): the CBM's one probe scale over the
    joined concepts then gives each part the scale it gets alone (parts in different units, e.g. sentence and token
    activations, stay comparable under the one L1 penalty). Unchanged without directions (``std`` is per concept)."""
    if dirs is None or len(widths) < 2:
        return x
    out, at = [], 0
    for w in widths:
        part, d = x[:, at:at + w], dirs[at:at + w]
        scale, how = concept_scale(part[rows], "probe", probe, d)
        importance = (d.to(probe.weight) @ probe.weight.T).norm(dim=1)
        out.append(part * float(scale.sum() / importance.sum()) if how == "probe" else part)  # / the spread
        at += w
    return torch.cat(out, 1)


def pooled(corpus: str, store: Path, labels: list, work: Path, pooling: str, block: int, raw_only: bool = False,
           codes: str = "relu"):
    """(per text of the sentence store ``store``: its token rows' concept activations at ``blocks.{block}.hook_out``
    (``codes``: relu or sparse, as ``cbm --codes``) pooled by ``pooling``, the token dictionary's decoder directions
    for the last block else None); with ``raw_only``: the mean of its raw token rows and None."""
    hookpoint = f"blocks.{block}.hook_out"
    tokens = cd.open_store(task_store(corpus, work, hookpoint))
    sae = work / "runs" / corpus / f"sae-{hookpoint}"
    if not (sae / "config.json").exists():
        cd.train(store=[tokens.path], hookpoint=[hookpoint], out=sae, overwrite=True, **FLAGS)
    model, _ = open_dictionary(sae)
    feats = store_features(model, tokens, hookpoint, "label", pooling, codes=codes)
    texts = torch.unique(row_inputs(tokens))  # the context index of each pooled row, ascending
    wanted = cd.open_store(store).context_index(0, len(labels)).to(torch.int64)
    at = torch.searchsorted(texts, wanted).clamp_max(len(texts) - 1)
    if not torch.equal(texts[at], wanted) or [feats.labels[i] for i in at.tolist()] != labels:
        raise SystemExit(f"{tokens.path} does not hold every text of {store} with its label; delete it and rerun")
    if raw_only:
        return feats.raw[at], None
    return feats.concepts[at], concept_directions(model, feats.raw.shape[1]) if block == LAST_BLOCK else None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    store_dir = task_store(args.corpus, args.work)
    store = cd.open_store(store_dir)
    raw = torch.cat([x.float() for _, x in store.iter_rows(HOOKPOINT, 4096)])
    labels = list(store.labels("label"))
    cfg = CbmConfig(label_column="label")
    y, classes, keep = encode_labels(labels, cfg.min_class_size)
    probes, rows = {}, []
    print("| candidate | concepts | active per row | split | raw probe | ceiling | CBM | gap | concepts used | "
          "per prediction |\n|" + "---|" * 10)
    for name in args.candidate or ["own"]:
        x, dirs, parts = joined(name, args.corpus, store_dir, raw, labels, args.work)
        concept_names = [f"{part}:{i}" for part, width in parts for i in range(width)]  # each part's own prefix
        pairs = int(m[1]) if (m := ADDED.match(name)) else 0
        residual = cbm_residual(open_dictionary(args.work / "runs" / args.corpus / "sae")[0], raw, args.add_reads) \
            if pairs else None
        active = float((x[keep] != 0).sum(1).float().median())
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            split, folds, fit_rows = fitting_rows(y, cfg.val_fraction, cfg.test_fraction, seed, cfg.cv_folds,
                                                  cfg.cv_max_rows)  # fmt: skip
            xs = x
            if pairs:  # the split's own added concepts, fitted on its fitting rows (as train_cbm fits them)
                added = add_needed_concepts(x[keep], residual.values[keep], y, classes, fit_rows, pairs=pairs,
                                            seed=seed, residual_kind=residual.kind)  # fmt: skip
                xs = x.new_zeros(x.shape[0], x.shape[1] + len(added))
                xs[keep] = torch.cat([x[keep], added.activations_for_fit(residual.values[keep], fit_rows)], 1)
            if seed not in probes:  # the same for every candidate
                probes[seed] = fit_raw_probe(raw[keep], y, *split, len(classes), cfg.probe_l2, cfg.max_iter, cfg.tol,
                                             folds=folds, seed=seed)  # fmt: skip
            probe = probes[seed]
            xj = part_scales(x, dirs, [w for _, w in parts], probe, keep[fit_rows])  # joined: each part's own scale
            ceiling = fit_raw_probe(xs[keep], y, *split, len(classes), cfg.probe_l2, cfg.max_iter, cfg.tol,
                                    folds=folds, seed=seed)  # fmt: skip
            row = {"candidate": name, "concepts": xs.shape[1], "active_per_row": active, "seed": seed,
                   "probe": probe.test_accuracy, "ceiling": ceiling.test_accuracy, "ceiling_l2": ceiling.l2}
            if args.cbm:
                fit_cfg = CbmConfig(label_column="label", seed=seed, cv_folds=args.cv_folds, add_pairs=pairs,
                                    add_reads=args.add_reads,
                                    **({"lambdas": args.lam} if args.lam else {}))  # fmt: skip
                r = train_cbm(xj, labels, concept_names, fit_cfg, raw=raw, directions=dirs,
                              residual=residual)  # fmt: skip
                m = r.metrics
                used = (r.weight != 0).any(0).tolist()
                row["used_by_part"] = {part: sum(u for n, u in zip(r.concept_names, used) if n.startswith(part + ":"))
                                       for part, _ in parts}  # fmt: skip
                row.update(cbm=m["accuracy"], gap=100 * m["probe_gap"], used=m["concepts_used"],
                           per_prediction=m["concepts_per_prediction"], lam=r.lam, refit_l2=m["refit_l2"],
                           lambda_path=m["lambda_path"],  # with --json: what the choice rule saw
                           per_prediction_bound=m.get("per_prediction_bound"))
                if "added_concepts" in m:
                    a = m["added_concepts"]
                    row.update(added=a["n_added"], added_used=a["used"], added_share=a["contribution_share"])
                    print(f"  added {a['n_added']}: {', '.join(a['names'])}; used {len(a['used'])}: "
                          f"{', '.join(a['used'])}; share of the contribution {100 * a['contribution_share']:.1f}%",
                          flush=True)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            cbm = (f"{100 * row['cbm']:.1f}% | {row['gap']:+.1f} | {row['used']} | "
                   f"{row['per_prediction']['nonzero']:.0f} / {row['per_prediction']['90']:.0f}") if args.cbm else \
                "- | - | - | -"
            print(f"| {name} | {xs.shape[1]} | {active:.0f} | {seed} | {100 * probe.test_accuracy:.1f}% | "
                  f"{100 * ceiling.test_accuracy:.1f}% | {cbm} |"
                  + (f" lambda {r.lam:g}, refit L2 {m['refit_l2']}, used by part {row['used_by_part']}, bound "
                     f"{m.get('per_prediction_bound')}" if args.cbm and len(parts) > 1 else ""), flush=True)
        mine = [r for r in rows if r["candidate"] == name]
        short, se = mean_se([100 * (r["probe"] - r["ceiling"]) for r in mine])
        line = f"{name}: raw probe - ceiling {short:+.1f} ± {se:.1f} points"
        if args.cbm:
            gap, gse = mean_se([r["gap"] for r in mine])
            line += (f"; gap {gap:+.1f} ± {gse:.1f} (largest {max(r['gap'] for r in mine):+.1f}), concepts used "
                     f"{statistics.fmean(r['used'] for r in mine):.0f}, per prediction (median of the splits) "
                     f"{statistics.median(r['per_prediction']['nonzero'] for r in mine):.0f} / "
                     f"{statistics.median(r['per_prediction']['90'] for r in mine):.0f}")
        print(line, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"corpus": args.corpus, "rows": rows}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
