"""``conceptdict erase --store STORE --concept-column C [--target-column Y] --out DIR``: every erasure and
switching method (SAE ablation, LEACE, SPLINCE, LEACE-Switch, MidSteer) on one split, one table
(``naming.erase``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

HELP = "erase or switch a labelled concept with SAE ablation, LEACE, SPLINCE, LEACE-Switch and MidSteer; one table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming.erase import EraseConfig

    parser.add_argument("--store", type=Path, required=True, help="activation store with the label columns")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    parser.add_argument("--apply", type=Path, default=None, metavar="ERASER_DIR",
                        help="instead of the table: write --out as a new store, STORE with an eraser written by an "
                             "earlier run (OUT/erasers/METHOD) applied to its hookpoint")
    add_dataclass_args(parser, EraseConfig)


def open_dictionary_for(path: Path, hookpoint: str, device: str):
    """(dictionary, latent names or None); refuses a dictionary trained at another hookpoint."""
    from conceptdict.naming import is_concept_dir, load_concepts
    from conceptdict.saes import load_dictionary, load_dictionary_config, match_hookpoint

    names = None
    if is_concept_dir(path):
        cd = load_concepts(path)
        names = list(cd.names)
        if not cd.meta.get("sae_dir"):
            raise ConfigError(f"concept dictionary {path} records no sae_dir; pass the dictionary directory instead")
        path = Path(cd.meta["sae_dir"])
    config = load_dictionary_config(path)
    recorded = config.get("hookpoints") or [config.get("hookpoint")]
    recorded = [h for h in recorded if h]
    if recorded and not any(match_hookpoint(h, [hookpoint]) for h in recorded):
        raise ConfigError(f"dictionary {path} was trained at hookpoint {recorded[0]!r} but the store's is "
                          f"{hookpoint!r}; pass a dictionary of that hookpoint or the store it was trained on")
    model = load_dictionary(path, device=device)
    if model.n_sources != 1:
        raise ConfigError(f"dictionary {path} is a crosscoder ({model.n_sources} sources); SAE ablation needs an SAE")
    return model, names


def apply_eraser(eraser_dir: Path, store, hookpoint: str, out: Path) -> int:
    from conceptdict.activations.transform import map_store
    from conceptdict.saes.erasure import load_eraser

    eraser = load_eraser(eraser_dir)
    fitted_at = eraser.meta.get("hookpoint")
    if fitted_at and fitted_at != hookpoint:
        raise ConfigError(f"eraser {eraser_dir} was fitted at hookpoint {fitted_at!r} but the store's is "
                          f"{hookpoint!r}; pass --hookpoint or an eraser fitted on this hookpoint")
    if eraser.mean.shape[0] != store.d_in(hookpoint):
        raise ConfigError(f"eraser {eraser_dir} has D={eraser.mean.shape[0]} but {store.path} has "
                          f"D={store.d_in(hookpoint)} at {hookpoint}; pass the store it was fitted on")
    path = map_store(store.path, out, hookpoint, eraser, note={"eraser": str(eraser_dir), "method": eraser.method})
    print(f"{eraser.method} applied to {store.num_rows} rows of {store.path} [{hookpoint}]")
    print(f"store: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import ActivationStore, load_model
    from conceptdict.activations.tokens import causal_lm_source
    from conceptdict.naming.erase import EraseConfig, ce_change_function, erase_table, format_table, load_labelled
    from conceptdict.naming.erase import write_erase
    from conceptdict.naming.pipeline import resolve_hookpoint

    cfg = build_config(EraseConfig, args, args.config)
    if cfg.out is None:
        raise ConfigError("conceptdict erase needs --out DIR")
    store = ActivationStore(args.store)
    hookpoint = resolve_hookpoint(store, cfg.hookpoint)
    if args.apply is not None:
        return apply_eraser(args.apply, store, hookpoint, cfg.out)
    dictionary, names = (open_dictionary_for(cfg.dictionary, hookpoint, cfg.device) if cfg.dictionary
                         else (None, None))
    data = load_labelled(store, hookpoint, cfg)
    ce = None
    name = cfg.model or causal_lm_source(store)
    if name and cfg.contexts and store.level == "token":
        ce = ce_change_function(load_model(name, device=cfg.device), store, hookpoint, cfg.contexts)
    doc, erasers = erase_table(data, cfg, dictionary, names, ce)
    meta = {"store": str(store.path), "hookpoint": hookpoint, "concept_column": cfg.concept_column,
            "target_column": cfg.target_column, "dictionary": str(cfg.dictionary) if cfg.dictionary else None}
    path = write_erase(doc, erasers, cfg.out, meta)
    write_resolved_config(cfg, cfg.out, "erase_config.json")
    print(format_table(doc))
    print(f"table:   {path}")
    print(f"report:  {cfg.out / 'erase.html'}")
    print(f"erasers: {cfg.out / 'erasers'}")
    return 0
