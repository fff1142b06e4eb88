"""The sae-lens half of ``bench/synth_sae_bench.py``; runs in the side venv ``.venv-synth`` (torch + sae-lens >= 6.54,
never conceptdict), called by that script once per step:

    world  --scale S --seed N --train-rows R --eval-rows E --out DIR
           a SynthSAEBench world from sae-lens' own generator (``SyntheticModel``, the published 16k recipe with
           features, hidden width, SAE width and hierarchy roots divided by S) and its samples: train.npy (hidden
           rows to train on), eval_hidden.npy + eval_features.pt (held-out rows and their true feature
           activations), the model (``SyntheticModel.save``) and world.json (k: the true L0 of the W most frequent
           features, the recipe's rule for its k = 25 at width 4096)
    train  --world DIR --arch A --k K --samples N --seed N --out DIR
           sae-lens' own trainer (``sae_lens.synthetic.train_toy_sae``: Adam lr 3e-4, batch 1024, constant lr) on
           train.npy, replayed in order (passes as needed), with each architecture's default config
    score  --world DIR (--saelens SAE_DIR | --codes NPZ) --out JSON
           ``sae_lens.synthetic.eval_sae_on_synthetic_data`` on the held-out rows: MCC, precision / recall / F1,
           uniqueness, explained variance, L0, dead latents, shrinkage
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from sae_lens import (
    BatchTopKTrainingSAEConfig,
    JumpReLUTrainingSAEConfig,
    MatryoshkaBatchTopKTrainingSAEConfig,
    StandardTrainingSAEConfig,
    TopKTrainingSAEConfig,
)
from sae_lens.registry import get_sae_training_class
from sae_lens.saes.sae import SAE
from sae_lens.synthetic import (
    FoldedNormalMagnitudeConfig,
    HierarchyConfig,
    LinearMagnitudeConfig,
    LowRankCorrelationConfig,
    OrthogonalizationConfig,
    SyntheticModel,
    SyntheticModelConfig,
    ZipfianFiringProbabilityConfig,
    eval_sae_on_synthetic_data,
    train_toy_sae,
)

BATCH = 4096
"""Rows per generator call and per scoring batch (held-out features are replayed in these batches)."""


def recipe(scale: int, seed: int) -> tuple[SyntheticModelConfig, int]:
    """(the published SynthSAEBench-16k configuration with features, hidden width and hierarchy roots divided by
    ``scale``, SAE width 4096 / scale). Everything else as published: Zipf firing (exponent 0.5, p 0.4 to 5e-4),
    hierarchy of branching 4 and depth 3 with mutually exclusive children scaled by their parent, low-rank
    correlations (rank 25, scale 0.1), 100 orthogonalisation steps, magnitudes 5 -> 4 with folded-normal spread,
    bias 0.5."""
    if 16384 % scale or 768 % scale or 128 % scale:
        raise SystemExit(f"--scale {scale}: must divide 16384, 768 and 128 (1, 2, 4, 8, 16, 32, 64 or 128)")
    cfg = SyntheticModelConfig(
        num_features=16384 // scale, hidden_dim=768 // scale,
        firing_probability=ZipfianFiringProbabilityConfig(exponent=0.5, max_prob=0.4, min_prob=5e-4),
        hierarchy=HierarchyConfig(total_root_nodes=128 // scale, branching_factor=4, max_depth=3,
                                  mutually_exclusive_portion=1.0, mutually_exclusive_min_depth=0,
                                  compensate_probabilities=True, scale_children_by_parent=True),
        orthogonalization=OrthogonalizationConfig(num_steps=100, lr=3e-4),
        correlation=LowRankCorrelationConfig(rank=25, correlation_scale=0.1),
        mean_firing_magnitudes=LinearMagnitudeConfig(start=5.0, end=4.0),
        std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=0.5, std=0.5),
        bias=0.5, seed=seed)
    return cfg, 4096 // scale


def make_world(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, width = recipe(args.scale, args.seed)
    t0 = time.perf_counter()
    model = SyntheticModel(cfg)
    model.save(out / "model")
    torch.manual_seed(args.seed)  # the samples' own stream (the model's seed only builds the model)
    train = np.lib.format.open_memmap(out / "train.npy", mode="w+", dtype=np.float32,
                                      shape=(args.train_rows, cfg.hidden_dim))
    fired = torch.zeros(cfg.num_features)
    for start in range(0, args.train_rows, BATCH):
        hidden, features = model.sample_with_features(min(BATCH, args.train_rows - start))
        train[start:start + len(hidden)] = hidden.numpy()
        fired += (features > 0).sum(dim=0)
    train.flush()
    eval_hidden, eval_features = [], []
    for start in range(0, args.eval_rows, BATCH):
        hidden, features = model.sample_with_features(min(BATCH, args.eval_rows - start))
        eval_hidden.append(hidden)
        eval_features.append(features.to_sparse())
    np.save(out / "eval_hidden.npy", torch.cat(eval_hidden).numpy())
    torch.save(eval_features, out / "eval_features.pt")
    frequent = fired.argsort(descending=True)[:width]
    true_l0 = float(fired.sum() / args.train_rows)
    top_l0 = float(fired[frequent].sum() / args.train_rows)
    meta = {"scale": args.scale, "seed": args.seed, "num_features": cfg.num_features, "hidden_dim": cfg.hidden_dim,
            "width": width, "k": max(1, round(top_l0)), "true_l0": true_l0, "true_l0_top_width": top_l0,
            "train_rows": args.train_rows, "eval_rows": args.eval_rows, "seconds": time.perf_counter() - t0}
    (out / "world.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


ARCHS = {
    "topk": lambda d, w, k: TopKTrainingSAEConfig(d_in=d, d_sae=w, k=k),
    "batchtopk": lambda d, w, k: BatchTopKTrainingSAEConfig(d_in=d, d_sae=w, k=k),
    # the benchmark's own widths (synth-sae-bench-experiments: 128, 512, 2048 inside 4096) divided by the scale
    "matryoshka": lambda d, w, k: MatryoshkaBatchTopKTrainingSAEConfig(
        d_in=d, d_sae=w, k=k, matryoshka_widths=[w // 32, w // 8, w // 2], use_matryoshka_aux_loss=True),
    # sae-lens' own way to aim a JumpReLU at an L0 (GemmaScope 2's quadratic L0 loss); the default "step" mode has
    # no target and lands wherever l0_coefficient 1.0 puts it
    "jumprelu": lambda d, w, k: JumpReLUTrainingSAEConfig(d_in=d, d_sae=w, jumprelu_sparsity_loss_mode="quadratic",
                                                          target_l0=float(k)),
    "standard": lambda d, w, k: StandardTrainingSAEConfig(d_in=d, d_sae=w),
}
"""sae-lens architecture -> its training config, defaults apart from widths, k and (JumpReLU) the L0 target."""


class Replay:
    """Stands in for sae-lens' ``ActivationGenerator`` in ``train_toy_sae``: returns the stored hidden rows in order
    (wrapping around), so sae-lens trains on exactly the rows conceptdict imports."""

    def __init__(self, rows: np.ndarray):
        self.rows, self.at = rows, 0

    def __call__(self, n: int) -> torch.Tensor:
        if self.at + n <= len(self.rows):
            batch = np.array(self.rows[self.at:self.at + n])
        else:
            batch = np.take(self.rows, np.arange(self.at, self.at + n), axis=0, mode="wrap")
        self.at = (self.at + n) % len(self.rows)
        return torch.from_numpy(batch)


class RowsAsFeatures(torch.nn.Identity):
    """The feature dictionary ``train_toy_sae`` maps its generator's output through: the identity, as the
    replayed rows are already hidden activations."""

    def __init__(self, d: int):
        super().__init__()
        self.feature_vectors = torch.zeros(1, d)


def train_saelens(args) -> None:
    world = json.loads((Path(args.world) / "world.json").read_text())
    rows = np.load(Path(args.world) / "train.npy", mmap_mode="r")
    torch.manual_seed(args.seed)
    cfg = ARCHS[args.arch](world["hidden_dim"], world["width"], args.k)
    sae = get_sae_training_class(cfg.architecture())[0](cfg)
    t0 = time.perf_counter()
    train_toy_sae(sae, RowsAsFeatures(world["hidden_dim"]), Replay(rows), training_samples=args.samples)
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sae.save_inference_model(out)
    (out / "bench.json").write_text(json.dumps({"arch": args.arch, "samples": args.samples, "seconds": seconds}))


class ReplayFeatures:
    """Stands in for the ``ActivationGenerator`` that ``eval_sae_on_synthetic_data`` samples: the stored held-out
    feature activations, batch by batch, in the order they were drawn."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches = iter(batches)

    def sample(self, n: int) -> torch.Tensor:
        batch = next(self.batches).to_dense()
        if len(batch) != n:
            raise RuntimeError(f"scoring asked for {n} rows, the stored batch holds {len(batch)}")
        return batch


class StoredCodes(torch.nn.Module):
    """A dictionary sae-lens cannot hold (conceptdict's row-relative kinds, SpaDE): its decoder directions and the
    codes and reconstructions conceptdict computed on the held-out rows, handed to ``eval_sae_on_synthetic_data``
    batch by batch; ``encode`` checks that it is given the rows the codes were computed on."""

    def __init__(self, npz: Path, hidden: np.ndarray):
        super().__init__()
        data = np.load(npz)
        self.W_dec = torch.from_numpy(data["W_dec"])
        self.codes, self.recon = torch.from_numpy(data["codes"]), torch.from_numpy(data["recon"])
        self.hidden, self.at, self.last = torch.from_numpy(hidden), 0, None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        expect = self.hidden[self.at:self.at + len(x)]
        if not torch.allclose(x, expect, atol=1e-4, rtol=1e-4):
            raise RuntimeError("the scored rows are not the rows the stored codes were computed on")
        self.last = (self.at, len(x))
        self.at += len(x)
        return self.codes[self.last[0]:self.at]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        start, n = self.last
        return self.recon[start:start + n]


def score(args) -> None:
    world_dir = Path(args.world)
    model = SyntheticModel.load_from_disk(world_dir / "model")
    batches = torch.load(world_dir / "eval_features.pt", weights_only=True)
    rows = sum(len(b) for b in batches)
    if args.saelens:
        sae = SAE.load_from_disk(args.saelens)
    else:
        sae = StoredCodes(Path(args.codes), np.load(world_dir / "eval_hidden.npy"))
    result = eval_sae_on_synthetic_data(sae, model.feature_dict, ReplayFeatures(batches), num_samples=rows,
                                        batch_size=BATCH)
    Path(args.out).write_text(json.dumps(result.to_dict()))
    print(json.dumps(result.to_dict()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("world")
    w.add_argument("--scale", type=int, required=True)
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--train-rows", type=int, required=True)
    w.add_argument("--eval-rows", type=int, required=True)
    w.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("--world", required=True)
    t.add_argument("--arch", choices=sorted(ARCHS), required=True)
    t.add_argument("--k", type=int, required=True)
    t.add_argument("--samples", type=int, required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("--world", required=True)
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--saelens", help="a SAELens directory")
    which.add_argument("--codes", help="an .npz with W_dec [L, D], codes [E, L], recon [E, D] on eval_hidden.npy")
    s.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    {"world": make_world, "train": train_saelens, "score": score}[args.command](args)


if __name__ == "__main__":
    main()
