"""Stage configs -> argparse, and strict config files.

Every stage owns one small config dataclass with a docstring under each field (the sparsify style).
This module turns such a dataclass into command-line flags whose help text is that docstring, and
reads JSON config files strictly: an unknown key is an error naming the closest valid key.

Naming: field ``context_length`` becomes ``--context-length``; a nested dataclass field ``sae`` with
field ``k`` becomes ``--sae.k``. A field of type ``list[...]`` is repeatable (``--hookpoint A --hookpoint B``);
its flag uses the field's ``metadata["flag"]`` when given (e.g. field ``hookpoints`` -> ``--hookpoint``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A config file or flag value that cannot be used; the message says the fix."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass ``cls`` (and its bases) to the docstring written under it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _flag_name(f: dataclasses.Field, prefix: str) -> str:
    name = f.metadata.get("flag", f.name.replace("_", "-"))
    return f"--{prefix}{name}"


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_dataclass_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    prefix: str = "",
    skip: typing.Collection[str] = (),
) -> None:
    """Add one flag per field of ``cls`` to ``parser``. Defaults stay unset (None) so that a config
    file can fill them; :func:`build_config` applies flags over file over dataclass defaults."""
    docs = field_docs(cls)
    hints = _resolved_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        dest = f"{prefix}{f.name}".replace(".", "__")
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, prefix=f"{prefix}{f.name}.")
            continue
        help_text = f.metadata.get("help") or docs.get(f.name, "")
        default = f.metadata.get("default", _default_of(f))
        if default is not dataclasses.MISSING and not isinstance(default, (list, dict)):
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": help_text.replace("%", "%%")}
        origin = get_origin(tp)
        if origin is Literal:
            kwargs["choices"] = list(get_args(tp))
            kwargs["type"] = type(get_args(tp)[0])
        elif origin in (list, tuple):
            (item,) = get_args(tp)[:1] or (str,)
            kwargs["action"] = "append"
            kwargs["type"] = _scalar_parser(item)
        elif tp is bool:
            kwargs["type"] = _parse_bool
            kwargs["nargs"] = "?"
            kwargs["const"] = True
            kwargs["metavar"] = "BOOL"
        else:
            kwargs["type"] = _scalar_parser(tp)
        parser.add_argument(_flag_name(f, prefix), **kwargs)


def _scalar_parser(tp: Any):
    if tp is Path:
        return Path
    if tp in (int, float, str):
        return tp
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    return str


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _values_from_namespace(ns: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    hints = _resolved_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub = _values_from_namespace(ns, tp, prefix=f"{prefix}{f.name}.")
            if sub:
                out[f.name] = sub
            continue
        dest = f"{prefix}{f.name}".replace(".", "__")
        value = getattr(ns, dest, None)
        if value is not None:
            out[f.name] = value
    return out


def check_keys(data: dict[str, Any], cls: type, where: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` that ``cls`` has no field for."""
    names = [f.name for f in dataclasses.fields(cls)]
    hints = _resolved_hints(cls)
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {key!r} in {where}: {hint}")
        tp, _ = _unwrap_optional(hints[key])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            check_keys(value, tp, f"{where}.{key}")


def config_from_dict(cls: type, data: dict[str, Any], where: str = "config") -> Any:
    """Build dataclass ``cls`` from a plain dict, strictly (unknown keys are errors)."""
    check_keys(data, cls, where)
    hints = _resolved_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        tp, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = config_from_dict(tp, value, f"{where}.{f.name}")
        elif tp is Path and value is not None:
            value = Path(value)
        elif get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
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


def build_config(cls: type, ns: argparse.Namespace, config_file: Path | None = None) -> Any:
    """Flags over config file over dataclass defaults -> an instance of ``cls``."""
    data: dict[str, Any] = {}
    if config_file is not None:
        data = read_config_file(config_file)
        check_keys(data, cls, str(config_file))
    data = _merge(data, _values_from_namespace(ns, cls))
    return config_from_dict(cls, data)


def train_flags() -> type:
    """The flat training settings (``saes.flat_train_fields``) as a dataclass of optional fields, for the flags
    and ``--config`` files of ``conceptdict train`` / ``diff``; unset ones stay None (the kind's defaults)."""
    from conceptdict.saes import flat_train_fields

    def flag(f):
        kinds = f"{', '.join(f.kinds)}: " if f.kinds else ""
        meta = {"help": kinds + f.help, **({} if f.default is dataclasses.MISSING else {"default": f.default})}
        return f.name, f.type, dataclasses.field(default=None, metadata=meta)

    return dataclasses.make_dataclass("TrainFlags", [flag(f) for f in flat_train_fields()])


def train_config_from_flags(ns: argparse.Namespace, config_file: Path | None = None) -> Any:
    """``saes.train_config`` of the flags over ``config_file`` (flat keys): the settings given, and no others."""
    from conceptdict.saes import train_config

    flags = build_config(train_flags(), ns, config_file)
    return train_config(**{k: v for k, v in dataclasses.asdict(flags).items() if v is not None})


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
    """``FIELD=V1,V2,...`` -> (field, the values typed as ``cls``'s field), for flags such as ``--sweep``;
    an unknown field names the closest one, a bad value names the field and its type."""
    name, sep, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values.strip():
        raise ConfigError(f"{flag} {spec!r}: write FIELD=V1,V2,... (e.g. {flag} k=16,32)")
    check_keys({name: None}, cls, flag)
    tp, optional = _unwrap_optional(_resolved_hints(cls)[name])
    if tp not in (int, float, str, bool) and get_origin(tp) is not Literal:
        raise ConfigError(f"{flag} {name}: only fields holding one number or word can be swept")
    parse = _parse_bool if tp is bool else _scalar_parser(tp)
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
