"""Stage 1: model + tokens -> activation store, and back out as training batches.

The only stage that touches transformer-lens, transformers and ``datasets``; those heavy libraries
are imported inside the functions that need them, so importing this package stays cheap.
"""

from conceptdict.activations.cache import CacheConfig, cache_activations, config_hash
from conceptdict.activations.data import stdlib_docstrings
from conceptdict.activations.families import FAMILIES, Model, ModelFamily, family_of, load_model
from conceptdict.activations.importer import ImportConfig, import_array
from conceptdict.activations.listing import HookpointInfo, HookpointTable, list_hookpoints
from conceptdict.activations.losses import SpliceLosses, spliced_losses
from conceptdict.activations.models import (
    DEFAULT_HUB_ID,
    DEFAULT_MODEL_DIR,
    SENTENCE_HOOKPOINTS,
    ModelHandle,
    embed_texts,
    hub_id_of,
)
from conceptdict.activations.store import FORMAT_VERSION, ActivationStore, RowContext, StoreError
from conceptdict.activations.stream import (check_aligned, first_batches, heldout_batches, heldout_recipe,
                                           heldout_row_ids, stream_batches)
from conceptdict.activations.summary import HookpointStats, StoreSummary, format_summary, store_summary
from conceptdict.activations.wrapper import Tokens

__all__ = [
    "DEFAULT_HUB_ID",
    "DEFAULT_MODEL_DIR",
    "FAMILIES",
    "Model",
    "ModelFamily",
    "Tokens",
    "family_of",
    "hub_id_of",
    "FORMAT_VERSION",
    "SENTENCE_HOOKPOINTS",
    "ActivationStore",
    "CacheConfig",
    "HookpointInfo",
    "HookpointStats",
    "HookpointTable",
    "ImportConfig",
    "ModelHandle",
    "RowContext",
    "SpliceLosses",
    "StoreError",
    "StoreSummary",
    "cache_activations",
    "check_aligned",
    "config_hash",
    "embed_texts",
    "import_array",
    "list_hookpoints",
    "load_model",
    "spliced_losses",
    "stdlib_docstrings",
    "store_summary",
    "format_summary",
    "stream_batches",
    "first_batches",
    "heldout_batches",
    "heldout_row_ids",
    "heldout_recipe",
]
