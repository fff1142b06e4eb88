"""The settings of every command, in one place: the dataclasses whose fields are the flags of the command line and
the keyword arguments of the API (each field's help is its ``metadata["help"]``)."""

from conceptdict.activations import CacheConfig, ImportConfig
from conceptdict.activations.live import LiveConfig
from conceptdict.concept_api import ExportConfig
from conceptdict.diff_api import DiffConfig
from conceptdict.eval_api import CompareConfig, EvalConfig
from conceptdict.naming import CbmConfig, NameConfig
from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
from conceptdict.naming.interventions.erase import EraseConfig
from conceptdict.naming.scoring import ScoreConfig
from conceptdict.naming.interventions.steer import SteerConfig
from conceptdict.saes import TrainConfig
from conceptdict.train_api import TrainCommand

__all__ = ["CacheConfig", "CbSaeConfig", "CbmConfig", "CompareConfig", "DiffConfig", "EraseConfig", "EvalConfig",
           "ExportConfig", "ImportConfig", "LiveConfig", "NameConfig", "ScoreConfig", "SteerConfig", "TrainCommand",
           "TrainConfig"]
