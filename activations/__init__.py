"""Stage 1: model + tokens -> activation store, and back out as training batches.

The only stage that touches transformer-lens, transformers and ``datasets``. Heavy imports
(transformer-lens, transformers, datasets) happen inside the functions that need them.
"""

from conceptdict.activations.importer import ImportConfig, import_array
from conceptdict.activations.store import (
    FORMAT_VERSION,
    ActivationStore,
    RowContext,
    StoreError,
)
from conceptdict.activations.stream import check_aligned, stream_batches
from conceptdict.activations.summary import HookpointStats, StoreSummary, store_summary

__all__ = [
    "FORMAT_VERSION",
    "ActivationStore",
    "HookpointStats",
    "ImportConfig",
    "RowContext",
    "StoreError",
    "StoreSummary",
    "check_aligned",
    "import_array",
    "store_summary",
    "stream_batches",
]
