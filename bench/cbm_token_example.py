"""One prediction's explanation on the token route (docs/results/cbm.md, "The token route on five corpora"): the
block-5 token dictionary ``bench/cbm_candidates.py`` trained for ``--corpus`` (``pooledsuper@5``) named as the
guide names a dictionary (``name --vocab wordfreq:en:20000``, reused once written), the CBM fitted on its pooled
concepts with every ``cbm`` default (the per-prediction bound included) and the names, on split ``--seed``; prints
the CBM's figures, the top concepts of the first ``--inputs`` test predictions and each class's heaviest concepts.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/cbm_token_example.py --corpus debian
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conceptdict as cd
from cbm_accuracy import VOCAB, task_store
from cbm_candidates import LAST_BLOCK, pooled
from cbm_explain import print_explanations
from cbm_corpora import CORPORA, HOOKPOINT
from conceptdict.naming.bottleneck.baseline import fitting_rows
from conceptdict.naming.bottleneck.cbm import CbmConfig, encode_labels, train_cbm
from conceptdict.naming.concepts import load_concepts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="debian", choices=sorted(CORPORA))
    p.add_argument("--work", type=Path, default=Path("runs/bench/cbm-accuracy"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", type=int, default=4)
    args = p.parse_args(argv)
    run = args.work / "runs" / args.corpus
    sae, named = run / f"sae-blocks.{LAST_BLOCK}.hook_out", run / f"concepts-blocks.{LAST_BLOCK}.hook_out"
    if not (sae / "config.json").exists():
        raise SystemExit(f"no token dictionary at {sae}; run bench/cbm_candidates.py --corpus {args.corpus} "
                         "--candidate pooledsuper@5 first")
    if not (named / "concepts.json").exists():
        cd.name(sae, vocab=VOCAB, out=named, overwrite=True)
    names = load_concepts(named).names
    store_dir = task_store(args.corpus, args.work)
    store = cd.open_store(store_dir)
    raw = torch.cat([x.float() for _, x in store.iter_rows(HOOKPOINT, 4096)])
    labels, texts = list(store.labels("label")), store.texts()
    x, dirs = pooled(args.corpus, store_dir, labels, args.work, "super", LAST_BLOCK)
    cfg = CbmConfig(label_column="label", seed=args.seed)
    r = train_cbm(x, labels, names, cfg, raw=raw, directions=dirs)
    m = r.metrics
    print(f"{args.corpus} split {args.seed}: CBM {100 * m['accuracy']:.1f}%, probe {100 * m['probe_accuracy']:.1f}%, "
          f"lambda {r.lam:g}, {m['concepts_used']} concepts used, per prediction {m['concepts_per_prediction']}, "
          f"bound {m.get('per_prediction_bound')}")
    y, _, keep = encode_labels(labels, cfg.min_class_size)
    split = fitting_rows(y, cfg.val_fraction, cfg.test_fraction, args.seed, cfg.cv_folds, cfg.cv_max_rows)[0]
    print_explanations(r, x, labels, texts, keep[split.test[: args.inputs]].tolist())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
