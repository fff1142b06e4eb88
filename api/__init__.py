"""conceptdict: sparse-autoencoder concept discovery. ``import conceptdict as cd``.

The workflow, one function per command of the ``conceptdict`` command line (keyword names are the flags' names;
each returns a typed result and prints nothing):

    store = cd.cache(model="default", hookpoint="sentence.mean_normalized", dataset="stdlib-docstrings",
                     tokens=700, out="runs/s")
    sae = cd.train(store="runs/s", latents=128, k=8, out="runs/sae")
    cd.evaluate("runs/sae").metrics.fvu
    concepts = cd.name("runs/sae", vocab="wordfreq:en:3000", out="runs/c")
    cd.cbm("runs/c", label_column="family", out="runs/cbm").metrics["accuracy"]

    cache, import_array, train, evaluate, compare, diff, name, score, cbm, cbsae, steer, erase, export, demo

    broad = cd.broad_dictionary()   # conceptdict broad: trained once on docstrings, man pages, package synopses
    cd.cbm(broad.concepts, dataset="runs/task-store", label_column="topic", out="runs/cbm-broad")

The objects a notebook needs:

    load(path_or_hf_id)      a dictionary in any format: .encode(x), .decode(codes), sae(x), .config
    open_store(path)         an activation store: .rows(hookpoint, start, stop), .labels(column), .row_context(i)
    load_model(name_or_dir)  a model ("default": the bundled all-MiniLM-L6-v2): .to_tokens, .run_with_cache,
                             .run_with_saes, .embed_texts (image models: .embed_images)
    embed_texts, embed_images  new inputs as the rows a sentence-level or image dictionary encodes
    load_concepts(path)      a concept dictionary: concepts[12] by latent id, concepts["error"] by name
    cbm_features(cbm)        the concept activations a CBM reads per labelled input (to explain its predictions)
    splice(model, sae, edit) a context manager: the dictionary spliced into the model's forward
    hookpoints(model)        every hookpoint of a model with its shape (``conceptdict hookpoints --model M``)
    store_info, verify_store

``cd.__version__`` is the installed package's version (``conceptdict --version``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin after a parallel region steal the cores of the other pool: on CPU a training step
# runs torch's OpenMP pool (matmuls, elementwise ops) and numba's (the sparse kernels) one after the other, and
# each pool's spinning workers slowed the other's next op by up to 100x (a 65k-entry argsort: 3 ms alone, 200-
# 300 ms inside a crosscoder step). Sleeping workers took a small crosscoder step from 8.2x to 1.4x its matmul
# floor on this project's 2-core machine; at D = 768, L = 16384 little changes (docs/results/speed.md). It takes
# effect only when torch is not imported yet (the runtime reads it once); a value the user set is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Progress bars are tqdm.auto's: Jupyter's widget in a notebook kernel with ipywidgets, text elsewhere. Without
# ipywidgets tqdm.auto falls back to text too, but the first import of it in a kernel also warns "IProgress not
# found. Please update jupyter and ipywidgets" (conceptdict does not depend on ipywidgets): that import is done
# here, before any stage's, with the warning silenced; tqdm keeps its choice for the process. Outside such a kernel
# nothing is imported.
if "ipykernel" in sys.modules and "tqdm.autonotebook" not in sys.modules:
    import importlib.util

    if importlib.util.find_spec("ipywidgets") is None:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="IProgress not found")
            import tqdm.auto  # noqa: F401

_WHERE = {
    "cache": "store_api", "import_array": "store_api", "open_store": "store_api", "load_model": "store_api",
    "store_info": "store_api", "verify_store": "store_api", "hookpoints": "store_api",
    "embed_texts": "model_api", "embed_images": "model_api",
    "train": "train_api", "load": "train_api",
    "evaluate": "eval_api", "compare": "eval_api",
    "diff": "diff_api",
    "name": "concept_api", "score": "concept_api", "cbm": "concept_api", "cbsae": "concept_api",
    "cbm_features": "cbm_inputs",
    "export": "concept_api",
    "steer": "edit_api", "erase": "edit_api", "splice": "edit_api",
    "demo": "demo_api",
    "plan": "plan_api",
    "broad_dictionary": "broad_api",
    "cached_broad_dictionary": "broad_api",
    "load_concepts": ("conceptdict.naming", "load_concepts"),
    "describe": ("conceptdict.saes", "describe_dictionary"),
    "SparseCoder": ("conceptdict.saes", "SparseCoder"),
    "Sweep": ("conceptdict.saes.sweep_results", "Sweep"),
    "ActivationStore": ("conceptdict.activations", "ActivationStore"),
    "ConceptDictionary": ("conceptdict.naming", "ConceptDictionary"),
    "TrainConfig": ("conceptdict.saes", "TrainConfig"),
    "ConfigError": ("conceptdict.settings", "ConfigError"),
    "set_read_policy": ("conceptdict.activations.integrity", "set_read_policy"),
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # what mypy and IDEs read; at run time each name is imported on first use (``__getattr__``)
    from conceptdict.activations import ActivationStore as ActivationStore
    from conceptdict.activations.integrity import set_read_policy as set_read_policy
    from conceptdict.broad_api import broad_dictionary as broad_dictionary
    from conceptdict.broad_api import cached_broad_dictionary as cached_broad_dictionary
    from conceptdict.cbm_inputs import cbm_features as cbm_features
    from conceptdict.concept_api import cbm as cbm
    from conceptdict.concept_api import cbsae as cbsae
    from conceptdict.concept_api import export as export
    from conceptdict.concept_api import name as name
    from conceptdict.concept_api import score as score
    from conceptdict.demo_api import demo as demo
    from conceptdict.plan_api import plan as plan
    from conceptdict.diff_api import diff as diff
    from conceptdict.edit_api import erase as erase
    from conceptdict.edit_api import splice as splice
    from conceptdict.edit_api import steer as steer
    from conceptdict.eval_api import compare as compare
    from conceptdict.eval_api import evaluate as evaluate
    from conceptdict.model_api import embed_images as embed_images
    from conceptdict.model_api import embed_texts as embed_texts
    from conceptdict.naming import ConceptDictionary as ConceptDictionary
    from conceptdict.naming import load_concepts as load_concepts
    from conceptdict.saes import SparseCoder as SparseCoder
    from conceptdict.saes import TrainConfig as TrainConfig
    from conceptdict.saes.sweep_results import Sweep as Sweep
    from conceptdict.saes import describe_dictionary
    from conceptdict.settings import ConfigError as ConfigError
    from conceptdict.store_api import cache as cache
    from conceptdict.store_api import hookpoints as hookpoints
    from conceptdict.store_api import import_array as import_array
    from conceptdict.store_api import load_model as load_model
    from conceptdict.store_api import open_store as open_store
    from conceptdict.store_api import store_info as store_info
    from conceptdict.store_api import verify_store as verify_store
    from conceptdict.train_api import load as load
    from conceptdict.train_api import train as train

    __version__: str
    describe = describe_dictionary


UNKNOWN_VERSION = "0+unknown"
"""``cd.__version__`` where conceptdict's distribution metadata is missing (the folders on ``sys.path`` without
``pip install``): a PEP 440 version lower than every release."""


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, as pip recorded it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("conceptdict")
    except PackageNotFoundError:
        return UNKNOWN_VERSION


def _lazy(name: str) -> Any:
    """Import on first use, so ``import conceptdict`` (and ``conceptdict --help``) stays fast."""
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'conceptdict' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (f"conceptdict.{where}", name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


if not TYPE_CHECKING:  # mypy reads the names above, so a public name missing there is an error, not Any
    __getattr__ = _lazy


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
