"""Two activation stores A and B imported from planted rows (``generators.synthetic.planted_pair``: 8 shared atoms
and 4 that only B has, D=16), for the crosscoder and compare tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import conceptdict as cd
from generators.synthetic import planted_batches, planted_pair


def planted_pair_stores(tmp: Path, n_batches: int, one_name: bool = False) -> tuple[list[Path], torch.Tensor]:
    """([store A, store B], the rows [256 n_batches, 2, 16]). ``one_name``: both stores' hookpoint is called ``acts``
    (each array in a folder of its own), as two caches of one hookpoint are; else ``A`` and ``B``."""
    pair = planted_pair(16, n_shared=8, n_b_only=4, n_scaled=0, n_rotated=0, seed=0)
    x = torch.cat(list(planted_batches(pair, 256, n_batches, p_fire=0.1, seed=1)))
    stores = []
    for s, name in enumerate("AB"):
        array = tmp / name.lower() / "acts.npy" if one_name else tmp / f"{name}.npy"
        array.parent.mkdir(parents=True, exist_ok=True)
        np.save(array, np.ascontiguousarray(x[:, s].numpy()))
        stores.append(cd.import_array(array, out=tmp / name).path)
    return stores, x
