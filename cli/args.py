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
    merge,
    parse_bool,
    read_config_file,
    scalar_parser,
    settings_of,
    unwrap_optional,
    write_resolved_config,
)

__all__ = ["ConfigError", "add_config_flag", "add_dataclass_args", "add_train_settings", "build_config", "settings_from",
           "write_resolved_config"]

HELP_ALL = "--help-all"
SHOW_ALL = False
"""True when the command line asked for ``--help-all``: every flag's help, not only the common ones'."""


def add_dataclass_args(parser, cls, prefix: str = "", skip: typing.Collection[str] = (),
                       brief: typing.Collection[str] | None = None) -> list[str]:
    """Add one flag per setting of ``cls`` (a config dataclass or a table of ``settings.Setting``). Defaults stay
    unset (None), so that a config file can fill them and the API applies the settings' own defaults. With
    ``brief``, ``--help`` describes only those settings (every flag still works; ``--help-all`` describes all);
    returns the flags it left undescribed."""
    hidden: list[str] = []
    for s in settings_of(cls):
        if s.name in skip:
            continue
        tp, _ = unwrap_optional(s.type)
        if dataclasses.is_dataclass(tp):
            add_dataclass_args(parser, tp, prefix=f"{prefix}{s.name}.")
            continue
        flag = f"--{prefix}{s.flag or s.name.replace('_', '-')}"
        help_text = s.help
        quiet = brief is not None and s.name not in brief and not SHOW_ALL
        default = s.default if s.shown_default is dataclasses.MISSING else s.shown_default
        if default is not dataclasses.MISSING and default not in (None, False) and not isinstance(default, (list, dict)):
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f"{prefix}{s.name}".replace(".", "__"), "default": None,
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
            kwargs["metavar"] = _metavar(tp if origin not in (list, tuple) else (get_args(tp) or (str,))[0], s.name)
        parser.add_argument(flag, **kwargs)
        if quiet:
            hidden.append(flag)
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
    kinds = {s.name: s.kinds for s in cls}
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


def _given(ns: argparse.Namespace, cls, prefix: str = "") -> dict[str, Any]:
    """The flags of ``cls``'s settings that were given, as {keyword: value} (the flag's name, as the Python API
    spells it: ``hookpoint``, not the field ``hookpoints``; nested dataclasses as dicts)."""
    out: dict[str, Any] = {}
    for s in settings_of(cls):
        tp, _ = unwrap_optional(s.type)
        if dataclasses.is_dataclass(tp):
            sub = _given(ns, tp, prefix=f"{prefix}{s.name}.")
            if sub:
                out[s.name] = sub
            continue
        value = getattr(ns, f"{prefix}{s.name}".replace(".", "__"), None)
        if value is not None:
            out[s.keyword if not prefix else s.name] = value
    return out


def settings_from(ns: argparse.Namespace, *classes: type) -> dict[str, Any]:
    """The keyword settings of an API call: the config file's (``--config``, checked against ``classes``), with the
    flags that were given on top."""
    data: dict[str, Any] = {}
    config_file = getattr(ns, "config", None)
    if config_file is not None:
        data = read_config_file(config_file)
        _check_file_keys(data, classes, str(config_file))
        for cls in classes:  # a file may spell a setting as its field (hookpoints): as the flags do (hookpoint)
            spelled = {s.name: s.keyword for s in settings_of(cls)}
            data = {spelled.get(k, k): v for k, v in data.items()}
    for cls in classes:
        data = merge(data, _given(ns, cls))
    if getattr(ns, "overwrite", False):  # the --out guard's opt-in, on every command that writes a directory
        data["overwrite"] = True
    return data


def _check_file_keys(data: dict[str, Any], classes: tuple[type, ...], where: str) -> None:
    known = {n for cls in classes for s in settings_of(cls) for n in (s.name, s.keyword)}
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
