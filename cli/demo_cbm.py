"""The demo's CBM step (stage 3): a sparse concept bottleneck model on the named sentence concepts,
predicting each docstring's module family, beside a linear probe on the raw embeddings."""

from __future__ import annotations

from conceptdict.cli.demo import DemoContext, StepResult


def cbm_step(ctx: DemoContext) -> StepResult:
    """``concepts/`` + the sentence store's ``family`` labels -> ``cbm/``."""
    import dataclasses

    from conceptdict.activations import ActivationStore
    from conceptdict.cli.args import write_resolved_config
    from conceptdict.cli.cbm import format_metrics
    from conceptdict.naming import CbmConfig, load_concepts, save_cbm, store_features, train_cbm
    from conceptdict.saes import load_dictionary

    art = ctx.artifacts
    out = ctx.out / "cbm"
    cd = load_concepts(art["concepts"])
    store = ActivationStore(art["store"])
    cfg = CbmConfig(label_column=art.get("label_key", "family"), out=out)
    feats = store_features(load_dictionary(art["sae"]), store, art["hookpoint"], cfg.label_column, codes=cfg.codes)
    cbm = train_cbm(feats.concepts, feats.labels, cd.names, cfg, raw=feats.raw)
    cbm = dataclasses.replace(cbm, meta={"dict_dir": art["concepts"], "store": art["store"],
                                         "hookpoint": art["hookpoint"], "label_column": cfg.label_column})
    save_cbm(cbm, out)
    write_resolved_config(cfg, out, "cbm_config.json")
    m = cbm.metrics
    return StepResult(
        {"cbm": str(out), "cbm_accuracy": m["accuracy"], "probe_accuracy": m["probe_accuracy"]},
        [f"{out}: predicts the module family of a docstring from its named concepts", format_metrics(cbm)],
    )
