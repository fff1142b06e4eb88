"""A store's true features: the directions its rows were built from and (optionally) which fired on each row.

Synthetic stores (planted atoms, SynthSAEBench worlds) know the features that made their rows; ``conceptdict store
import ARRAY --true-features F.npy [--true-codes C.npy]`` keeps them beside the shards as
``true_features.safetensors`` and names the file in the manifest (``manifest["true_features"]``):

    directions   [F, D] float32  one true feature per row (its direction in the store's row space)
    code_rows    [nnz] int64     \\
    code_cols    [nnz] int64      } the per-row feature activations [N, F], kept sparse (only the non-zeros)
    code_values  [nnz] float32   /

Without codes, only the decoder-side scores (MCC, uniqueness) can be computed; precision / recall / F1 of a latent
as a detector of its feature need to know which features fired on each row.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FILE = "true_features.safetensors"


class TrueFeatures(NamedTuple):
    """The true features of a store: ``directions`` [F, D] and, when recorded, the sparse codes of its rows."""

    directions: torch.Tensor
    codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(row, feature, value) of every non-zero feature activation, or None when the store does not record them."""
    num_rows: int

    def codes_of(self, start: int, stop: int) -> torch.Tensor:
        """Dense feature activations [stop - start, F] of rows ``start:stop`` (refuses a store without codes)."""
        if self.codes is None:
            raise ValueError("this store records its true feature directions but not which fired on each row; "
                             "re-import it with --true-codes C.npy ([rows, features] activations)")
        rows, cols, values = self.codes
        keep = (rows >= start) & (rows < stop)
        out = torch.zeros(stop - start, self.directions.shape[0])
        out[rows[keep] - start, cols[keep]] = values[keep]
        return out


def _load_array(path: Path, what: str) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    if path.suffix.lower() != ".npy":
        raise ValueError(f"{what} {path}: save it as a .npy file (numpy.save)")
    return np.load(path, allow_pickle=False)


def save_true_features(out: Path, manifest: dict, features: Path, codes: Path | None, num_rows: int, d: int) -> None:
    """Write ``true_features.safetensors`` into the store at ``out`` from the .npy files ``features`` [F, D] and
    ``codes`` [num_rows, F], and record it in ``manifest`` (the caller persists the manifest)."""
    directions = _load_array(Path(features), "--true-features")
    if directions.ndim != 2 or directions.shape[1] != d:
        raise ValueError(f"--true-features {features} has shape {directions.shape}; it must be [features, {d}] (one "
                         f"direction per row, as wide as the store's rows)")
    tensors = {"directions": torch.from_numpy(np.ascontiguousarray(directions, dtype=np.float32))}
    if codes is not None:
        acts = _load_array(Path(codes), "--true-codes")
        want = (num_rows, directions.shape[0])
        if acts.shape != want:
            raise ValueError(f"--true-codes {codes} has shape {acts.shape}; it must be {list(want)} (one row per "
                             f"store row, one column per true feature)")
        rows, cols = np.nonzero(acts)
        tensors.update(code_rows=torch.from_numpy(rows.astype(np.int64)),
                       code_cols=torch.from_numpy(cols.astype(np.int64)),
                       code_values=torch.from_numpy(np.asarray(acts[rows, cols], dtype=np.float32)))
    save_file(tensors, str(Path(out) / FILE))
    manifest["true_features"] = {"file": FILE, "features": int(directions.shape[0]), "codes": codes is not None}


def load_true_features(store) -> TrueFeatures | None:
    """The true features an opened ``ActivationStore`` records, or None when it records none."""
    info = store.manifest.get("true_features")
    if not info:
        return None
    t = load_file(str(Path(store.path) / info["file"]))
    codes = (t["code_rows"], t["code_cols"], t["code_values"]) if "code_rows" in t else None
    return TrueFeatures(t["directions"], codes, int(store.num_rows))
