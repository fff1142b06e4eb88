"""Flat names for the settings of a training run: users type ``--l0-coeff 2 --kind jumprelu``, config files and
train_config.json hold flat keys, but a :class:`TrainConfig` keeps a kind's own settings in ``settings`` (the
kind's dataclass, saes/kinds/). :func:`train_config` builds one from flat names, :func:`to_flat` is its inverse,
and :func:`flat_train_fields` lists every flat name with its type, default, help and the kinds that read it (the
command line's flags are generated from it)."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import typing
from typing import Any, Literal, NamedTuple, TypedDict

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


class TrainingSettings(TypedDict, total=False):
    """The training settings as keywords of ``cd.train`` and ``cd.diff`` (what :func:`flat_train_fields` lists, a
    kind's own ones after the shared ones; each one's help is in ``help(cd.train)`` and ``conceptdict train
    --help-all``). Omitted: the default, which may depend on the kind and the data. ``conceptdict.settings.
    takes_settings`` checks at import that these keys are exactly the flat settings."""

    latents: int
    k: int
    kind: str
    tokens: int | None
    batch_size: int | None
    lr: float | None
    warmup_steps: int | None
    decay_fraction: float
    grad_clip: float
    normalize: bool
    b_dec_init: Literal["geometric_median", "mean", "zero"]
    init_rows: int
    aux_k: int | None
    aux_alpha: float | None
    dead_tokens: int | None
    code_l1: float | None
    topk_start: float | None
    calibration_batches: int | None
    eval_batches: int | None
    stop_patience: int | None
    stop_threshold: float
    stop_every: int | None
    eval_every: int
    metrics: list[str]
    eval_contexts: int
    seed: int
    checkpoint_every: int
    log_every: int
    log: str | None
    kernel_impl: str
    device: str
    precision: Literal["auto", "float32", "bf16", "fp16", "float64"]
    d_in: int | None
    latent_shards: int
    single_file_gib: float
    threshold_start_step: int | None
    threshold_momentum: float
    l1_coeff: float
    l0_coeff: float
    jumprelu_penalty: Literal["target", "linear"]
    jumprelu_bandwidth: float
    sparsity_warmup_steps: int | None
    matryoshka_groups: list[int] | None
    matryoshka_inner_weight: float
    spade_coeff: float


def sweep_configs(base: TrainConfig, grid: dict[str, list[Any]]) -> list[tuple[str, TrainConfig]]:
    """One config per combination of ``grid``'s values (flat field -> values, as ``saes.train_config`` names them;
    the cartesian product, first field outermost), each named ``field-value_field-value`` (its output folder). A
    point of another kind keeps the base's settings that kind reads. Every config is checked as
    :class:`TrainConfig` checks one, so a bad combination (k >= latents) names itself."""
    names = list(grid)
    flat = to_flat(base)
    out = []
    for values in itertools.product(*(grid[n] for n in names)):
        name = "_".join(f"{n}-{v}" for n, v in zip(names, values))
        point = dict(zip(names, values))
        try:
            out.append((name, train_config(**{**flat_for_kind(flat, point.get("kind", base.kind)), **point})))
        except ValueError as e:
            raise ValueError(f"sweep point {name}: {e}") from None
    return out


__all__ = ["FlatField", "TrainingSettings", "sweep_configs", "flat_for_kind", "flat_train_fields", "to_flat", "train_config"]
