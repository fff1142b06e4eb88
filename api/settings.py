"""Settings as plain data: keyword arguments or JSON files -> a stage's config dataclass, strictly.

Every stage owns small config dataclasses whose fields carry their help text in ``metadata["help"]``. The Python
API builds them from keyword arguments and the command line from flags; both go through :func:`config_from_dict`,
so an unknown key is the same error everywhere and names the closest valid key. A table of settings that is not one
dataclass (training's: the shared fields and every kind's own, ``saes.flat_train_fields``) is a sequence of
:class:`Setting`; the functions that list, split and parse settings take either (:func:`settings_of`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import difflib
import inspect
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, NamedTuple, Sequence, Union, get_args, get_origin

import typing_extensions


class ConfigError(ValueError):
    """A setting, config file or flag value that cannot be used; the message says the fix."""


class Setting(NamedTuple):
    """One setting as flags, config files and keywords see it."""

    name: str
    type: Any
    """The resolved annotation (``int | None``, ``Literal[...]``, a nested config dataclass)."""
    default: Any
    """Its default (``dataclasses.MISSING`` when it must be given)."""
    help: str
    flag: str | None = None
    """The flag's and keyword's name where it differs from ``name`` (field ``hookpoints``: ``hookpoint``)."""
    minimum: float | None = None
    """The smallest value it takes, checked where settings are read."""
    kinds: tuple[str, ...] | None = None
    """The dictionary kinds that read it (training settings only); None: every kind."""
    shown_default: Any = dataclasses.MISSING
    """The default ``--help`` shows when ``default`` is None because the true one depends on other settings."""

    @property
    def keyword(self) -> str:
        """Its name as a flag without dashes and as a keyword of the Python API."""
        return (self.flag or self.name).replace("-", "_")


SettingsSource = Union[type, Sequence[Setting]]
"""A config dataclass or a table of :class:`Setting`."""


def settings_of(source: SettingsSource) -> list[Setting]:
    """The settings of a config dataclass (its init fields, in order), or ``source`` itself when it is a table."""
    if not isinstance(source, type):
        return list(source)
    hints = type_hints(source)
    out = []
    for f in dataclasses.fields(source):
        if not f.init:
            continue
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
                   else f.default)
        out.append(Setting(f.name, hints[f.name], default, field_help(f), f.metadata.get("flag"),
                           f.metadata.get("min"), f.metadata.get("kinds"), f.metadata.get("default",
                                                                                           dataclasses.MISSING)))
    return out


def field_help(f: dataclasses.Field) -> str:
    """The help text a field declares (``metadata["help"]``), one line."""
    return " ".join(str(f.metadata.get("help", "")).split())


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for ``T | None``; (tp, False) otherwise."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_bool(text: str) -> bool:
    low = str(text).lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def scalar_parser(tp: Any):
    """The function turning a flag's text into a value of type ``tp``."""
    if tp is Path:
        return Path
    if tp is bool:
        return parse_bool
    if tp in (int, float, str):
        return tp
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    return str


def check_keys(data: dict[str, Any], cls: SettingsSource, where: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` that ``cls`` has no setting for."""
    types = {s.name: s.type for s in settings_of(cls)}
    names = list(types)
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {key!r} in {where}: {hint}")
        tp, _ = unwrap_optional(types[key])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            check_keys(value, tp, f"{where}.{key}")


SCALAR_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def _coerce(tp: Any, value: Any, name: str = "", where: str = "config", minimum: float | None = None) -> Any:
    if value is None:
        return None
    if tp in SCALAR_NAMES:
        return _scalar(tp, value, name, where, minimum)
    if tp is Path:
        return Path(home_of(value, name))
    if get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if get_origin(tp) is list and isinstance(value, (str, Path, int, float)):
        value = [value]  # a repeatable setting given once
    if get_origin(tp) is list:
        (item,) = get_args(tp)[:1] or (str,)
        if item in (int, float, bool):
            return [_scalar(item, v, f"{name}[{i}]", where) for i, v in enumerate(value)]
        return [Path(home_of(v, name)) if item is Path else str(v) if item is str and isinstance(v, (int, float)) else v
                for v in value]
    return value


def _scalar(tp: type, value: Any, name: str, where: str, minimum: float | None = None) -> Any:
    """``value`` as the scalar type ``tp`` (an int is a number; a number given where text belongs is its text), at
    least ``minimum`` (a field's ``metadata["min"]``); ConfigError naming the key and the expected type or bound
    otherwise (a --config file's "eight" for k)."""
    if tp is str and (isinstance(value, (int, float, Path)) and not isinstance(value, bool)):
        return str(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e6 in a JSON file
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else isinstance(value, str))
    if not ok:
        raise ConfigError(f"{where}: {name}={value!r} must be {SCALAR_NAMES[tp]}, not {type(value).__name__}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{where}: {name}={value} must be a finite number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: {name}={value} must be >= {minimum}")
    return value


def home_of(value: Any, name: str = "") -> Any:
    """``value`` where a folder is expected: a path as it is; an object the API returned (a dictionary, a store, a
    concept dictionary, a CBM) its folder (``.path``); ConfigError for one made in memory, which has none."""
    if isinstance(value, (str, os.PathLike)):
        return value
    if not hasattr(value, "path"):
        raise ConfigError(f"{name or 'a setting'}={value!r}: expected a folder (a path, or an object conceptdict "
                          f"returned), got {type(value).__name__}")
    if value.path is None:
        raise ConfigError(f"{name or 'a setting'}: this {type(value).__name__} was made in memory and has no folder; "
                          f"pass the folder it was written to, or write it out first (e.g. out= of the call that "
                          f"made it)")
    return value.path


def given(values: dict[str, Any], *skip: str) -> dict[str, Any]:
    """A public function's settings from ``locals()`` taken at its first line: every parameter but ``skip`` (its
    positional inputs) that is not None (None: the config's default, which ``takes_settings`` checked is the
    parameter's)."""
    return {k: v for k, v in values.items() if k not in skip and v is not None}


def flag_aliases(cls: SettingsSource) -> dict[str, str]:
    """Keyword name -> field name for the settings whose flag is spelled otherwise (``hookpoint`` -> ``hookpoints``)."""
    return {s.keyword: s.name for s in settings_of(cls) if s.keyword != s.name}


def canonical_keys(cls: SettingsSource, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with flag spellings (``hookpoint``, ``label-column``) renamed to ``cls``'s field names."""
    aliases = flag_aliases(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(key.replace("-", "_"), key.replace("-", "_") if "-" in key else key)
        if name in out:
            raise ConfigError(f"{key!r} and {name!r} name the same setting; give one of them")
        out[name] = value
    return out


def coerce_settings(cls: SettingsSource, data: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """``data``'s values typed as ``cls``'s settings say (a Path from text, an int from 1e6, a nested config from a
    dict), strictly: an unknown key names the closest one, a bad value names the key and the type or bound it
    needs. Keys may be the settings' names or their flags' names; the result is keyed by the names."""
    data = canonical_keys(cls, data)
    check_keys(data, cls, where)
    out: dict[str, Any] = {}
    for s in settings_of(cls):
        if s.name not in data:
            continue
        value = data[s.name]
        tp, _ = unwrap_optional(s.type)
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = config_from_dict(tp, value, f"{where}.{s.name}")
        else:
            value = _coerce(tp, value, s.name, where, s.minimum)
        out[s.name] = value
    return out


def config_from_dict(cls: type, data: dict[str, Any], where: str = "config") -> Any:
    """Build dataclass ``cls`` from a plain dict, strictly (:func:`coerce_settings`); keys may be the field names or
    their flags' names."""
    kwargs = coerce_settings(cls, data, where)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{where} needs {', '.join(missing)}") from None
        raise ConfigError(f"{where}: {e}") from None


def split_settings(data: dict[str, Any], *classes: SettingsSource, where: str) -> list[dict[str, Any]]:
    """``data`` split by which of ``classes`` has a field of that name (the first one that has it); a key none of
    them has is a :class:`ConfigError` naming the closest key of all of them."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    names = [[s.name for s in settings_of(c)] + list(flag_aliases(c)) for c in classes]
    for key, value in data.items():
        key = key.replace("-", "_")
        for part, known in zip(parts, names):
            if key in known:
                part[key] = value
                break
        else:
            every = [n for known in names for n in known]
            close = difflib.get_close_matches(key, every, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(every)}"
            raise ConfigError(f"unknown setting {key!r} for {where}: {hint}")
    return parts


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, nested dicts merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(config_file: Path) -> dict[str, Any]:
    """The JSON object in ``config_file``; :class:`ConfigError` naming the file otherwise."""
    try:
        data = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {config_file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {config_file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {config_file} must hold a JSON object, got {type(data).__name__}")
    return data


def to_jsonable(obj: Any) -> Any:
    """A dataclass (or nested value) as plain JSON types; Paths become strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_resolved_config(cfg: Any, directory: Path, name: str = "resolved_config.json") -> Path:
    """Write the config a command actually ran with next to its output."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(to_jsonable(cfg), indent=2, sort_keys=True) + "\n")
    return path


def parse_field_values(cls: SettingsSource, spec: str, flag: str) -> tuple[str, list[Any]]:
    """``FIELD=V1,V2,...`` -> (field, the values typed as ``cls``'s field), for settings such as ``sweep``;
    an unknown field names the closest one, a bad value names the field and its type."""
    name, sep, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values.strip():
        raise ConfigError(f"{flag} {spec!r}: write FIELD=V1,V2,... (e.g. {flag} k=16,32)")
    check_keys({name: None}, cls, flag)
    tp, optional = unwrap_optional({s.name: s.type for s in settings_of(cls)}[name])
    if tp not in (int, float, str, bool) and get_origin(tp) is not Literal:
        raise ConfigError(f"{flag} {name}: only fields holding one number or word can be swept")
    parse = scalar_parser(tp)
    out: list[Any] = []
    for text in values.split(","):
        text = text.strip()
        try:
            out.append(None if optional and text.lower() == "none" else parse(text))
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{flag} {name}={text!r}: not a valid {getattr(tp, '__name__', tp)} ({e})") from None
    if len(set(map(repr, out))) != len(out):
        raise ConfigError(f"{flag} {spec!r} repeats a value")
    return name, out


F = typing.TypeVar("F", bound=typing.Callable[..., Any])


def _unpacked(annotation: Any) -> Any:
    """The TypedDict of a ``**kwargs: Unpack[TD]`` annotation, None for anything else."""
    if get_origin(annotation) in (getattr(typing, "Unpack", None), typing_extensions.Unpack):
        (td,) = get_args(annotation)
        return td
    return None


def _annotation(fn: Any, p: inspect.Parameter) -> Any:
    """``p``'s annotation of ``fn`` evaluated (a string under ``from __future__ import annotations``)."""
    if isinstance(p.annotation, str):  # what typing.get_type_hints does, for this one parameter
        return eval(p.annotation, fn.__globals__)  # noqa: S307 - the module's own annotation
    return p.annotation


def _same_default(given: Any, declared: Any) -> bool:
    if declared is dataclasses.MISSING or isinstance(declared, (list, dict)) or dataclasses.is_dataclass(declared):
        return given is None  # required (checked when the config is built), or a mutable default (None: it)
    if isinstance(declared, Path):
        return given is not None and Path(given) == declared
    return bool(given == declared) and type(given) is type(declared)


def takes_settings(*sources: SettingsSource, extra: typing.Collection[str] = ()) -> typing.Callable[[F], F]:
    """Check a public function's keyword parameters against the settings of ``sources`` and describe them.

    Every public function lists its settings as parameters (written out, or ``**settings: Unpack[SomeTypedDict]``
    where a table is shared), so that ``help()``, IDEs and mypy see each one's name, type and default. This raises
    TypeError at import when the two disagree (a setting without a parameter, a parameter no setting has, other than
    ``extra``, or a default that differs), so the command line, config files and Python cannot drift; sets
    ``__signature__`` with a TypedDict's keys written out (their defaults the settings'); and appends each setting's
    help to the docstring."""

    def wrap(fn: F) -> F:
        table = {s.keyword: s for source in sources for s in settings_of(source)}
        signature = inspect.signature(fn)
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            shared = _unpacked(_annotation(fn, p)) if p.kind is p.VAR_KEYWORD else None
            if p.kind is p.VAR_KEYWORD and shared is None:
                raise TypeError(f"{fn.__qualname__}(**{p.name}): annotate it as Unpack[TypedDict] of its settings")
            if shared is None:
                params.append(p)
                continue
            for key, tp in typing.get_type_hints(shared).items():
                s = table.get(key)
                default = None if s is None or _same_default(None, s.default) else s.default
                params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default,
                                                annotation=tp))
        names = {p.name for p in params}
        problems = [f"setting {k!r} has no parameter" for k in table if k not in names]
        problems += [f"parameter {p.name!r} is no setting" for p in params if p.kind is p.KEYWORD_ONLY
                     and p.name not in table and p.name not in extra]
        problems += [f"parameter {p.name}={p.default!r} but the setting's default is {table[p.name].default!r}"
                     for p in params if p.name in table and p.default is not p.empty
                     and not _same_default(p.default, table[p.name].default)]
        if problems:
            raise TypeError(f"{fn.__module__}.{fn.__qualname__} and its settings disagree: {'; '.join(problems)}")
        fn.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        lines = []
        for key, s in table.items():
            default = s.default if s.shown_default is dataclasses.MISSING else s.shown_default
            shown = "" if default is dataclasses.MISSING or default in (None, [], ()) else f" (default: {default})"
            lines.append(f"    {key}: {s.help}{shown}")
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nSettings:\n" + "\n".join(lines)
        return fn

    return wrap
