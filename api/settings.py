"""Settings as plain data: keyword arguments or JSON files -> a stage's config dataclass, strictly.

Every stage owns small config dataclasses whose fields carry their help text in ``metadata["help"]``. The Python
API builds them from keyword arguments and the command line from flags; both go through :func:`config_from_dict`,
so an unknown key is the same error everywhere and names the closest valid key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A setting, config file or flag value that cannot be used; the message says the fix."""


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


def check_keys(data: dict[str, Any], cls: type, where: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` that ``cls`` has no field for."""
    names = [f.name for f in dataclasses.fields(cls)]
    hints = type_hints(cls)
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {key!r} in {where}: {hint}")
        tp, _ = unwrap_optional(hints[key])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            check_keys(value, tp, f"{where}.{key}")


SCALAR_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def _coerce(tp: Any, value: Any, name: str = "", where: str = "config", minimum: float | None = None) -> Any:
    if value is None:
        return None
    if tp in SCALAR_NAMES:
        return _scalar(tp, value, name, where, minimum)
    if tp is Path:
        return Path(value)
    if get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if get_origin(tp) is list and isinstance(value, (str, Path, int, float)):
        value = [value]  # a repeatable setting given once
    if get_origin(tp) is list:
        (item,) = get_args(tp)[:1] or (str,)
        if item in (int, float, bool):
            return [_scalar(item, v, f"{name}[{i}]", where) for i, v in enumerate(value)]
        return [Path(v) if item is Path else str(v) if item is str and isinstance(v, (int, float)) else v
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


def flag_aliases(cls: type) -> dict[str, str]:
    """Keyword name -> field name for the fields whose flag is spelled otherwise (``hookpoint`` -> ``hookpoints``)."""
    return {f.metadata["flag"].replace("-", "_"): f.name for f in dataclasses.fields(cls)
            if f.metadata.get("flag") and f.metadata["flag"].replace("-", "_") != f.name}


def canonical_keys(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with flag spellings (``hookpoint``, ``label-column``) renamed to ``cls``'s field names."""
    aliases = flag_aliases(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(key.replace("-", "_"), key.replace("-", "_") if "-" in key else key)
        if name in out:
            raise ConfigError(f"{key!r} and {name!r} name the same setting; give one of them")
        out[name] = value
    return out


def config_from_dict(cls: type, data: dict[str, Any], where: str = "config") -> Any:
    """Build dataclass ``cls`` from a plain dict, strictly (unknown keys are errors naming the closest key); keys
    may be the field names or their flags' names."""
    data = canonical_keys(cls, data)
    check_keys(data, cls, where)
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        tp, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = config_from_dict(tp, value, f"{where}.{f.name}")
        else:
            value = _coerce(tp, value, f.name, where, f.metadata.get("min"))
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{where} needs {', '.join(missing)}") from None
        raise ConfigError(f"{where}: {e}") from None


def split_settings(data: dict[str, Any], *classes: type, where: str) -> list[dict[str, Any]]:
    """``data`` split by which of ``classes`` has a field of that name (the first one that has it); a key none of
    them has is a :class:`ConfigError` naming the closest key of all of them."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    names = [[f.name for f in dataclasses.fields(c)] + list(flag_aliases(c)) for c in classes]
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


def parse_field_values(cls: type, spec: str, flag: str) -> tuple[str, list[Any]]:
    """``FIELD=V1,V2,...`` -> (field, the values typed as ``cls``'s field), for settings such as ``sweep``;
    an unknown field names the closest one, a bad value names the field and its type."""
    name, sep, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values.strip():
        raise ConfigError(f"{flag} {spec!r}: write FIELD=V1,V2,... (e.g. {flag} k=16,32)")
    check_keys({name: None}, cls, flag)
    tp, optional = unwrap_optional(type_hints(cls)[name])
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
