"""Config dataclasses -> argparse flags, and flags (+ a JSON config file) -> the keyword settings of an API call.

Field ``context_length`` becomes ``--context-length``; a nested dataclass field ``sae`` with field ``k`` becomes
``--sae.k``; a ``list[...]`` field is repeatable and uses ``metadata["flag"]`` as its name when given (field
``hookpoints`` -> ``--hookpoint``). Help text is the field's ``metadata["help"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from conceptdict.settings import (
    ConfigError,
    check_keys,
    config_from_dict,
    field_help,
    merge,
    parse_bool,
    read_config_file,
    scalar_parser,
    type_hints,
    unwrap_optional,
    write_resolved_config,
)

__all__ = ["ConfigError", "add_config_flag", "add_dataclass_args", "build_config", "settings_from",
           "write_resolved_config"]


def _flag_name(f: dataclasses.Field, prefix: str) -> str:
    return f"--{prefix}{f.metadata.get('flag', f.name.replace('_', '-'))}"


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def add_dataclass_args(parser, cls: type, prefix: str = "", skip: typing.Collection[str] = ()) -> None:
    """Add one flag per field of ``cls``. Defaults stay unset (None), so that a config file can fill them and the
    API applies the dataclass's own defaults."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, prefix=f"{prefix}{f.name}.")
            continue
        help_text = field_help(f)
        default = _default_of(f)
        if default is not dataclasses.MISSING and default is not None and not isinstance(default, (list, dict)):
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f"{prefix}{f.name}".replace(".", "__"), "default": None,
                                  "help": help_text.replace("%", "%%")}
        origin = get_origin(tp)
        if origin is Literal:
            kwargs["choices"] = list(get_args(tp))
            kwargs["type"] = type(get_args(tp)[0])
            kwargs["metavar"] = "{" + ",".join(map(str, get_args(tp))) + "}"
        elif origin in (list, tuple):
            (item,) = get_args(tp)[:1] or (str,)
            kwargs["action"] = "append"
            kwargs["type"] = scalar_parser(item)
        elif tp is bool:
            kwargs.update(type=parse_bool, nargs="?", const=True, metavar="BOOL")
        else:
            kwargs["type"] = scalar_parser(tp)
        if "metavar" not in kwargs:
            kwargs["metavar"] = _metavar(tp if origin not in (list, tuple) else (get_args(tp) or (str,))[0], f.name)
        parser.add_argument(_flag_name(f, prefix), **kwargs)


def _metavar(tp: Any, name: str) -> str:
    """A short placeholder, so that most flags and their help fit on one line of ``--help``."""
    if tp is int:
        return "N"
    if tp is float:
        return "X"
    if tp is Path:
        return "PATH"
    return name.upper() if len(name) <= 8 else "S"


def add_config_flag(parser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="JSON file of settings (flags override it)")


def _given(ns: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The flags of ``cls``'s fields that were given, as {field: value} (nested dataclasses as dicts)."""
    hints = type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            sub = _given(ns, tp, prefix=f"{prefix}{f.name}.")
            if sub:
                out[f.name] = sub
            continue
        value = getattr(ns, f"{prefix}{f.name}".replace(".", "__"), None)
        if value is not None:
            out[f.name] = value
    return out


def settings_from(ns: argparse.Namespace, *classes: type) -> dict[str, Any]:
    """The keyword settings of an API call: the config file's (``--config``, checked against ``classes``), with the
    flags that were given on top."""
    data: dict[str, Any] = {}
    config_file = getattr(ns, "config", None)
    if config_file is not None:
        data = read_config_file(config_file)
        _check_file_keys(data, classes, str(config_file))
    for cls in classes:
        data = merge(data, _given(ns, cls))
    return data


def _check_file_keys(data: dict[str, Any], classes: tuple[type, ...], where: str) -> None:
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = {k: v for k, v in data.items() if k not in known}
    if unknown:
        check_keys(unknown, classes[-1], where)  # names the closest key of the main settings


def build_config(cls: type, ns: argparse.Namespace, config_file: Path | None = None) -> Any:
    """Flags over config file over dataclass defaults -> an instance of ``cls``."""
    data: dict[str, Any] = {}
    if config_file is not None:
        data = read_config_file(config_file)
        check_keys(data, cls, str(config_file))
    return config_from_dict(cls, merge(data, _given(ns, cls)))
