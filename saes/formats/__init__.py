"""One loader for every dictionary a command is given: this project's own and other libraries'.

:func:`open_dictionary` recognises, by the files present and their headers, in this order:

- ``conceptdict``: ``config.json`` with ``format: conceptdict-dictionary`` + ``weights.safetensors``;
- ``saelens``: ``cfg.json`` with ``d_sae`` + ``sae_weights.safetensors`` (``saes.formats.saelens``);
- ``sparsify``: ``cfg.json`` + ``sae.safetensors`` (``saes.formats.sparsify``);
- ``dictionary-learning``: ``ae.pt`` + ``config.json`` (``saes.formats.dictlearn``);
- ``gemma-scope``: ``params.npz`` (``saes.formats.gemmascope``);
- ``circuit-tracer``: ``config.yaml`` with ``model_kind`` (a cross-layer transcoder's folder, or one
  ``layer_N.safetensors`` of a transcoder set; ``saes.formats.circuit_tracer``);

``hf:REPO[/SUBDIR][@REVISION]`` names (``saes.formats.hub``) and ``RELEASE/SAE_ID`` release names
(``gpt2-small-res-jb/blocks.8.hook_resid_pre``, ``saes.formats.releases``). A directory whose only recognisable content
is one subfolder per hookpoint (sparsify's and SAELens releases' layout) is read when there is exactly one such
subfolder, and otherwise the error lists them. Foreign dictionaries come back with a config shaped like the
native ``config.json`` whose ``hookpoints`` holds this project's name for the foreign hookpoint
(``saes.formats.hookpoints``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import circuit_tracer, dictlearn, gemmascope, hub, native, releases, saelens, sparsify
from ..kinds import KINDS
from .common import Loaded
from .export import WRITERS
from .files import FormatError
from .hookpoints import match_hookpoint

FORMATS: dict[str, ModuleType] = {"conceptdict": native, "saelens": saelens, "sparsify": sparsify,
                                  "dictionary-learning": dictlearn, "gemma-scope": gemmascope,
                                  "circuit-tracer": circuit_tracer}
"""format name -> module with ``NEEDS`` (what it reads), ``matches(dir) -> bool`` and ``read(dir) -> Loaded``. The
writers' table, of the layouts ``conceptdict export`` writes, is :data:`WRITERS` (``saes.formats.export``)."""


def detect_format(directory: Path) -> str | None:
    """The name of the first format whose files are in ``directory``, else None."""
    return next((name for name, fmt in FORMATS.items() if fmt.matches(directory)), None)


def _unknown(directory: Path) -> FormatError:
    tried = "; ".join(f"{name} needs {fmt.NEEDS}" for name, fmt in FORMATS.items())
    present = sorted(p.name for p in directory.iterdir())[:12] if directory.is_dir() else []
    return FormatError(f"{directory} is not a dictionary in any format conceptdict reads (it holds {present}). "
                       f"Tried: {tried}")


def locate(source: str | Path) -> tuple[Path, str]:
    """(directory, format) of ``source``: a hub name is resolved first; one recognisable subfolder is entered."""
    directory = hub.resolve(str(source)) if hub.is_hub_name(source) else Path(source)
    if not directory.exists() and releases.looks_like_release(str(source)):  # RELEASE/SAE_ID
        directory = hub.resolve(releases.resolve(str(source), *releases.directory()))
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist: pass a dictionary directory (or hf:REPO[/SUBDIR])")
    fmt = detect_format(directory)
    if fmt is not None:
        return directory, fmt
    subs = sorted(p for p in directory.iterdir() if p.is_dir() and detect_format(p)) if directory.is_dir() else []
    if len(subs) == 1:
        return subs[0], detect_format(subs[0])  # type: ignore[return-value]
    if subs:
        raise FormatError(f"{directory} holds {len(subs)} dictionaries, one per hookpoint: "
                          f"{', '.join(str(p) for p in subs[:8])}{' ...' if len(subs) > 8 else ''}; pass one of them")
    raise _unknown(directory)


def open_dictionary(source: str | Path, device: str | torch.device = "cpu", lazy: bool | None = False) -> Loaded:
    """The dictionary at ``source`` (a directory in any format of :data:`FORMATS`, or ``hf:...``) and its config.
    ``lazy``: True, a :class:`~saes.lazy.LazyDictionary` (this project's layout; its weights read a block of latents
    at a time); None, lazily when loading it whole would not fit in this process's memory (``saes.lazy.reads_lazily``),
    whole otherwise."""
    from ..lazy import open_lazy, reads_lazily

    directory, fmt = locate(source)
    if lazy or (lazy is None and fmt == "conceptdict" and reads_lazily(directory)):
        if fmt != "conceptdict":
            raise FormatError(f"{directory} is a {fmt} dictionary; only conceptdict's own layout is read lazily: load "
                              f"it whole (lazy=False), or save it in conceptdict's layout first")
        lazy_model = open_lazy(directory, device)
        return Loaded(lazy_model, lazy_model.config)  # type: ignore[arg-type]
    loaded = FORMATS[fmt].read(directory)
    check_finite(loaded.model, f"{fmt} dictionary {directory}")
    return Loaded(loaded.model.to(device).eval(), loaded.config)


def check_finite(model: torch.nn.Module, where: str) -> None:
    """Every weight of a loaded dictionary is finite; raise FormatError naming the tensor (a NaN in W_enc makes every
    figure computed from it NaN, silently)."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise FormatError(f"the {where} holds {count} NaN/Inf value(s) in {name}: its file is damaged or its "
                              "training diverged; retrain it (or restore the file)")


def transcoder_set(path: str | Path) -> list[Path]:
    """The per-layer transcoders in ``path`` (``conceptdict train --layers``: OUT/LAYER, conceptdict's format), ordered
    by layer; [] when ``path`` is a dictionary itself or holds anything else."""
    if hub.is_hub_name(path) or not Path(path).is_dir() or detect_format(Path(path)) is not None:
        return []
    subs = sorted((p for p in Path(path).iterdir() if p.name.isdigit() and native.matches(p)), key=lambda p: int(p.name))
    specs = [KINDS.get(native.read_config(p).get("kind")) for p in subs]
    return subs if subs and all(s is not None and s.transcodes and not s.layered for s in specs) else []


def load_dictionary(source: str | Path, device: str | torch.device = "cpu"):
    """The SparseCoder at ``source`` (any format; see the module docstring)."""
    return open_dictionary(source, device).model


def load_dictionary_config(source: str | Path) -> dict[str, Any]:
    """The config of the dictionary at ``source``: its config.json for our format, an equivalent dict otherwise."""
    directory, fmt = locate(source)
    if fmt == "conceptdict":
        return native.read_config(directory)
    return FORMATS[fmt].read(directory).config


def config_file(source: str | Path) -> str:
    """Where the dictionary at ``source`` keeps its settings, for messages: ``DIR/cfg.json (saelens format)``
    (a format without a config file names its weights file)."""
    directory, fmt = locate(source)
    module = FORMATS[fmt]
    name = getattr(module, "CONFIG", None) or getattr(module, "CONFIG_FILE", None) or module.WEIGHTS
    return f"{directory / name} ({fmt} format)"


def export_saelens(model, directory: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """SAELens ``cfg.json`` + ``sae_weights.safetensors`` (``saes.formats.saelens.write``)."""
    return saelens.write(model, Path(directory), meta)


def import_saelens(directory: str | Path):
    """The SparseCoder of a SAELens directory (``saes.formats.saelens.read``)."""
    return saelens.read(Path(directory)).model


__all__ = ["FORMATS", "WRITERS", "FormatError", "Loaded", "config_file", "detect_format", "export_saelens", "import_saelens",
           "transcoder_set",
           "load_dictionary",
           "load_dictionary_config", "locate", "match_hookpoint", "open_dictionary"]
