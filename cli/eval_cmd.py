"""``conceptdict eval SAE_DIR [--store STORE] [--model M]``: metrics table + eval.json.

Reconstruction and sparsity metrics come from ``saes.evaluate`` (saes/evaluation.py) over store rows: by default, on the store the
dictionary was trained on, the batches ``conceptdict train`` held out (rebuilt from SAE_DIR/train_config.json:
rows training never saw), else the first rows of the store. For a token-level store of
a causal language model, the dictionary is also spliced into the model at its hookpoint
(``activations.spliced_losses``) and CE loss recovered / KL score are computed (``saes.with_splice_scores``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from conceptdict.cli.args import build_config, to_jsonable
from conceptdict.cli.train import threshold_line

HELP = "evaluate a dictionary on a store: L0, FVU, explained variance, dead/dense latents, CE loss recovered"
log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    """Flags of ``conceptdict eval``."""

    store: Path | None = None
    """Store to evaluate on (repeat for a crosscoder); default: the store(s) recorded in SAE_DIR/config.json."""
    hookpoint: str | None = None
    """Hookpoint; default: the one the dictionary was trained on."""
    model: str | None = None
    """Language model for CE loss recovered / KL score; default: the store's model when it is a causal LM."""
    rows: int = 65536
    """Evaluate on at most this many store rows."""
    rows_from: str = "heldout"
    """``heldout``: training's held-out batches when SAE_DIR records them for this store and hookpoint (else
    the first rows, with a warning); ``start``: the first rows of the store (training may have seen them)."""
    batch_size: int = 4096
    """Rows per evaluation batch."""
    contexts: int = 32
    """Contexts (rebuilt from the store's tokens) for the spliced CE/KL evaluation; 0 skips it."""
    device: str = "cpu"
    """Device for the dictionary and the model."""
    out: Path | None = None
    """Where to write eval.json; default: SAE_DIR/eval.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sae_dir", type=Path, help="dictionary: a directory in any format saes.formats reads "
                        "(conceptdict, SAELens, sparsify, dictionary_learning, Gemma Scope) or hf:REPO[/SUBDIR][@REV]")
    parser.add_argument("--config", type=Path, default=None, help="JSON config file (flags override it)")
    from conceptdict.cli.args import add_dataclass_args

    add_dataclass_args(parser, EvalConfig)


def open_on_store(sae_dir: Path, cfg: EvalConfig):
    """(model, store, hookpoints) with the widths checked: the store is ``cfg.store`` or the recorded one; the
    hookpoints are ``cfg.hookpoint`` or the recorded one ([input, output] for a transcoder)."""
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import load_dictionary, load_dictionary_config, match_hookpoint

    config = load_dictionary_config(sae_dir)
    model = load_dictionary(sae_dir, device=cfg.device)
    if model.n_sources != 1:
        raise ValueError(f"{sae_dir} is a crosscoder over {model.n_sources} sources; `conceptdict eval` evaluates "
                         f"single-source dictionaries (use `conceptdict diff` for crosscoders)")
    store_path = cfg.store or (config.get("stores") or [None])[0]
    if store_path is None:
        raise ValueError(f"{sae_dir}/config.json records no store; pass --store STORE_DIR")
    store = ActivationStore(store_path)
    if model.spec.transcodes:
        return model, store, _transcoder_hookpoints(sae_dir, config, store, cfg)
    if config.get("transcoder"):
        raise ValueError(f"{sae_dir} is a transcoder whose input hookpoint is not recorded: its decoder predicts "
                         f"another hookpoint's output, so reconstruction metrics against its input would be wrong; "
                         f"name it or use it in a cbm")
    hookpoint = cfg.hookpoint or (config.get("hookpoints") or [None])[0]
    hookpoint = match_hookpoint(hookpoint, store.hookpoints) or hookpoint if hookpoint else None
    if hookpoint is None or hookpoint not in store.hookpoints:
        raise ValueError(f"hookpoint {hookpoint!r} is not in store {store_path} (it holds {store.hookpoints}); "
                         f"pass --hookpoint")
    if store.d_in(hookpoint) != model.d_in:
        raise ValueError(f"SAE d_in={model.d_in} but the store at {store_path} has d={store.d_in(hookpoint)} for "
                         f"hookpoint {hookpoint}; pass the store the dictionary was trained on")
    return model, store, [hookpoint]


def _transcoder_hookpoints(sae_dir: Path, config: dict, store, cfg: EvalConfig) -> list[str]:
    """[input, output] hookpoints of a transcoder, both in the store (``--hookpoint`` names the output)."""
    pair = list(config.get("hookpoints") or [])
    if len(pair) != 2:
        raise ValueError(f"{sae_dir}/config.json records hookpoints {pair}; a transcoder needs [input, output]")
    if cfg.hookpoint and cfg.hookpoint != pair[1]:
        raise ValueError(f"--hookpoint {cfg.hookpoint}: {sae_dir} is a transcoder from {pair[0]} to {pair[1]}; "
                         f"drop --hookpoint")
    missing = [h for h in pair if h not in store.hookpoints]
    if missing:
        raise ValueError(f"a transcoder evaluates on both its hookpoints {pair}; store {store.path} lacks {missing} "
                         f"(it holds {store.hookpoints}): cache both in one store")
    return pair


def heldout_recipe(sae_dir: Path, store, hookpoints: list[str]) -> dict | None:
    """How ``conceptdict train`` drew the batches it held out for its own evaluation (never trained on: the
    stream leaves their rows out of later epochs): its train_config.json settings, or None when SAE_DIR was
    not trained by ``conceptdict train`` on this store and hookpoints."""
    from conceptdict.saes import load_dictionary_config

    path = sae_dir / "train_config.json"
    if not path.exists():
        return None
    recorded = load_dictionary_config(sae_dir)
    run = json.loads(path.read_text())
    same = ([str(Path(s).resolve()) for s in recorded.get("stores") or []] == [str(store.path.resolve())]
            and recorded.get("hookpoints") == hookpoints)
    return run if same and run.get("train", {}).get("eval_batches") else None


def recipe_batches(recipe: dict, store, hookpoints: list[str], rows: int):
    """The held-out batches of ``recipe`` (:func:`heldout_recipe`) at ``hookpoints``, rebuilt without reading
    anything else (the rows depend only on the recipe, not on the hookpoints read)."""
    from conceptdict.activations import stream_batches

    cmd, train = recipe.get("command", {}), recipe["train"]
    n = min(int(train["eval_batches"]), max(1, rows // int(train["batch_size"])))
    stream = stream_batches(store, hookpoints, int(train["batch_size"]), seed=int(train["seed"]), epochs=1,
                            buffer_rows=int(cmd.get("buffer_rows", 65536)))
    return itertools.islice(stream, n)


def store_batches(store, hookpoints: list[str], rows: int, batch_size: int):
    """The first rows: [B, D] for one hookpoint, [B, 2, D] (input, output) for a transcoder's two."""
    stop = min(rows, store.num_rows)
    for start in range(0, stop, batch_size):
        parts = [store.rows(h, start, min(start + batch_size, stop)).float() for h in hookpoints]
        yield parts[0] if len(parts) == 1 else torch.stack(parts, dim=1)


def splice_scores(result, sae, store, hookpoints: list[str], cfg: EvalConfig):
    """result with CE loss recovered / KL score, when a causal LM is at hand: the last hookpoint is replaced by
    the dictionary's output on the first (the same one for an SAE; a transcoder's input, then output)."""
    from conceptdict.activations import load_model, spliced_losses
    from conceptdict.activations.tokens import causal_lm_source, rebuild_contexts
    from conceptdict.saes import with_splice_scores

    name = cfg.model or causal_lm_source(store)
    if name is None or cfg.contexts == 0 or store.level != "token":
        return result
    lm = load_model(name, device=cfg.device)
    bos, pad = lm.bos_pad_ids()  # from the config when the model was saved without a tokenizer
    ids, mask = rebuild_contexts(store, cfg.contexts, bos, pad)

    def replace(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return sae(x.to(sae.W_enc.device)).to(x.device)

    losses = spliced_losses(lm, hookpoints[-1], ids, replace, attention_mask=mask,
                            source=hookpoints[0] if len(hookpoints) > 1 else None)
    return with_splice_scores(result, losses.ce_clean, losses.ce_zero, losses.ce_replaced, losses.kl_zero,
                              losses.kl_replaced)


def run(args: argparse.Namespace) -> int:
    from conceptdict.saes import evaluate, format_table

    cfg = build_config(EvalConfig, args, args.config)
    if cfg.rows_from not in ("heldout", "start"):
        raise ValueError(f"--rows-from {cfg.rows_from!r}: choose heldout or start")
    sae, store, hookpoints = open_on_store(args.sae_dir, cfg)
    hookpoint = " -> ".join(hookpoints)
    recipe = heldout_recipe(args.sae_dir, store, hookpoints) if cfg.rows_from == "heldout" else None
    batches = recipe_batches(recipe, store, hookpoints, cfg.rows) if recipe else None
    rows_from = "training's held-out batches"
    if batches is None:
        if cfg.rows_from == "heldout":
            log.warning("%s records no held-out batches for %s [%s]: evaluating on the first %d rows of the store, "
                        "which training may have seen", args.sae_dir, store.path, hookpoint, cfg.rows)
        batches, rows_from = store_batches(store, hookpoints, cfg.rows, cfg.batch_size), "the first rows of the store"
    result = evaluate(sae, batches)
    result = splice_scores(result, sae, store, hookpoints, cfg)
    if cfg.out is None and str(args.sae_dir).startswith("hf:"):
        raise ValueError(f"{args.sae_dir} is a hub name; pass --out FILE for eval.json (it is not written into "
                         f"the cache)")
    out = cfg.out or args.sae_dir / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"sae_dir": str(args.sae_dir), "store": str(store.path), "hookpoint": hookpoint, "hookpoints": hookpoints,
              "rows_from": rows_from,
              "config": to_jsonable(cfg), "metrics": result.to_dict(with_density=True),
              "threshold": (getattr(sae, "training_summary", None) or {}).get("threshold")}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{sae.kind} dictionary {args.sae_dir} on {store.path} [{hookpoint}], {result.n_tokens} rows "
          f"({rows_from}):")
    print(format_table(result))
    line = threshold_line(getattr(sae, "training_summary", None) or {}, sae.k)
    if line:
        print(line)
    print(f"eval: {out}")
    return 0
