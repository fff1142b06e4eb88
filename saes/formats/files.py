"""Reading weight files without trusting them: safetensors, ``torch.load(weights_only=True)`` and ``.npz``.

Each reader turns the library's low-level exception into one line that names the file, what is wrong with it
and what to do. Nothing here ever unpickles arbitrary Python objects.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..files import CorruptFileError


class FormatError(CorruptFileError):
    """A dictionary directory or weight file that cannot be read as what it claims to be."""


def _sniff(path: Path) -> str:
    with path.open("rb") as fh:
        head = fh.read(4)
    if head[:2] == b"PK":
        return "a zip archive (a torch.save or numpy .npz file)"
    if head[:1] == b"\x80":
        return "a Python pickle"
    return "neither safetensors nor a known weight format"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; the error names the file and the parse position."""
    if not path.exists():
        raise FormatError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path} is not valid JSON ({e}); restore the file from its source") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return JsonFile(data, path=path)


class JsonFile(dict):
    """A JSON object read from ``path``: a key it lacks is a FormatError naming the file (not a bare KeyError)."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        super().__init__(data)
        self.path = path

    def __missing__(self, key: str) -> Any:
        raise FormatError(f"{self.path} lacks the key {key!r}; the file is damaged or written by a tool conceptdict "
                          "does not read; restore it from its source")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as stored (dtype unchanged)."""
    if not path.exists():
        raise FormatError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}
    except (SafetensorError, OSError, RuntimeError) as e:
        size = path.stat().st_size
        what = _sniff(path)
        if what.startswith("neither"):
            raise FormatError(f"{path} is not a readable safetensors file ({e}; {size} bytes): it is truncated or "
                              f"corrupt; download or copy it again") from None
        raise FormatError(f"{path} should be safetensors but is {what}; conceptdict never unpickles weights: "
                          f"convert it with safetensors.torch.save_file in an environment you trust") from None


def read_torch_state(path: Path) -> dict[str, torch.Tensor]:
    """A state dict saved with ``torch.save``, read with ``weights_only=True`` (tensors and plain containers
    only; a file that needs other Python objects is refused rather than unpickled)."""
    if not path.exists():
        raise FormatError(f"{path} does not exist")
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise FormatError(f"{path} holds Python objects other than tensors, which conceptdict will not unpickle "
                          f"({str(e).splitlines()[0][:200]}); re-save its state_dict() with torch.save") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise FormatError(f"{path} could not be read as a torch.save file ({str(e).splitlines()[0][:200]}): it "
                          f"is truncated or corrupt; download or copy it again") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FormatError(f"{path} does not hold a state dict of tensors (got {type(state).__name__}); save "
                          f"model.state_dict() instead")
    return state


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    """Every array of a ``.npz`` file (``allow_pickle=False``) as torch tensors."""
    if not path.exists():
        raise FormatError(f"{path} does not exist")
    try:
        with np.load(str(path), allow_pickle=False) as data:
            return {k: torch.from_numpy(np.array(data[k])) for k in data.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise FormatError(f"{path} could not be read as a .npz archive of plain arrays "
                          f"({str(e).splitlines()[0][:200]}): it is truncated, corrupt or pickled") from None


def expect_shapes(path: Path, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                  config: Path) -> None:
    """Raise naming both files when a tensor is missing or its shape disagrees with the config."""
    for name, shape in shapes.items():
        if name not in tensors:
            raise FormatError(f"{path} has no tensor {name!r} (it holds {sorted(tensors)}), which {config.name} "
                              f"requires; the weights and {config} do not belong together")
        if tuple(tensors[name].shape) != tuple(shape):
            raise FormatError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)} but {config} implies "
                              f"{list(shape)}; the config and the weights disagree")
