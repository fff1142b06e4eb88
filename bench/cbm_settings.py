"""One CBM setting at several values, on the stores and dictionaries ``bench/cbm_accuracy.py`` left in ``--work``:
mean CBM accuracy, raw-probe accuracy and gap over ``--seeds`` splits, per corpus and route (the task's own
dictionary, and the broad one), without training any dictionary again.

Each fit is ``conceptdict cbm CONCEPTS --label-column label [--dataset STORE] --seed S --KEY VALUE`` with every
other setting at its default, e.g. the per-concept scale before the L1 path::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_accuracy.py --broad          # once: stores and dictionaries
    HF_HUB_OFFLINE=1 .venv/bin/python bench/cbm_settings.py scale std probe --json runs/bench/cbm_scale.json

The own route reads the store its concept dictionary was named on, found under ``--work`` by the name recorded in
``concepts.json`` (so a ``--work`` folder copied from another checkout works; nothing under it is written). Each
split's figures are kept in ``--json`` (``fits``); ``added share`` is the mean share of each test prediction's
|contribution| that comes from the concepts ``--add-pairs`` added (``metrics["added_share"]``; 0 without them).
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
import conceptdict as cd
from cbm_accuracy import DEFAULT_CORPORA, mean_se, task_store
from cbm_corpora import CORPORA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("key", help="a `conceptdict cbm` setting (CbmConfig field), e.g. scale")
    p.add_argument("values", nargs="+", help="its values to compare (parsed as JSON where they parse, else strings)")
    p.add_argument("--corpus", action="append", choices=sorted(CORPORA),
                   help="repeat; default: the six of bench/cbm_accuracy.py")
    p.add_argument("--route", action="append", choices=["own", "broad"], help="repeat; default: both")
    p.add_argument("--work", type=Path, default=Path("runs/bench/cbm-accuracy"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help="the splits are seeds first-seed .. first-seed + seeds - 1 (to add a split to an earlier run)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--broad-concepts", type=Path, default=None,
                   help="the broad route's concept dictionary (default: the cached one `conceptdict broad` made for "
                        "this environment; its key covers the installed packages, so another venv may not find it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another setting held fixed for every fit (repeat), e.g. --set add_pairs=8")
    return p.parse_args(argv)


def fixed(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` as keyword arguments of ``cd.cbm`` (values parsed as by :func:`value`)."""
    bad = [t for t in pairs if "=" not in t]
    if bad:
        raise SystemExit(f"--set {bad[0]!r}: give KEY=VALUE, e.g. --set add_pairs=8")
    return {k: value(v) for k, v in (t.split("=", 1) for t in pairs)}


def value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def own_store(concepts: Path, work: Path) -> Path:
    """The store the own dictionary was named on: its ``concepts.json`` records it; taken from ``work/stores`` by
    that name (the recorded absolute path may be another checkout's)."""
    recorded = Path(json.loads((concepts / "concepts.json").read_text())["meta"]["store"])
    local = work / "stores" / recorded.name
    if not (local / "manifest.json").exists():
        raise SystemExit(f"{local} (the store {concepts} was named on) is missing; run bench/cbm_accuracy.py --work "
                         f"{work} first")
    return local


def fit_row(m: dict, seconds: float) -> dict:
    """One split's figures (percent and counts) from a CBM's metrics."""
    added = m.get("added_concepts") or {}
    return {"probe": m["probe_accuracy"], "cbm": m["accuracy"], "gap": 100 * m["probe_gap"],
            "concepts_used": m["concepts_used"], "per_prediction": m["concepts_per_prediction"],
            "added_share": m.get("added_share", 0.0), "added_used": len(added.get("used", ())),
            "n_added": added.get("n_added", 0), "bound": m.get("added_bound"), "seconds": seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    wants_broad = "broad" in (args.route or ["own", "broad"])
    broad_concepts = args.broad_concepts
    if wants_broad and broad_concepts is None:
        cached = cd.cached_broad_dictionary()
        broad_concepts = cached.concepts if cached is not None else None
    rows = []
    print(f"| corpus | route | {args.key} | probe | CBM | mean gap ± SE | largest gap | concepts used | concepts per "
          "prediction | added share | cbm s |\n|" + "---|" * 11)
    for name in args.corpus or DEFAULT_CORPORA:
        for route in args.route or ["own", "broad"]:
            if route == "broad" and broad_concepts is None:
                raise SystemExit("no broad dictionary is cached; run `conceptdict broad` (or bench/cbm_accuracy.py "
                                 "--broad) first")
            concepts = args.work / "runs" / name / "concepts" if route == "own" else broad_concepts
            if not concepts.exists():
                raise SystemExit(f"{concepts} is missing; run bench/cbm_accuracy.py --work {args.work} first")
            store = own_store(concepts, args.work) if route == "own" else task_store(name, args.work)
            kw = {"dataset": str(store), **fixed(args.set)}
            for v in map(value, args.values):
                fits, t0 = [], time.perf_counter()
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    t1 = time.perf_counter()
                    fits.append(fit_row(cd.cbm(concepts, label_column="label", seed=seed, **{args.key: v},
                                               **kw).metrics, time.perf_counter() - t1))
                    f = fits[-1]
                    print(f"  ({name}, {route}, {v}, seed {seed}: probe {100 * f['probe']:.1f}%, CBM "
                          f"{100 * f['cbm']:.1f}%, gap {f['gap']:+.1f}, {f['concepts_used']} concepts, "
                          f"{f['per_prediction']['nonzero']:.0f} / {f['per_prediction']['90']:.0f} per prediction, "
                          f"added {f['added_used']} of {f['n_added']}, share {100 * f['added_share']:.1f}%, "
                          f"{f['seconds']:.0f} s)", file=sys.stderr, flush=True)
                seconds = (time.perf_counter() - t0) / args.seeds
                gaps = [f["gap"] for f in fits]
                mean, se = mean_se(gaps)
                row = {"corpus": name, "route": route, args.key: v, "seconds": seconds, "gaps": gaps,
                       **{k: statistics.fmean(f[k] for f in fits) for k in ("cbm", "probe", "concepts_used",
                                                                            "added_share")},
                       "per_prediction": {k: statistics.median(f["per_prediction"][k] for f in fits)
                                          for k in fits[0]["per_prediction"]},
                       "mean_gap": mean, "se": se, "fits": fits}
                rows.append(row)
                print(f"| {name} | {route} | {v} | {100 * row['probe']:.1f}% | {100 * row['cbm']:.1f}% | "
                      f"{row['mean_gap']:+.1f} ± {row['se']:.1f} | {max(gaps):+.1f} | {row['concepts_used']:.0f} | "
                      f"{row['per_prediction']['nonzero']:.0f} / {row['per_prediction']['90']:.0f} | "
                      f"{100 * row['added_share']:.1f}% | {seconds:.0f} |",
                      flush=True)
                if args.json:  # after every row: a long run's finished rows survive its interruption
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"key": args.key, "rows": rows}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
