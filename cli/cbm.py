"""``conceptdict cbm DICT_DIR --dataset D --label-column Y --out CBM_DIR``: a concept bottleneck model.

``--dataset`` is resolved as: ``store`` (default) -> the activation store recorded in the concept
dictionary (its rows are the labelled inputs, ``store.labels(Y)`` their labels); otherwise a path to another
activation store cached from a labelled dataset at the same hookpoint (``conceptdict cache ... --out D``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

HELP = "train a sparse concept bottleneck model on a concept dictionary and compare it with a linear probe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming import CbmConfig

    parser.add_argument("dict_dir", type=Path, help="concept dictionary written by `conceptdict name`")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, CbmConfig)


def resolve_dataset(cd, cfg) -> Path:
    """The store directory holding the labelled inputs (see the module docstring)."""
    if cfg.dataset == "store":
        store = cd.meta.get("store")
        if not store:
            raise ConfigError("the concept dictionary records no store; pass --dataset STORE_DIR")
        return Path(store)
    path = Path(cfg.dataset)
    if not (path / "manifest.json").exists():
        raise ConfigError(f"--dataset {cfg.dataset!r} is neither 'store' nor an activation store directory; "
                          "cache the labelled dataset first with `conceptdict cache ... --out DIR`")
    return path


def format_metrics(cbm) -> str:
    m = cbm.metrics
    cov = m["coverage"]
    lines = [
        f"CBM accuracy        {100 * m['accuracy']:.1f}%  (lambda {cbm.lam:g}, {m['n_classes']} classes, "
        f"test {m['n_test']} inputs)",
    ]
    if "probe_accuracy" in m:
        lines.append(f"linear probe (raw)  {100 * m['probe_accuracy']:.1f}%")
    lines += [
        f"zero weights        {m['zero_weights']} of {m['n_weights']} ({m['concepts_used']} concepts used)",
        f"concepts per prediction for 90/95/99%: {cov['90']:.1f} / {cov['95']:.1f} / {cov['99']:.1f}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import ActivationStore
    from conceptdict.naming import CbmConfig, load_concepts, save_cbm, store_features, train_cbm, write_report
    from conceptdict.naming.images import cbm_rows
    from conceptdict.naming.pipeline import resolve_hookpoint
    from conceptdict.saes import load_dictionary

    cfg = build_config(CbmConfig, args, args.config)
    if cfg.out is None:
        raise ConfigError("conceptdict cbm needs --out CBM_DIR")
    cd = load_concepts(args.dict_dir)
    sae = cfg.sae or cd.meta.get("sae_dir")
    if not sae:
        raise ConfigError("the concept dictionary records no sae_dir; pass --sae SAE_DIR")
    store = cbm_rows(ActivationStore(resolve_dataset(cd, cfg)))  # patch stores: patch tokens, no CLS rows
    hookpoint = resolve_hookpoint(store, cd.meta.get("hookpoint"))
    model = load_dictionary(sae, device=cfg.device)
    feats = store_features(model, store, hookpoint, cfg.label_column, cfg.pooling, cfg.super_quantile,
                           device=cfg.device, codes=cfg.codes)  # fmt: skip
    cbm = train_cbm(feats.concepts, feats.labels, cd.names, cfg, raw=feats.raw)
    cbm = dataclasses.replace(cbm, meta={"dict_dir": str(args.dict_dir), "store": str(store.path),
                                         "hookpoint": hookpoint, "label_column": cfg.label_column,
                                         "pooling": cfg.pooling if store.level == "token" else "none"})  # fmt: skip
    save_cbm(cbm, cfg.out)
    write_resolved_config(cfg, cfg.out, "cbm_config.json")
    index = write_report(cd, cfg.out / "report", cbm=cbm)
    print(format_metrics(cbm))
    print(f"CBM:    {cfg.out}/cbm.json")
    print(f"report: {index.parent / 'cbm.html'}")
    return 0
