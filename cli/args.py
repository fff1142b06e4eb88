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

__all__ = ["ConfigError", "add_config_flag", "add_dataclass_args", "add_train_settings", "build_config", "settings_from",
           "write_resolved_config"]

HELP_ALL = "--help-all"
SHOW_ALL = False
"""True when the command line asked for ``--help-all``: every flag's help, not only the common ones'."""


def _flag_name(f: dataclasses.Field, prefix: str) -> str:
    return f"--{prefix}{f.metadata.get('flag', f.name.replace('_', '-'))}"


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def add_dataclass_args(parser, cls: type, prefix: str = "", skip: typing.Collection[str] = (),
                       brief: typing.Collection[str] | None = None) -> list[str]:
    """Add one flag per field of ``cls``. Defaults stay unset (None), so that a config file can fill them and the
    API applies the dataclass's own defaults. With ``brief``, ``--help`` describes only those fields (every flag
    still works; ``--help-all`` describes all); returns the flags it left undescribed."""
    hidden: list[str] = []
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, prefix=f"{prefix}{f.name}.")
            continue
        help_text = field_help(f)
        quiet = brief is not None and f.name not in brief and not SHOW_ALL
        default = f.metadata.get("default", _default_of(f))
        if default is not dataclasses.MISSING and default not in (None, False) and not isinstance(default, (list, dict)):
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f"{prefix}{f.name}".replace(".", "__"), "default": None,
                                  "help": argparse.SUPPRESS if quiet else help_text.replace("%", "%%")}
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
        if quiet:
            hidden.append(_flag_name(f, prefix))
    return hidden


def _metavar(tp: Any, name: str) -> str:
    """A short placeholder, so that most flags and their help fit on one line of ``--help``."""
    if tp is int:
        return "N"
    if tp is float:
        return "X"
    if tp is Path:
        return "PATH"
    return name.upper() if len(name) <= 8 else "S"


BRIEF = ("latents", "k", "kind", "tokens", "batch_size", "lr", "seed", "device", "eval_batches", "calibration_batches",
         "model", "dataset")
"""The training settings ``--help`` describes; ``--help-all`` describes every one (docs/guide/train.md)."""


def add_train_settings(parser, skip: typing.Collection[str] = ()) -> None:
    """The dictionary's settings (``conceptdict train`` and ``diff``): the common ones described, the others listed
    by name, a kind's own settings with the kinds that read them (``--help-all``: every one described)."""
    from conceptdict.train_api import train_settings

    cls = train_settings()
    kinds = {f.name: f.metadata.get("kinds") for f in dataclasses.fields(cls)}
    group = parser.add_argument_group("the dictionary")
    more = add_dataclass_args(group, cls, skip=[*skip, *(n for n, k in kinds.items() if k)], brief=BRIEF)
    if more:
        group.description = f"also: {' '.join(more)}"
    own = parser.add_argument_group("kind settings")
    listed = add_dataclass_args(own, cls, skip=[*skip, *(n for n, k in kinds.items() if not k)], brief=())
    by_kinds: dict[tuple, list[str]] = {}
    for flag in listed:
        by_kinds.setdefault(kinds[flag[2:].replace("-", "_")], []).append(flag)
    if by_kinds:
        own.description = "; ".join(f"{', '.join(k)}: {' '.join(flags)}" for k, flags in by_kinds.items())


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
    if getattr(ns, "overwrite", False):  # the --out guard's opt-in, on every command that writes a directory
        data["overwrite"] = True
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
