"""Flat names for the settings of a training run: users type ``--l0-coeff 2 --kind jumprelu``, config files and
train_config.json hold flat keys, but a :class:`TrainConfig` keeps a kind's own settings in ``settings`` (the
kind's dataclass, saes/kinds/). :func:`train_config` builds one from flat names, :func:`to_flat` is its inverse,
and :func:`flat_train_fields` lists every flat name with its type, default, help and the kinds that read it (the
command line's flags are generated from it)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, NamedTuple

from .config import TrainConfig
from .kinds import KINDS, kind_spec


class FlatField(NamedTuple):
    """One flat setting."""

    name: str
    type: Any
    """The resolved type annotation (e.g. ``int | None``, ``Literal["target", "linear"]``)."""
    default: Any
    """The default; ``dataclasses.MISSING`` for the required fields (latents, k)."""
    help: str
    """One or two sentences (the field's ``metadata["help"]``)."""
    kinds: tuple[str, ...] | None
    """The kinds that read it; None for the fields every kind shares."""
    minimum: float | None = None
    """The smallest value it takes (the field's ``metadata["min"]``), checked where settings are read."""


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _entry(f: dataclasses.Field, hints: dict[str, Any], kinds: tuple[str, ...] | None, owner: str) -> FlatField:
    if not f.metadata.get("help"):
        raise ValueError(f"{owner}.{f.name} has no help: declare it as field(default=..., metadata={{'help': ...}})")
    return FlatField(f.name, hints[f.name], _default(f), f.metadata["help"], kinds, f.metadata.get("min"))


def flat_train_fields() -> list[FlatField]:
    """Every flat setting in a stable order: TrainConfig's shared fields in their order, then the kinds' own
    settings in the registry's order (a setting several kinds read appears once, with all of them). Raises
    ValueError where two kinds declare one name with different types or defaults, or a kind's setting takes a
    shared field's name."""
    hints = typing.get_type_hints(TrainConfig)
    out = [_entry(f, hints, None, "TrainConfig") for f in dataclasses.fields(TrainConfig) if f.name != "settings"]
    shared = {f.name for f in out}
    own: dict[str, FlatField] = {}
    for name, spec in KINDS.items():
        if spec.settings is None:
            continue
        hints = typing.get_type_hints(spec.settings)
        for f in dataclasses.fields(spec.settings):
            entry = _entry(f, hints, (name,), spec.settings.__name__)
            if f.name in shared:
                raise ValueError(f"kind {name!r}: its setting {f.name!r} has the name of a shared TrainConfig field")
            prev = own.get(f.name)
            if prev is not None and (prev.type != entry.type or prev.default != entry.default):
                raise ValueError(f"setting {f.name!r} is declared by kinds {list(prev.kinds)} and {name!r} with "
                                 f"different types or defaults ({prev.type}={prev.default!r}, "
                                 f"{entry.type}={entry.default!r}); give it one meaning or another name")
            own[f.name] = entry if prev is None else prev._replace(kinds=(*prev.kinds, name))
    return out + list(own.values())


def _own_names(kind: str) -> set[str]:
    spec = kind_spec(kind)
    return {f.name for f in dataclasses.fields(spec.settings)} if spec.settings is not None else set()


def flat_for_kind(flat: dict[str, Any], kind: str) -> dict[str, Any]:
    """The entries of ``flat`` that a run of ``kind`` reads: the shared fields and ``kind``'s own settings, without
    other kinds' settings (unknown keys stay, for :func:`train_config` to name)."""
    other = {f.name for f in flat_train_fields() if f.kinds is not None} - _own_names(kind)
    return {key: value for key, value in flat.items() if key not in other}


def train_config(**flat: Any) -> TrainConfig:
    """A :class:`TrainConfig` from flat names (every field TrainConfig had before kinds owned their settings):
    the shared ones as they are, the chosen kind's own in its ``settings`` (None when none is given: its defaults).
    A setting of another kind, or an unknown name (the closest valid one is named), is a ValueError."""
    kind = flat.get("kind", "topk")
    spec = kind_spec(kind)
    table = {f.name: f for f in flat_train_fields()}
    mine = _own_names(kind)
    shared, own = {}, {}
    for key, value in flat.items():
        entry = table.get(key)
        if entry is None:
            close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(table)}"
            raise ValueError(f"unknown training setting {key!r}: {hint}")
        if entry.kinds is None:
            shared[key] = value
        elif key in mine:
            own[key] = value
        else:
            raise ValueError(f"{key} is a setting of {', '.join(entry.kinds)}; kind {kind!r} does not read it: drop "
                             f"it or choose one of those kinds")
    return TrainConfig(**shared, settings=spec.settings(**own) if own else None)


def to_flat(cfg: TrainConfig, every_kind: bool = False) -> dict[str, Any]:
    """``cfg`` as flat names, the inverse of :func:`train_config`: the shared fields and the kind's own settings
    (at their defaults when ``settings`` is None). ``every_kind``: also every other kind's settings at their
    defaults, the complete flat record that checkpoints and config.json's ``training.config`` keep."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "settings"}
    if every_kind:
        out.update({f.name: f.default for f in flat_train_fields() if f.kinds is not None})
    settings = cfg.kind_settings
    if settings is not None:
        out.update(dataclasses.asdict(settings))
    return out


__all__ = ["FlatField", "flat_for_kind", "flat_train_fields", "to_flat", "train_config"]
