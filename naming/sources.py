"""Where a dictionary's rows come from, for every command that reads them (``eval``, ``compare``, ``name``,
``score``, ``cbm``, ``cbsae``, ``export``): the dictionary and its recorded config, the store(s) (or the model it was
trained from), its hookpoints, and the batches its training held out.

One function, :func:`open_run`, resolves them from what the dictionary's config.json records and what the user
passed instead (``store=``, ``store_b=``, ``hookpoint=``, ``model=`` + ``dataset=``), with the widths checked:

- a store recorded as a relative path is read relative to the dictionary's folder when it is not found from the
  working directory (a dictionary and its store moved together);
- a crosscoder reads every (store, hookpoint) pair, stores outermost; a transcoder its [input, output]
  hookpoints; a cross-layer transcoder its S MLP inputs then their S outputs;
- a dictionary trained from a model's forward (``train --model``, no store) runs that model again over its dataset
  (:class:`activations.live.LiveSource`).

Held-out rows: over the store or dataset it trained on, the batches training held out (config.json's ``heldout``,
or for older runs train_config.json's record), rows it never trained on; otherwise the first rows."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple, Union

from conceptdict.activations import ActivationStore, first_batches, heldout_batches
from conceptdict.activations.data import describe_dataset
from conceptdict.activations.live import LiveConfig, LiveSource, level_of, open_model
from conceptdict.activations.provenance import check_replacement
from conceptdict.activations.views import pair_hookpoints
from .pipeline import resolve_hookpoint
from conceptdict.saes import SparseCoder, config_file, kind_spec
from conceptdict.saes import open_dictionary

log = logging.getLogger(__name__)

Source = Union[ActivationStore, list[ActivationStore], LiveSource]
"""What a dictionary reads: a store, a crosscoder's stores (one per model), or a model's forward."""


class Run(NamedTuple):
    """A dictionary with what it reads."""

    dictionary: Any
    """The dictionary (a SparseCoder; a CB-SAE's for a cbsae folder)."""
    config: dict
    """Its config.json (``{}`` for a dictionary made in memory)."""
    source: Source
    hookpoints: list[str]
    """The hookpoints it reads: one; a transcoder's [input, output]; a cross-layer transcoder's S inputs then S
    outputs; a crosscoder's hookpoints (one per source within a store)."""
    home: Path | str | None
    """Its folder (or hub name); None for a dictionary made in memory."""

    @property
    def store(self) -> ActivationStore:
        """The store it reads (a crosscoder: model A's); ValueError for a model's forward."""
        if isinstance(self.source, LiveSource):
            raise ValueError(f"{self.where} was trained from a model's forward and records no store; pass --store "
                              f"STORE_DIR (the store of the activations the dictionary reads)")
        return self.source[0] if isinstance(self.source, list) else self.source

    @property
    def where(self) -> str:
        """The dictionary, as messages name it."""
        return str(self.home) if self.home is not None else "this dictionary (made in memory)"

    def store_paths(self) -> list[Path]:
        """The folders of the store(s) it reads."""
        return [s.path for s in self.source] if isinstance(self.source, list) else [self.store.path]


def open_dictionary_at(dictionary: Any, device: str = "cpu", lazy: bool | None = False
                       ) -> tuple[Any, dict, Path | str | None]:
    """(dictionary, config, home) of a folder, hub name or SparseCoder; a CB-SAE's folder gives its CB-SAE.
    ``lazy``: as ``saes.open_dictionary``'s (None: read a block of latents at a time where it does not fit in memory)."""
    from conceptdict.naming.bottleneck.cbsae import is_cbsae_dir, load_cbsae

    if isinstance(dictionary, SparseCoder):
        return dictionary.to(device), dict(getattr(dictionary, "config", None) or {}), getattr(dictionary, "path", None)
    home = dictionary if str(dictionary).startswith("hf:") else Path(dictionary)
    if not str(home).startswith("hf:") and is_cbsae_dir(home):
        return load_cbsae(home, device), json.loads((Path(home) / "config.json").read_text()), home
    model, config = open_dictionary(home, device=device, lazy=lazy)
    return model, config, home


def recorded_store(home: Path | str | None, path: str | Path) -> Path:
    """A recorded store path; a relative one not found from here is read relative to the dictionary's folder."""
    path = Path(path)
    if home is not None and not path.is_absolute() and not path.exists() and (Path(str(home)) / path).exists():
        return Path(str(home)) / path
    return path


def open_run(dictionary: Any, *, store: str | Path | None = None, store_b: str | Path | None = None,
             hookpoint: str | None = None, model: str | None = None, dataset: str | None = None,
             device: str = "cpu", reads: bool = False, lazy: bool | None = False) -> Run:
    """The dictionary (folder, hub name or SparseCoder) with the store(s) and hookpoints it reads (module
    docstring): ``store`` / ``store_b`` / ``hookpoint`` replace the recorded ones; a dictionary trained from a model
    reads ``model`` over ``dataset`` (default: the recorded ones) when no store is given. ``reads``: ``hookpoint``
    may be any hookpoint the dictionary records (a concept dictionary records a transcoder's input), which then
    changes nothing. ``lazy``: as :func:`open_dictionary_at`'s."""
    sae, config, home = open_dictionary_at(dictionary, device, lazy)
    if reads and hookpoint in (config.get("hookpoints") or []):
        hookpoint = None
    where = str(home) if home is not None else "this dictionary (made in memory)"
    if store is None and not (config.get("stores") or config.get("store")) and (config.get("live") or dataset):
        return _live(sae, config, home, hookpoint, model, dataset, device)
    if dataset is not None:
        raise ValueError(f"--dataset {dataset}: {where} reads a store; drop --dataset")
    spec = getattr(sae, "spec", None)  # None: a CB-SAE, which reads one source
    transcodes = spec is not None and spec.transcodes
    if getattr(sae, "n_sources", 1) != 1 and not transcodes:
        stores, hookpoints = _crosscoder(sae, config, home, store, store_b, hookpoint)
        return Run(sae, config, stores, hookpoints, home)
    if store_b is not None:
        raise ValueError(f"--store-b {store_b}: {where} reads one source; drop --store-b")
    recorded = _first(config, "stores", "store")
    if home is not None:
        check_replacement(home, recorded_store(home, recorded) if recorded else None, store)
    path = store or (recorded_store(home, recorded) if recorded else None)
    if path is None:
        raise ValueError(f"{config_file(home) if home is not None else where} records no store; pass --store "
                          f"STORE_DIR (the store of the activations the dictionary reads)")
    opened = ActivationStore(path)
    if transcodes:
        return Run(sae, config, opened, _transcoder_hookpoints(where, config, opened, hookpoint), home)
    hp = resolve_hookpoint(opened, hookpoint or _first(config, "hookpoints", "hookpoint"))
    if opened.d_in(hp) != sae.d_in:
        raise ValueError(f"SAE d_in={sae.d_in} but the store at {path} has d={opened.d_in(hp)} for hookpoint {hp}; "
                          f"pass the store the dictionary was trained on")
    return Run(sae, config, opened, [hp], home)


def _first(config: dict, plural: str, singular: str) -> Any:
    value = config.get(plural) or config.get(singular)
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _crosscoder(sae: SparseCoder, config: dict, home, store, store_b, hookpoint) -> tuple[list, list[str]]:
    """(stores, hookpoints) of a crosscoder, its sources being every (store, hookpoint) pair, stores outermost: the
    recorded stores with ``store`` replacing the first and ``store_b`` the second, the recorded hookpoints (or
    ``hookpoint`` for one), store B read under its own hookpoint name as ``conceptdict diff`` recorded it."""
    where = str(home) if home is not None else "this crosscoder"
    paths = [recorded_store(home, p) for p in config.get("stores") or []]
    for i, (flag, given) in enumerate((("--store", store), ("--store-b", store_b))):
        if home is not None:
            check_replacement(home, paths[i] if i < len(paths) else None, given, flag)
    if store is not None:
        paths[:1] = [Path(store)]
    if store_b is not None:
        if len(paths) != 2:
            raise ValueError(f"--store-b {store_b}: {where} reads {len(paths)} store(s), not two; drop --store-b")
        paths[1] = Path(store_b)
    if not paths:
        raise ValueError(f"{config_file(home) if home is not None else where} records no store; pass --store "
                          f"STORE_DIR (and --store-b for model B's)")
    hookpoints = list(config.get("hookpoints") or [])
    if hookpoint is not None:
        if len(hookpoints) > 1:
            raise ValueError(f"--hookpoint {hookpoint}: {where} is a crosscoder over the hookpoints {hookpoints}; "
                              f"drop --hookpoint")
        hookpoints = [hookpoint]
    stores = [ActivationStore(p) for p in paths]
    if len(stores) == 2 and len(hookpoints) <= 1:
        hookpoint_b = None if hookpoint else (config.get("store_hookpoints") or [None, None])[1]
        stores, hp, _ = pair_hookpoints(stores, hookpoints[0] if hookpoints else None, hookpoint_b)
        hookpoints = [hp]
    if len(stores) * len(hookpoints) != sae.n_sources:
        raise ValueError(f"{where} is a crosscoder over {sae.n_sources} sources but stores {[str(p) for p in paths]}"
                          f" x hookpoints {hookpoints} give {len(stores) * len(hookpoints)}; pass its stores")
    for s in stores:
        for h in hookpoints:
            if h not in s.hookpoints or s.d_in(h) != sae.d_in:
                raise ValueError(f"crosscoder {where} reads hookpoint {h!r} of width {sae.d_in}; store {s.path} "
                                  f"holds {s.hookpoints}: pass the stores it was trained on")
    return stores, hookpoints


def _transcoder_hookpoints(where: str, config: dict, store: ActivationStore, hookpoint: str | None) -> list[str]:
    """[input, output] hookpoints of a transcoder, both in the store (``hookpoint`` names the output); a cross-layer
    transcoder's S inputs then S outputs."""
    pair = list(config.get("hookpoints") or [])
    n = 2 * int(config.get("n_sources") or 1)
    if len(pair) != n:
        raise ValueError(f"{where} records hookpoints {pair}; a {config.get('kind')} needs "
                          f"{'[input, output]' if n == 2 else f'{n // 2} MLP inputs then their {n // 2} outputs'}")
    if hookpoint and (n > 2 or hookpoint != pair[1]):
        raise ValueError(f"--hookpoint {hookpoint}: {where} is a transcoder from {pair[0]} to {pair[1]}; "
                          f"drop --hookpoint")
    missing = [h for h in pair if h not in store.hookpoints]
    if missing:
        raise ValueError(f"a transcoder evaluates on both its hookpoints {pair}; store {store.path} lacks {missing} "
                          f"(it holds {store.hookpoints}): cache both in one store")
    return pair


def _live(sae, config: dict, home, hookpoint, model, dataset, device) -> Run:
    """The run of a dictionary trained from a model's forward: ``model`` over ``dataset``, each defaulting to what
    its training recorded (config.json's ``live``), read as that training read them."""
    where = str(home) if home is not None else "this dictionary (made in memory)"
    recorded = config.get("live") or {}
    name, dataset = model or recorded.get("model"), dataset or recorded.get("dataset")
    if not name or not dataset:
        raise ValueError(f"{config_file(home) if home is not None else where} records no store; pass --store "
                          "STORE_DIR (the store of the activations the dictionary reads), or --model M --dataset D "
                          "to read the model's activations over a dataset")
    if recorded.get("model") and name != recorded["model"]:
        log.warning("%s was trained on model %s; evaluating it on model %s", where, recorded["model"], name)
    known = {f.name for f in dataclasses.fields(LiveConfig)}
    live = LiveConfig(**{**{k: v for k, v in recorded.items() if k in known}, "model": name, "dataset": dataset})
    hookpoints = [hookpoint] if hookpoint else list(config.get("hookpoints") or [])
    if not hookpoints:
        raise ValueError(f"{where} records no hookpoint; pass --hookpoint")
    if hookpoint and len(config.get("hookpoints") or []) > 1:
        raise ValueError(f"--hookpoint {hookpoint}: {where} reads the hookpoints {config['hookpoints']}; "
                          f"drop --hookpoint")
    handle = open_model(live, hookpoints, device)
    if handle.d_model(hookpoints[0]) != sae.d_in:
        raise ValueError(f"{where} has d_in={sae.d_in} but model {name} has d={handle.d_model(hookpoints[0])} at "
                          f"{hookpoints[0]}; pass the model it was trained on")
    return Run(sae, config, LiveSource(live, handle, level_of(hookpoints)), hookpoints, home)


# --------------------------------------------------------------------------- held-out rows


def training_heldout(run: Run) -> dict | None:
    """The held-out batches a dictionary's training recorded (``activations.heldout_recipe``) when it was trained
    at the hookpoints ``run`` reads: from its config.json, or for runs made before it was recorded there, from
    train_config.json."""
    recipe = run.config.get("heldout")
    path = Path(str(run.home)) / "train_config.json" if run.home is not None else None
    if recipe is None and path is not None and not str(run.home).startswith("hf:") and path.exists():
        record = json.loads(path.read_text())
        train, cmd = record.get("train") or {}, record.get("command") or {}
        if train.get("eval_batches") and "batch_size" in train:
            recipe = {"stores": [str(Path(s).resolve()) for s in run.config.get("stores") or []],
                      "hookpoints": run.config.get("hookpoints"), "batch_size": train["batch_size"],
                      "seed": train.get("seed", 0), "batches": train["eval_batches"],
                      "buffer_rows": cmd.get("buffer_rows", 65536)}
    return recipe if recipe and list(recipe.get("hookpoints") or []) == list(run.hookpoints) else None


def rows_of(run: Run, rows: int, batch_size: int, rows_from: str = "heldout", recipe: dict | None = None,
            source: Source | None = None, hookpoints: list[str] | None = None):
    """(batches, where they come from) of ``run``: training's held-out batches (``recipe``, default: the run's own)
    when ``rows_from`` is heldout and they were recorded for this store and hookpoints, else the first ``rows`` rows.
    ``source`` / ``hookpoints``: another layer's of a set of transcoders, read under ``run``'s recipe."""
    source = run.source if source is None else source
    hookpoints = run.hookpoints if hookpoints is None else hookpoints
    if isinstance(source, LiveSource):
        return _live_rows(run, source, rows, batch_size, rows_from)
    stores = source if isinstance(source, list) else [source]
    if rows_from == "heldout":
        recipe = recipe or training_heldout(run)
        batches = heldout_batches(recipe, source, hookpoints, rows)
        if batches is not None:
            return batches, "training's held-out batches"
        log.warning("%s records no held-out batches for %s [%s]: evaluating on the first %d rows of the store, "
                    "which training may have seen", run.where, ", ".join(str(s.path) for s in stores),
                    " -> ".join(hookpoints), rows)
    return first_batches(source, hookpoints, rows, batch_size), "the first rows of the store"


def _live_rows(run: Run, source: LiveSource, rows: int, batch_size: int, rows_from: str):
    """A model's forward: training's held-out batches when ``rows_from`` is heldout, the dataset is the one it
    trained on and the run recorded them; else the dataset's first ``rows`` rows (with a warning when training read
    that dataset)."""
    dataset, trained_on = source.live.dataset, (run.config.get("dataset") or {}).get("spec")
    same = trained_on == describe_dataset(dataset).get("spec")
    recipe = _live_heldout(run) if same and rows_from == "heldout" else None
    if recipe is not None:
        return source.batches(run.hookpoints, recipe, rows), "training's held-out batches"
    if same and rows_from == "heldout":
        log.warning("%s records no held-out batches: evaluating on the first %d rows of %s, which training read",
                    run.where, rows, dataset)
    size = min(batch_size, rows)
    batches = list(source.batches(run.hookpoints, {"batch_size": size, "seed": 0, "batches": max(1, rows // size),
                                                   "buffer_rows": rows}, rows))
    if not batches:
        raise ValueError(f"model {source.live.model} over {dataset} gives fewer than {size} rows; lower "
                          f"--batch-size")
    why = "" if same else " (a dataset it did not train on)" if trained_on else " (its training data is not recorded)"
    return batches, f"the first rows of {dataset}{why}"


def _live_heldout(run: Run) -> dict | None:
    """The held-out batches of a ``train --model`` run: batch size, seed and count from config.json's training
    config, the shuffle buffer from train_config.json; None when not recorded."""
    train = (run.config.get("training") or {}).get("config") or {}
    path = Path(str(run.home)) / "train_config.json" if run.home is not None else None
    buffer = ((json.loads(path.read_text()).get("command") or {}).get("buffer_rows")
              if path is not None and path.exists() else None)
    if not train.get("eval_batches") or not train.get("batch_size") or buffer is None:
        return None
    return {"batch_size": train["batch_size"], "seed": train.get("seed", 0), "batches": train["eval_batches"],
            "buffer_rows": buffer}


def encoded_inputs(run: Run) -> tuple[str, ...]:
    """The hookpoints of ``run``'s one store that naming encodes, row-aligned: a cross-layer transcoder's layers'
    inputs, a crosscoder's hookpoints, else its one hookpoint. A crosscoder over two stores (``conceptdict diff``'s)
    is refused: naming reads the rows of one store."""
    model, n = run.dictionary, getattr(run.dictionary, "n_sources", 1)
    if isinstance(run.source, list) and len(run.source) > 1:
        raise ValueError(f"{run.where} is a crosscoder over {len(run.source)} stores "
                         f"({', '.join(str(p) for p in run.store_paths())}); `name` encodes the rows of one store and "
                         f"cannot name it: its latents' tags, Delta and decoder changes are in `conceptdict diff`'s "
                         f"latents.csv, and `conceptdict eval` measures it")
    layered = bool(getattr(getattr(model, "spec", None), "layered", False))
    return tuple(run.hookpoints[:n]) if layered or n > 1 else (run.hookpoints[0],)


def reads_several(config: dict) -> bool:
    """Whether a dictionary's config records a crosscoder (n_sources above 1, not a cross-layer transcoder's
    layers)."""
    return int(config.get("n_sources") or 1) > 1 and not kind_spec(config.get("kind", "topk")).transcodes
