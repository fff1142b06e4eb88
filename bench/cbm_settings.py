"""One CBM setting at several values, on the stores and dictionaries ``bench/cbm_accuracy.py`` left in ``--work``:
mean CBM accuracy, raw-probe accuracy and gap over ``--seeds`` splits, per corpus and route (the task's own
dictionary, and the broad one), without training any dictionary again.

Each fit is ``conceptdict cbm CONCEPTS --label-column label [--dataset STORE] --seed S --KEY VALUE`` with every
other setting at its default, e.g. the per-concept scale before the L1 path::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_accuracy.py --broad          # once: stores and dictionaries
    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_settings.py scale std probe --json runs/bench/cbm_scale.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cbm_accuracy import DEFAULT_CORPORA, mean_se, task_store  # noqa: E402
from cbm_corpora import CORPORA  # noqa: E402

import conceptdict as cd  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("key", help="a `conceptdict cbm` setting (CbmConfig field), e.g. scale")
    p.add_argument("values", nargs="+", help="its values to compare (parsed as JSON where they parse, else strings)")
    p.add_argument("--corpus", action="append", choices=sorted(CORPORA),
                   help="repeat; default: the six of bench/cbm_accuracy.py")
    p.add_argument("--route", action="append", choices=["own", "broad"], help="repeat; default: both")
    p.add_argument("--work", type=Path, default=Path("runs/bench/cbm-accuracy"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    broad = cd.cached_broad_dictionary() if "broad" in (args.route or ["own", "broad"]) else None
    rows = []
    print(f"| corpus | route | {args.key} | probe | CBM | mean gap ± SE | largest gap | concepts used | concepts per "
          "prediction | cbm s |\n|" + "---|" * 10)
    for name in args.corpus or DEFAULT_CORPORA:
        store = task_store(name, args.work)
        for route in args.route or ["own", "broad"]:
            if route == "broad" and broad is None:
                raise SystemExit("no broad dictionary is cached; run `conceptdict broad` (or bench/cbm_accuracy.py "
                                 "--broad) first")
            concepts = args.work / "runs" / name / "concepts" if route == "own" else broad.concepts
            if not concepts.exists():
                raise SystemExit(f"{concepts} is missing; run bench/cbm_accuracy.py --work {args.work} first")
            kw = {"dataset": str(store)} if route == "broad" else {}
            for v in map(value, args.values):
                fits, t0 = [], time.perf_counter()
                for seed in range(args.seeds):
                    m = cd.cbm(concepts, label_column="label", seed=seed, **{args.key: v}, **kw).metrics
                    fits.append(m)
                    print(f"  ({name}, {route}, {v}, seed {seed}: probe {100 * m['probe_accuracy']:.1f}%, CBM "
                          f"{100 * m['accuracy']:.1f}%, gap {100 * m['probe_gap']:+.1f}, {m['concepts_used']} "
                          f"concepts, {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                seconds = (time.perf_counter() - t0) / args.seeds
                gaps = [100 * m["probe_gap"] for m in fits]
                mean, se = mean_se(gaps)
                row = {"corpus": name, "route": route, args.key: v, "seconds": seconds, "gaps": gaps,
                       "cbm": statistics.fmean(m["accuracy"] for m in fits),
                       "probe": statistics.fmean(m["probe_accuracy"] for m in fits),
                       "concepts_used": statistics.fmean(m["concepts_used"] for m in fits),
                       "per_prediction": {k: statistics.median(m["concepts_per_prediction"][k] for m in fits)
                                          for k in fits[0]["concepts_per_prediction"]},
                       "mean_gap": mean, "se": se}
                rows.append(row)
                print(f"| {name} | {route} | {v} | {100 * row['probe']:.1f}% | {100 * row['cbm']:.1f}% | "
                      f"{row['mean_gap']:+.1f} ± {row['se']:.1f} | {max(gaps):+.1f} | {row['concepts_used']:.0f} | "
                      f"{row['per_prediction']['nonzero']:.0f} / {row['per_prediction']['90']:.0f} | {seconds:.0f} |",
                      flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"key": args.key, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
