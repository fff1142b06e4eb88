"""The demo's name step (stage 3): vocabulary names for the sentence SAE, context names for the token SAE."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conceptdict.cli.demo import DemoContext, StepResult


def _name(sae: str, store: str, hookpoint: str, out: Path, **cfg) -> tuple[object, list[str]]:
    from conceptdict.cli.args import write_resolved_config
    from conceptdict.cli.name import format_concepts
    from conceptdict.naming import NameConfig, name_dictionary, open_sources, save_concepts

    src = open_sources(sae, store, hookpoint)
    config = NameConfig(out=out, store=Path(store), hookpoint=hookpoint, **cfg)
    cd = name_dictionary(src.model, src.store, config)
    cd = dataclasses.replace(cd, meta={**cd.meta, "sae_dir": str(sae)})
    save_concepts(cd, out)
    write_resolved_config(config, out, "name_config.json")
    firing = sum(1 for c in cd.concepts if c.frequency > 0)
    head = f"{out}: {len(cd.concepts)} latents named by the {cd.meta['namer']} namer ({firing} fire)"
    return cd, [head, format_concepts(cd, n=8)]


def name_step(ctx: DemoContext) -> StepResult:
    """``sae/`` -> ``concepts/`` (Discover-then-Name vocabulary); ``sae_tokens/`` -> ``concepts_tokens/``."""
    art = ctx.artifacts
    vocab = "wordfreq:en:2000" if ctx.fast else "wordfreq:en:20000"
    _, summary = _name(art["sae"], art["store"], art["hookpoint"], ctx.out / "concepts", namer="vocab", vocab=vocab)
    found = {"concepts": str(ctx.out / "concepts")}
    if art.get("token_sae"):
        _, more = _name(art["token_sae"], art["token_store"], art["token_hookpoint"], ctx.out / "concepts_tokens",
                        namer="context", top_k=10)  # fmt: skip
        summary += more
        found["token_concepts"] = str(ctx.out / "concepts_tokens")
    return StepResult(found, summary)
