"""A CBM's explanations, from its folder alone (``cd.cbm_features``): its figures, the top concepts of ``--inputs``
test predictions spread over its test rows (the split it was fitted on, its recorded seed), and each class's heaviest concepts.
For docs/results/cbm.md's example explanations of the route ``bench/cbm_accuracy.py`` runs (``--work``'s
``runs/CORPUS/cbm``, seed 0).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/cbm_explain.py \\
        runs/bench/cbm-accuracy/runs/debian/cbm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import conceptdict as cd
from conceptdict.naming import class_concepts, explain_input, load_cbm
from conceptdict.naming.bottleneck.baseline import fitting_rows
from conceptdict.naming.bottleneck.cbm import encode_labels


def print_explanations(cbm, concepts: torch.Tensor, labels: list, texts: list[str], rows: list[int], top: int = 5):
    """Each of ``rows``' text, label, prediction and top concepts (``naming.explain_input``), then each class's
    heaviest concepts (``naming.class_concepts``)."""
    for i in rows:
        pred = cbm.classes[int(cbm.logits(concepts[i : i + 1]).argmax(1))]
        why = "; ".join(f"{c.name} {c.value:+.2f}" for c in explain_input(cbm, concepts[i], top=top))
        print(f"- {texts[i][:110]!r} (label {labels[i]}, predicted {pred}): {why}")
    for c in cbm.classes:
        print(f"  class {c}: {', '.join(k.name for k in class_concepts(cbm, c, top=6))}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cbm", type=Path, help="a folder `conceptdict cbm --out` wrote")
    p.add_argument("--inputs", type=int, default=4, help="test predictions to explain")
    p.add_argument("--top", type=int, default=5, help="concepts per explanation")
    args = p.parse_args(argv)
    cbm = load_cbm(args.cbm)
    config = json.loads((args.cbm / "cbm_config.json").read_text())
    m = cbm.metrics
    feats = cd.cbm_features(cbm)
    texts = cd.open_store(cbm.meta["store"]).texts()
    print(f"{args.cbm}: CBM {100 * m['accuracy']:.1f}%, probe {100 * m['probe_accuracy']:.1f}%, lambda {cbm.lam:g} "
          f"(refit L2 {m['refit_l2']}), {m['concepts_used']} concepts used, per prediction "
          f"{m['concepts_per_prediction']['nonzero']:.0f} (90%: {m['concepts_per_prediction']['90']:.0f})")
    for part in m.get("parts") or ():
        print(f"  {part['route']}: {part['used']} of {part['width']} used, "
              f"{100 * part['contribution_share']:.1f}% of the positive contribution")
    y, classes, keep = encode_labels(feats.labels, config["min_class_size"])
    split = fitting_rows(y, config["val_fraction"], config["test_fraction"], config["seed"], config["cv_folds"],
                         config["cv_max_rows"])[0]  # fmt: skip
    spread = torch.linspace(0, len(split.test) - 1, min(args.inputs, len(split.test))).round().long()
    rows = keep[split.test[spread]].tolist()  # spread over the test rows (a corpus's rows come grouped by source)
    print_explanations(cbm, feats.concepts, feats.labels, texts or [f"input {int(i)}" for i in feats.inputs], rows,
                       args.top)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
