"""Every public function of ``conceptdict``: no positional parameter shares a name with a setting of the config it
builds, or the documented call ``cd.cbsae("runs/c", concepts="list.txt", ...)`` is a TypeError (issue 50)."""

from __future__ import annotations

import inspect

import pytest

import conceptdict as cd
from conceptdict.settings import settings_of

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
    from conceptdict.saes.sizing import PlanConfig
    from conceptdict.train_api import TrainCommand, train_settings

    return {
        "cache": [CacheConfig], "import_array": [ImportConfig],
        "train": [TrainCommand, train_settings(), LiveConfig], "diff": [DiffConfig, train_settings()],
        "evaluate": [EvalConfig], "compare": [CompareConfig],
        "name": [NameConfig], "score": [ScoreConfig], "cbm": [CbmConfig], "cbsae": [CbSaeConfig],
        "export": [ExportConfig], "steer": [SteerConfig], "erase": [EraseConfig],
        "broad_dictionary": [BroadConfig], "cached_broad_dictionary": [BroadConfig], "plan": [PlanConfig],
    }.get(name, [])


BUILDS_NO_CONFIG = {"open_store", "load_model", "store_info", "verify_store", "hookpoints", "load", "load_concepts",
                    "describe", "splice", "demo", "set_read_policy", "embed_texts", "embed_images", "cbm_features"}
"""Public functions that build no config (their parameters are their own)."""

CLASSES = {"SparseCoder", "ActivationStore", "ConceptDictionary", "TrainConfig", "ConfigError", "Sweep"}

FORWARDED = {("import_array", "array"), ("cbsae", "label_column"), ("train", "store")}
"""(function, positional) pairs where the positional IS that setting, not another value."""


def _keywords(cls) -> set[str]:
    return {s.keyword for s in settings_of(cls)}


def test_every_public_name_is_classified():
    with_config = {n for n in cd.__all__ if configs_of(n)}
    assert set(cd.__all__) >= with_config | BUILDS_NO_CONFIG | CLASSES
    unclassified = set(cd.__all__) - with_config - BUILDS_NO_CONFIG - CLASSES
    assert all(not callable(getattr(cd, n)) or isinstance(getattr(cd, n), type) or n in TYPES
               for n in unclassified), (
        f"new public names {sorted(unclassified)}: list the config each builds in configs_of, or add it to "
        f"BUILDS_NO_CONFIG")


TYPES = {"DictionaryLike", "StoreLike", "ConceptsLike", "CbmLike", "TrainingSettings"}


@pytest.mark.parametrize("name", sorted(n for n in cd.__all__ if configs_of(n)))
def test_every_setting_is_a_typed_keyword_with_its_default(name):
    """help(cd.train) and IDEs list each setting with its type and default: the signature names every setting of
    the configs the function builds (as the flag spells it), and nothing hides in a bare **settings."""
    sig = inspect.signature(getattr(cd, name))
    params = sig.parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"cd.{name} still takes **settings"
    for cls in configs_of(name):
        missing = _keywords(cls) - set(params)
        assert not missing, f"cd.{name} has no parameter for the settings {sorted(missing)} of {cls}"
    untyped = [p.name for p in params.values() if p.annotation is p.empty]
    assert not untyped, f"cd.{name}: parameters without a type: {untyped}"
    assert "Settings:" in (getattr(cd, name).__doc__ or ""), f"help(cd.{name}) does not describe its settings"


@pytest.mark.parametrize("name", sorted(n for n in cd.__all__ if n not in CLASSES | TYPES and callable(getattr(cd, n))))
def test_no_positional_parameter_is_also_a_setting(name):
    params = inspect.signature(getattr(cd, name)).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for cls in configs_of(name):
        clash = (set(positional) & _keywords(cls)) - {p for f, p in FORWARDED if f == name}
        assert not clash, (f"cd.{name}'s positional parameter {sorted(clash)} is also a setting of {cls}: "
                           f"cd.{name}(x, {sorted(clash)[0]}=...) is a TypeError; rename the positional")


def test_a_parameter_that_drifts_from_its_setting_fails_at_import():
    """The check behind the signatures: a default that differs from the config's, a setting without a parameter,
    or a parameter no setting has is a TypeError when the module defines the function."""
    from dataclasses import dataclass, field

    from conceptdict.settings import takes_settings

    @dataclass
    class Demo:
        rows: int = field(default=8, metadata={"help": "Rows."})
        name: str | None = field(default=None, metadata={"help": "A name."})

    def good(*, rows: int = 8, name: str | None = None) -> None:
        """Demo."""

    assert "rows: Rows. (default: 8)" in takes_settings(Demo)(good).__doc__
    for wrong in ("def f(*, rows: int = 9, name: str | None = None) -> None: ...",
                  "def f(*, rows: int = 8) -> None: ...",
                  "def f(*, rows: int = 8, name: str | None = None, extra: int = 1) -> None: ..."):
        scope: dict = {}
        exec(wrong, scope)
        with pytest.raises(TypeError, match="disagree"):
            takes_settings(Demo)(scope["f"])


def _forward_names(tp) -> set[str]:
    """The names of the string forward references inside a resolved annotation (``Union[str, "ConceptDictionary"]``)."""
    import typing

    if isinstance(tp, typing.ForwardRef):
        return {tp.__forward_arg__}
    return set().union(*(_forward_names(a) for a in typing.get_args(tp))) if typing.get_args(tp) else set()


def test_every_public_function_resolves_its_hints_in_its_own_module():
    """typing.get_type_hints(cd.steer) must not depend on which function's hints were resolved first: a forward
    reference such as ConceptsLike's "ConceptDictionary" is cached once resolved, so a module that does not import
    the class fails only when it is asked first (it did: the guide's checker, run in another order)."""
    missing = []
    for name in cd.__all__:
        fn = inspect.unwrap(getattr(cd, name))  # the decorators' wrappers live in other modules
        if not inspect.isfunction(fn):
            continue
        for key, text in fn.__annotations__.items():
            tp = eval(text, fn.__globals__) if isinstance(text, str) else text  # noqa: S307 (our own annotations)
            missing += [f"cd.{name}({key}): {ref}" for ref in _forward_names(tp) if ref not in fn.__globals__]
    assert not missing, f"names the hints use but the function's module does not import: {missing}"
