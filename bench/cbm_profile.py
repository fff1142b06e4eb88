"""Where one CBM fit's time goes: per phase (the raw probe, the added concepts, each cross-validation fold's L1 path,
the final fit's path, the relaxed refits, the bound's second path), the solver calls, FISTA iterations per lambda and
the share of weights that are nonzero along the path.

The CBM's inputs (concept activations, raw activations, decoder directions, the residual for ``--add-pairs``) are
read once, as ``conceptdict cbm`` reads them, from the stores and dictionaries ``bench/cbm_accuracy.py`` left in
``--work``, and kept in ``--cache`` (``torch.save``), so a second profile of the same split fits only::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python bench/cbm_profile.py --corpus msglang --seed 0 --set add_pairs=8

Prints one line per phase (seconds, solver calls, iterations) and per L1 fit (lambda, rows, iterations, nonzero
weights), then the CBM's chosen lambda, refit, accuracy and the total; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from cbm_settings import fixed, own_store
from cbm_accuracy import task_store

import conceptdict as cd
from conceptdict.naming.bottleneck import added, baseline, bound, cbm, path, solvers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="msglang")
    p.add_argument("--route", choices=["own", "broad"], default="own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=Path("runs/bench/cbm-accuracy"))
    p.add_argument("--cache", type=Path, default=Path("runs/bench/cbm-profile"), help="the CBM's inputs, kept here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a CbmConfig setting (repeat)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--broad-concepts", type=Path, default=None,
                   help="the broad route's concept dictionary (default: the one cached for this environment)")
    return p.parse_args(argv)


def cbm_inputs(args) -> dict:
    """train_cbm's arguments for this corpus and route (read once through ``cd.cbm``, then from ``--cache``)."""
    kept = args.cache / f"{args.corpus}-{args.route}.pt"  # tensors, lists and strings: weights_only reads them
    if kept.exists():
        seen = torch.load(kept, weights_only=True)
        if seen["residual"] is not None:  # kept as (values, kind)
            seen["residual"] = added.Residual(*seen["residual"])
        return seen
    concepts = (args.work / "runs" / args.corpus / "concepts" if args.route == "own"
                else args.broad_concepts or cd.cached_broad_dictionary().concepts)
    store = own_store(concepts, args.work) if args.route == "own" else task_store(args.corpus, args.work)
    seen = {}

    # the residual is what --add-pairs reads: ask for it with add_pairs=1, so it is computed as cd.cbm computes it
    original = cbm.train_cbm
    import conceptdict.concept_api as api_mod

    def grab(concepts, labels, names, cfg, raw=None, concept_ids=None, directions=None, residual=None):
        seen.update(concepts=concepts, labels=list(labels), names=list(names), raw=raw, directions=directions,
                    residual=residual)
        raise StopIteration

    api_mod.train_cbm = grab
    try:
        with contextlib.suppress(StopIteration):
            cd.cbm(concepts, label_column="label", dataset=str(store), add_pairs=1)
    finally:
        api_mod.train_cbm = original
    kept.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**seen, "residual": None if seen["residual"] is None else tuple(seen["residual"])}, kept)
    return seen


class Clock:
    """Seconds per phase (the innermost open one) and per solver call."""

    def __init__(self):
        self.stack = ["other"]
        self.phases: dict[str, dict] = {}
        self.l1: list[dict] = []

    def phase(self, name, fn):
        def run(*a, **kw):
            self.stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                self.add(name, "seconds", time.perf_counter() - t0)
        return run

    def add(self, name, key, v):
        self.phases.setdefault(name, {"seconds": 0.0, "calls": 0, "iterations": 0, "solver_s": 0.0})[key] += v

    def solver(self, kind, fn):
        def run(x, y, n_classes, **kw):
            t0 = time.perf_counter()
            out = fn(x, y, n_classes, **kw)
            dt = time.perf_counter() - t0
            name = self.stack[-1]
            self.add(name, "calls", 1)
            self.add(name, "iterations", out.iterations)
            self.add(name, "solver_s", dt)
            if kind == "fista":
                self.l1.append({"phase": name, "lambda": kw.get("l1"), "rows": x.shape[0], "features": x.shape[1],
                                "iterations": out.iterations, "seconds": dt, "residual": out.residual,
                                "nonzero": float((out.weight != 0).float().mean()),
                                "concepts": int((out.weight != 0).any(0).sum())})
            return out
        return run


def main(argv=None) -> int:
    args = parse_args(argv)
    inputs = cbm_inputs(args)
    settings = fixed(args.set)
    cfg = cbm.CbmConfig(label_column="label", seed=args.seed, **settings)
    clock = Clock()
    patches = [(baseline, "fit_raw_probe", clock.phase("raw probe", baseline.fit_raw_probe)),
               (cbm, "add_needed_concepts", clock.phase("added concepts", added.add_needed_concepts)),
               (path, "refit_support", clock.phase("refits", path.refit_support)),
               (solvers, "fit_fista", clock.solver("fista", solvers.fit_fista)),
               (solvers, "fit_lbfgs", clock.solver("lbfgs", solvers.fit_lbfgs))]
    patches.append((cbm, "fit_raw_probe", patches[0][2]))
    fit_path = path.fit_path
    count = {"n": 0}

    def paths(x, y, n_classes, **kw):  # the L1 paths (a fold's or the final fit's); the refits' own are in "refits"
        if clock.stack[-1] == "refits":
            return fit_path(x, y, n_classes, **kw)
        count["n"] += 1
        return clock.phase(f"path {count['n']} ({x.shape[0]} rows)", fit_path)(x, y, n_classes, **kw)

    patches.append((path, "fit_path", paths))
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    for m, n, f in patches:
        setattr(m, n, f)
    bound_fit = bound.fit_bounded
    depth = {"n": 0}

    def bounded(*a, **kw):
        depth["n"] += 1
        try:
            return clock.phase("bound: refused, path again" if depth["n"] > 1 else "bounded fit", bound_fit)(*a, **kw)
        finally:
            depth["n"] -= 1
    bound.fit_bounded = bounded
    cbm.fit_bounded = bounded
    t0 = time.perf_counter()
    try:
        res = cbm.train_cbm(inputs["concepts"], inputs["labels"], inputs["names"], cfg, raw=inputs["raw"],
                            directions=inputs["directions"], residual=inputs["residual"])
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
        bound.fit_bounded = cbm.fit_bounded = bound_fit
    total = time.perf_counter() - t0
    m = res.metrics
    print(f"{args.corpus} {args.route} seed {args.seed} {settings}: {total:.1f} s; lambda {res.lam:g} "
          f"refit {m['refit_l2']}, CBM {100 * m['accuracy']:.2f}%, probe {100 * m['probe_accuracy']:.2f}%, "
          f"{m['concepts_used']} concepts, val {100 * m['val_accuracy']:.2f}%")
    for name, p in clock.phases.items():
        print(f"  {name}: {p['seconds']:.1f} s, {p['calls']} solver calls ({p['solver_s']:.1f} s), "
              f"{p['iterations']} iterations")
    for e in clock.l1:
        print(f"  L1 {e['phase']}: lambda {e['lambda']:g}, {e['rows']}x{e['features']}, {e['iterations']} it, "
              f"{e['seconds']:.2f} s, residual {e['residual']:.1e}, nonzero {100 * e['nonzero']:.1f}%, "
              f"{e['concepts']} concepts")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"total": total, "lambda": res.lam, "metrics": {
            k: m[k] for k in ("accuracy", "probe_accuracy", "refit_l2", "concepts_used", "val_accuracy")},
            "lambda_path": m["lambda_path"], "phases": clock.phases, "l1": clock.l1,
            "weight": res.weight.tolist()}, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
