"""``conceptdict steer DICT_DIR --latent ID_OR_NAME --prompt TEXT --out DIR``: add, clamp or ablate latents at the
dictionary's hookpoint and report what changes (``naming.steer``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from conceptdict.cli.args import ConfigError, add_dataclass_args, build_config, write_resolved_config

HELP = "steer a model through dictionary latents (add, clamp, ablate): continuations, log-probs, similarities"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conceptdict.naming.steer import SteerConfig

    parser.add_argument("dict_dir", type=Path, help="dictionary, or concept dictionary (to steer latents by name)")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    add_dataclass_args(parser, SteerConfig)


def open_steerable(path: Path):
    """(sae directory, latent names or None) for a dictionary or concept dictionary directory."""
    from conceptdict.naming import is_concept_dir, load_concepts

    if not is_concept_dir(path):
        return path, None
    cd = load_concepts(path)
    if not cd.meta.get("sae_dir"):
        raise ConfigError(f"concept dictionary {path} records no sae_dir; pass the dictionary directory instead")
    return Path(cd.meta["sae_dir"]), list(cd.names)


def model_of(cfg, config: dict) -> str:
    if cfg.model:
        return cfg.model
    info = config.get("model") or {}
    source = info.get("source") if isinstance(info, dict) else None
    name = source if source and Path(source).is_dir() else (info.get("id") if isinstance(info, dict) else info)
    if not name:
        raise ConfigError("the dictionary records no model; pass --model NAME_OR_DIR")
    return name


def run(args: argparse.Namespace) -> int:
    from conceptdict.activations import SENTENCE_HOOKPOINTS, load_model
    from conceptdict.naming import load_cbm
    from conceptdict.naming.steer import (
        SteerConfig,
        latent_edit,
        resolve_latents,
        steer_lm,
        steer_sentences,
        write_steer,
    )
    from conceptdict.saes import load_dictionary, load_dictionary_config

    cfg = build_config(SteerConfig, args, args.config)
    if cfg.out is None:
        raise ConfigError("conceptdict steer needs --out DIR")
    sae_dir, names = open_steerable(args.dict_dir)
    config = load_dictionary_config(sae_dir)
    hookpoints = config.get("hookpoints") or [config.get("hookpoint")]
    if not hookpoints or not hookpoints[0]:
        raise ConfigError(f"dictionary {sae_dir} records no hookpoint; steering needs one")
    hookpoint = hookpoints[0]
    dictionary = load_dictionary(sae_dir, device=cfg.device)
    latents = resolve_latents(cfg.latents, names, dictionary.n_latents)
    model = load_model(model_of(cfg, config), device=cfg.device)
    if hookpoint not in model.hookpoints:
        raise ConfigError(f"dictionary {sae_dir} was trained at hookpoint {hookpoint!r}, which model {model.name} "
                          "does not have; pass the model it was trained on with --model")
    if model.d_model(hookpoint) != dictionary.d_in:
        raise ConfigError(f"dictionary d_in={dictionary.d_in} but {model.name} has D={model.d_model(hookpoint)} at "
                          f"{hookpoint}; pass the model the dictionary was trained on")
    edit = latent_edit(dictionary, latents, cfg.mode, cfg.alpha)
    if model.is_causal and hookpoint not in SENTENCE_HOOKPOINTS:
        doc = steer_lm(model, hookpoint, edit, cfg)
    else:
        texts = cfg.texts or [names[j] for j in latents if names and names[j]]
        if not texts:
            raise ConfigError("no texts to compare with: pass --text TEXT, or steer named latents")
        vector = (cfg.alpha * dictionary.decoder_directions()[latents].float().sum(0).cpu()
                  if cfg.mode == "add" else None)
        doc = steer_sentences(model, hookpoint, edit, vector, texts, cfg, dictionary,
                              load_cbm(cfg.cbm) if cfg.cbm else None)
    norms = dictionary.decoder_directions()[latents].float().norm(dim=-1).tolist()
    doc.update(latents=[{"id": j, "name": names[j] if names else "", "decoder_norm": n}
                        for j, n in zip(latents, norms)], mode=cfg.mode,
               alpha=cfg.alpha, hookpoint=hookpoint, model=model.name, dictionary=str(sae_dir))
    path = write_steer(doc, cfg.out)
    write_resolved_config(cfg, cfg.out, "steer_config.json")
    if doc["kind"] == "causal-lm":
        for p in doc["prompts"]:
            print(f"{p['prompt']!r}\n  greedy:  {p['greedy_before']!r}\n  steered: {p['greedy_after']!r}")
        for tok, shift in doc["mean_token_shift"].items():
            print(f"log-prob shift of {tok!r}: {shift:+.4f}")
    else:
        print(f"mean cosine shift to the texts: {doc['mean_cos_shift']:+.4f}")
        if doc.get("ratio") is not None:
            print(f"random directions of the same norm: {doc['random_abs_cos_shift']:.4f} (mean |shift|); "
                  f"ratio {doc['ratio']:.2f}")
    print(f"steering: {path}")
    print(f"report:   {cfg.out / 'steer.html'}")
    return 0
