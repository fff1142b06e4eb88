"""Stage 2: sparse dictionaries (TopK, BatchTopK, ReLU, JumpReLU, Matryoshka, SpaDE, crosscoders, transcoders),
training, evals, save/load.

Pure tensor code: torch, einops, safetensors (numba only under ``saes.kernels``).
"""

from .artifact import save_dictionary
from .evaluation import (EvalResult, ce_loss_recovered, describe_dictionary, evaluate, format_table, kl_score,
                         threshold_line, with_splice_scores)
from .metrics import JsonlSink, MetricsSink, NullSink
from .model import KINDS, KindSpec, SparseCoder, TrainOutput, kind_spec
from .comm import LOCAL, Comm, LocalComm
from .training import TrainConfig, train
from .formats import (FormatError, export_saelens, import_saelens, load_dictionary, load_dictionary_config,
                      match_hookpoint, open_dictionary)

from . import crosscoder as _crosscoder  # noqa: E402,F401  (registers the crosscoder kinds in KINDS)
from . import jumprelu as _jumprelu  # noqa: E402,F401  (registers jumprelu)
from . import matryoshka as _matryoshka  # noqa: E402,F401  (registers matryoshka, matryoshka-absolute)
from . import spade as _spade  # noqa: E402,F401  (registers spade)
from . import transcoder as _transcoder  # noqa: E402,F401  (registers the transcoder kinds in KINDS)

__all__ = [
    "KINDS", "LOCAL", "Comm", "EvalResult", "FormatError", "JsonlSink", "KindSpec", "LocalComm", "MetricsSink",
    "NullSink", "SparseCoder", "TrainConfig", "TrainOutput", "ce_loss_recovered", "evaluate", "export_saelens",
    "format_table", "import_saelens", "kind_spec", "kl_score", "load_dictionary", "load_dictionary_config",
    "match_hookpoint", "open_dictionary", "save_dictionary", "train",
    "with_splice_scores", "describe_dictionary", "threshold_line",
]
