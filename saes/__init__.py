"""Stage 2: sparse dictionaries (TopK, BatchTopK, ReLU, JumpReLU, Matryoshka, SpaDE, crosscoders, transcoders),
training, evals, save/load. The kinds: saes/kinds/ (one module each, listed in its registry).

Pure tensor code: torch, einops, safetensors (numba only under ``saes.kernels``).
"""

from .artifact import save_dictionary
from .evaluation import (EvalResult, ce_loss_recovered, describe_dictionary, evaluate, format_table, kl_score,
                         threshold_line, with_splice_scores)
from .metrics import JsonlSink, MetricsSink, NullSink
from .kinds import KINDS, KindSpec, TrainOutput, is_crosscoder, kind_spec, reads_several_sources, register, unregister
from .model import SparseCoder
from .comm import LOCAL, Comm, LocalComm
from .flat import FlatField, flat_train_fields, to_flat, train_config
from .training import TrainConfig, train
from .formats import (FormatError, config_file, export_saelens, import_saelens, load_dictionary,
                      load_dictionary_config, match_hookpoint, open_dictionary)

__all__ = [
    "KINDS", "LOCAL", "Comm", "EvalResult", "FlatField", "FormatError", "JsonlSink", "KindSpec", "LocalComm",
    "MetricsSink", "NullSink", "SparseCoder", "TrainConfig", "TrainOutput", "ce_loss_recovered", "evaluate",
    "config_file", "export_saelens", "flat_train_fields", "format_table", "import_saelens", "is_crosscoder",
    "kind_spec", "kl_score",
    "load_dictionary", "load_dictionary_config", "match_hookpoint", "open_dictionary", "reads_several_sources",
    "register", "save_dictionary", "describe_dictionary", "threshold_line", "to_flat", "train", "train_config", "unregister", "with_splice_scores",
]
