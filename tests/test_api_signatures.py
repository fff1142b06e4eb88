"""Every public function of ``conceptdict``: no positional parameter shares a name with a setting of the config it
builds, or the documented call ``cd.cbsae("runs/c", concepts="list.txt", ...)`` is a TypeError (issue 50)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import conceptdict as cd
from conceptdict.settings import flag_aliases

pytestmark = pytest.mark.unit


def configs_of(name: str) -> list[type]:
    """The config dataclasses whose settings ``cd.<name>(**settings)`` takes (the targets of its config_from_dict)."""
    from conceptdict.activations.cache import CacheConfig
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.activations.live import LiveConfig
    from conceptdict.broad_api import BroadConfig
    from conceptdict.concept_api import ExportConfig
    from conceptdict.diff_api import DiffConfig
    from conceptdict.eval_api import CompareConfig, EvalConfig
    from conceptdict.naming.bottleneck.cbm import CbmConfig
    from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
    from conceptdict.naming.interventions.erase import EraseConfig
    from conceptdict.naming.interventions.steer import SteerConfig
    from conceptdict.naming.pipeline import NameConfig
    from conceptdict.naming.scoring import ScoreConfig
    from conceptdict.train_api import TrainCommand, train_settings

    return {
        "cache": [CacheConfig], "import_array": [ImportConfig],
        "train": [TrainCommand, train_settings(), LiveConfig], "diff": [DiffConfig, train_settings()],
        "evaluate": [EvalConfig], "compare": [CompareConfig],
        "name": [NameConfig], "score": [ScoreConfig], "cbm": [CbmConfig], "cbsae": [CbSaeConfig],
        "export": [ExportConfig], "steer": [SteerConfig], "erase": [EraseConfig],
        "broad_dictionary": [BroadConfig], "cached_broad_dictionary": [BroadConfig],
    }.get(name, [])


BUILDS_NO_CONFIG = {"open_store", "load_model", "store_info", "verify_store", "hookpoints", "load", "load_concepts",
                    "describe", "splice", "demo", "set_read_policy", "embed_texts", "embed_images"}
"""Public functions that take no ``**settings`` (their keywords are their own parameters)."""

CLASSES = {"SparseCoder", "ActivationStore", "ConceptDictionary", "TrainConfig", "ConfigError"}

FORWARDED = {("import_array", "array")}
"""(function, positional) pairs where the positional IS that setting (passed on as ``array=``), not another value."""


def _setting_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} | set(flag_aliases(cls))


def test_every_public_name_is_classified():
    with_config = {n for n in cd.__all__ if configs_of(n)}
    assert set(cd.__all__) == with_config | BUILDS_NO_CONFIG | CLASSES, (
        "a new public name of conceptdict: list the config it builds in configs_of, or add it to BUILDS_NO_CONFIG")


@pytest.mark.parametrize("name", sorted(n for n in cd.__all__ if n not in CLASSES))
def test_no_positional_parameter_is_also_a_setting(name):
    fn = getattr(cd, name)
    params = inspect.signature(fn).parameters.values()
    takes_settings = any(p.kind is p.VAR_KEYWORD for p in params)
    configs = configs_of(name)
    assert takes_settings == bool(configs) or name in BUILDS_NO_CONFIG, name
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for cls in configs:
        clash = (set(positional) & _setting_names(cls)) - {p for f, p in FORWARDED if f == name}
        assert not clash, (f"cd.{name}'s positional parameter {sorted(clash)} is also a setting of {cls.__name__}: "
                           f"cd.{name}(x, {sorted(clash)[0]}=...) is a TypeError; rename the positional")
