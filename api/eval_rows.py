"""Where ``conceptdict eval`` reads a dictionary's rows from: the batches its training held out (store runs:
:func:`training_heldout`), and for a dictionary trained from a model's forward (``train --model``, no store) the
model's activations over a dataset again (:class:`activations.live.LiveSource`).

A model's forward: over the dataset it trained on, the batches its training held out (rebuilt from the run's record:
the batch size, seed and held-out count in config.json, the shuffle buffer in train_config.json), rows it never
trained on; over another dataset, that dataset's first rows. The CE/KL contexts are the dataset's first ones, as a
store's are its first rows' (training read other rows of them)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from conceptdict.activations.data import describe_dataset
from conceptdict.activations.live import LiveConfig, LiveSource, level_of, open_model
from conceptdict.saes import SparseCoder, config_file, load_dictionary_config

log = logging.getLogger(__name__)


def open_live(sae_dir, config: dict, model: SparseCoder, cfg: Any) -> tuple[SparseCoder, LiveSource, list[str]]:
    """(dictionary, live source, hookpoints) for ``cfg.model`` over ``cfg.dataset``, each defaulting to what the
    dictionary's training recorded (config.json's ``live``), read as that training read them."""
    recorded = config.get("live") or {}
    name, dataset = cfg.model or recorded.get("model"), cfg.dataset or recorded.get("dataset")
    if not name or not dataset:
        raise ValueError(f"{config_file(sae_dir)} records no store; pass --store STORE_DIR (the store of the "
                         "activations the dictionary reads), or --model M --dataset D to read the model's "
                         "activations over a dataset")
    if recorded.get("model") and name != recorded["model"]:
        log.warning("%s was trained on model %s; evaluating it on model %s", sae_dir, recorded["model"], name)
    known = {f.name for f in dataclasses.fields(LiveConfig)}
    live = LiveConfig(**{**{k: v for k, v in recorded.items() if k in known}, "model": name, "dataset": dataset})
    hookpoints = [cfg.hookpoint] if cfg.hookpoint else list(config.get("hookpoints") or [])
    if not hookpoints:
        raise ValueError(f"{config_file(sae_dir)} records no hookpoint; pass --hookpoint")
    if cfg.hookpoint and len(config.get("hookpoints") or []) > 1:
        raise ValueError(f"--hookpoint {cfg.hookpoint}: {sae_dir} reads the hookpoints {config['hookpoints']}; "
                         f"drop --hookpoint")
    handle = open_model(live, hookpoints, cfg.device)
    if handle.d_model(hookpoints[0]) != model.d_in:
        raise ValueError(f"{sae_dir} has d_in={model.d_in} but model {name} has d={handle.d_model(hookpoints[0])} "
                         f"at {hookpoints[0]}; pass the model it was trained on")
    return model, LiveSource(live, handle, level_of(hookpoints)), hookpoints


def live_rows(sae_dir, source: LiveSource, hookpoints: list[str], rows: int, batch_size: int, rows_from: str,
              config: dict):
    """(batches, where they come from): training's held-out batches when ``rows_from`` is heldout, the dataset is
    the one it trained on and the run recorded them; else the dataset's first ``rows`` rows (with a warning when
    training read that dataset)."""
    dataset, trained_on = source.live.dataset, (config.get("dataset") or {}).get("spec")
    same = trained_on == describe_dataset(dataset).get("spec")
    recipe = run_heldout(sae_dir, config) if same and rows_from == "heldout" else None
    if recipe is not None:
        return source.batches(hookpoints, recipe, rows), "training's held-out batches"
    if same and rows_from == "heldout":
        log.warning("%s records no held-out batches: evaluating on the first %d rows of %s, which training read",
                    sae_dir, rows, dataset)
    size = min(batch_size, rows)
    batches = list(source.batches(hookpoints, {"batch_size": size, "seed": 0, "batches": max(1, rows // size),
                                               "buffer_rows": rows}, rows))
    if not batches:
        raise ValueError(f"model {source.live.model} over {dataset} gives fewer than {size} rows; lower --batch-size")
    why = "" if same else " (a dataset it did not train on)" if trained_on else " (its training data is not recorded)"
    return batches, f"the first rows of {dataset}{why}"


def run_heldout(sae_dir, config: dict) -> dict | None:
    """The held-out batches of a ``train --model`` run: batch size, seed and count from config.json's training
    config, the shuffle buffer from train_config.json; None when not recorded."""
    train = (config.get("training") or {}).get("config") or {}
    path = Path(sae_dir) / "train_config.json"
    buffer = (json.loads(path.read_text()).get("command") or {}).get("buffer_rows") if path.exists() else None
    if not train.get("eval_batches") or not train.get("batch_size") or buffer is None:
        return None
    return {"batch_size": train["batch_size"], "seed": train.get("seed", 0), "batches": train["eval_batches"],
            "buffer_rows": buffer}


def training_heldout(sae_dir: str | Path, hookpoints: list[str]) -> dict | None:
    """The held-out batches a dictionary's training recorded (``activations.heldout_recipe``) when it was trained
    at ``hookpoints``: from its config.json, or for runs made before it was recorded there, from
    train_config.json."""
    if str(sae_dir).startswith("hf:"):
        return None
    config = load_dictionary_config(sae_dir)
    recipe = config.get("heldout")
    path = Path(sae_dir) / "train_config.json"
    if recipe is None and path.exists():
        run = json.loads(path.read_text())
        train, cmd = run.get("train") or {}, run.get("command") or {}
        if train.get("eval_batches") and "batch_size" in train:
            recipe = {"stores": [str(Path(s).resolve()) for s in config.get("stores") or []],
                      "hookpoints": config.get("hookpoints"), "batch_size": train["batch_size"],
                      "seed": train.get("seed", 0), "batches": train["eval_batches"],
                      "buffer_rows": cmd.get("buffer_rows", 65536)}
    return recipe if recipe and list(recipe.get("hookpoints") or []) == list(hookpoints) else None
