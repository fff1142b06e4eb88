"""The demo's train + eval step (stage 2): a BatchTopK SAE on the sentence store, a TopK SAE on the token store."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conceptdict.cli.demo import DemoContext, StepResult


def _fit(ctx: DemoContext, store: str, hookpoint: str, out: Path, kind: str, latents: int, k: int,
         batch_size: int, epochs: int) -> list[str]:
    from conceptdict.activations import ActivationStore
    from conceptdict.cli.train import TrainCommand, describe, train_on_stores
    from conceptdict.saes import TrainConfig
    from conceptdict.saes.config import heldout_batch_count

    rows = ActivationStore(store).num_rows
    batch_size = min(batch_size, max(8, rows // 8))
    # 2 batches held out for evaluation and, for the thresholded kind, 1 on which the threshold is calibrated
    cfg = TrainConfig(latents=latents, k=k, kind=kind, batch_size=batch_size, eval_batches=2, calibration_batches=1,
                      tokens=1, checkpoint_every=0)
    per_epoch = max(1, rows // batch_size - heldout_batch_count(cfg))
    cfg = dataclasses.replace(cfg, tokens=per_epoch * batch_size * epochs)
    cmd = TrainCommand(stores=[Path(store)], hookpoints=[hookpoint], out=out, overwrite=True)
    _, (model,) = train_on_stores(cmd, [("", cfg)])
    return [f"{out} ({hookpoint}):", *describe(model)]


def train_step(ctx: DemoContext) -> StepResult:
    """Sentence store -> ``sae/`` (the dictionary later steps name); token store -> ``sae_tokens/``."""
    art = ctx.artifacts
    summary = _fit(ctx, art["store"], art["hookpoint"], ctx.out / "sae", "batchtopk",
                   latents=256 if ctx.fast else 1024, k=8 if ctx.fast else 16, batch_size=256,
                   epochs=5 if ctx.fast else 30)
    found = {"sae": str(ctx.out / "sae")}
    if art.get("token_store"):
        summary += _fit(ctx, art["token_store"], art["token_hookpoint"], ctx.out / "sae_tokens", "topk",
                        latents=512 if ctx.fast else 2048, k=16 if ctx.fast else 32, batch_size=1024,
                        epochs=2 if ctx.fast else 5)
        found["token_sae"] = str(ctx.out / "sae_tokens")
    return StepResult(found, summary)
