"""CB-SAE (Kulkarni et al., "Interpretable and Steerable Concept Bottleneck Sparse Autoencoders", 2025):
prune the latents of a trained dictionary that are hard to interpret or to steer, and add a small concept
bottleneck aligned to the concepts a user asks for that the dictionary lacks.

Formulation (the paper's outline; where the paper's details were not available offline we say what we chose):

- **Prune.** Keep latent j when its interpretability ``scores[interp]["score"] >= min_interpretability`` and,
  when a steering score is stored (``scores["steering"]``, docs/scores.md), ``>= min_steerability``. Without a
  steering scorer the pruning uses interpretability alone and the summary says so. Unscored (never firing)
  latents are pruned. The kept latents are frozen: their codes are the base dictionary's, unchanged.
- **Which concepts are lacking.** A user concept is present when a kept latent's name embeds (sentence encoder)
  within cosine ``match_cosine`` of the concept text; the others get a bottleneck latent each.
- **Bottleneck.** For C added concepts: pre-activations ``p = x W_c + b_c`` ([N, C]), codes ``c = p * (p > theta)``
  (JumpReLU; ``theta`` a running estimate of each latent's (1 - fire_fraction) quantile, so each fires on about
  that share of rows: our stand-in for the paper's hard sparsification) and ``x_hat = x_hat_pruned + c D_c``
  with unit-norm rows of ``D_c``. Trained on the store's rows with the base dictionary frozen, minimising the
  FVU of the residual ``x - x_hat_pruned`` plus ``align_weight * (1 - mean_c sim3(c_c, t_c))``, where ``t_c`` is the
  cosine between each row's text embedding and the concept's (the concept supervision) and ``sim3`` is
  Label-free CBM's cos-cubed similarity over the batch (standardise, cube, cosine). Our choice of alignment
  loss; the paper aligns to CLIP image-text similarities in the same spirit.

:class:`CbSae` implements the naming ``Dictionary`` protocol (encode, dense_activations, decode,
decoder_directions), so it is named, scored and turned into a CBM like any other dictionary;
:func:`save_cbsae` / :func:`load_cbsae` keep it as ``config.json`` (``format: conceptdict-cbsae``, the base
dictionary's directory, the kept ids, the concepts) plus ``weights.safetensors``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from conceptdict.naming.concepts import ConceptDictionary

FORMAT = "conceptdict-cbsae"


@dataclass
class CbSaeConfig:
    """Settings of ``conceptdict cbsae``."""

    concepts: Path | None = field(default=None, metadata={
        "help": "Text file of user concepts, one word or phrase per line."})
    out: Path | None = field(default=None, metadata={"help": "Output directory (dictionary/, concepts/, cbsae.json)."})
    interpretability: str = field(default="embedding", metadata={
        "help": "Scorer whose ``score`` is the interpretability (run `conceptdict score` first)."})
    min_interpretability: float = field(default=0.7, metadata={
        "help": "Prune latents scoring below this (0.7 AUROC: the demo's vocab-name q25 is 0.71, so ~1/4 go)."})
    min_steerability: float = field(default=0.6, metadata={
        "help": "Prune latents whose ``scores[\"steering\"][\"score\"]`` is below this, where that score exists."})
    match_cosine: float = field(default=0.8, metadata={
        "help": "A user concept counts as present when a kept latent's name embeds within this cosine of it."})
    align_weight: float = field(default=1.0, metadata={
        "help": "Weight of the cos-cubed alignment loss against the residual FVU."})
    fire_fraction: float = field(default=0.1, metadata={
        "help": ("Share of rows each bottleneck latent fires on: its threshold is the (1 - this) quantile of its "
                 "pre-activation, re-estimated on the batch every step (our stand-in for the paper's hard "
                 "sparsification).")})
    steps: int = field(default=3000, metadata={
        "help": ("Adam steps of the bottleneck (a fixed count: the demo's sentence store has only ~1800 training "
                 "rows).")})
    batch_size: int = field(default=256, metadata={"help": "Rows per step."})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate of the bottleneck."})
    max_rows: int = field(default=20000, metadata={
        "help": "Store rows used for training and evaluation (a uniform sample when the store is larger)."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the row sample, the split and the initialisation."})
    device: str = field(default="cpu", metadata={"help": "Device for training."})


def decode_with(base, f: Tensor) -> Tensor:
    """A single-source dictionary's reconstruction from codes f [N, L], in raw units (decoder rows + b_dec)."""
    return f @ base.decoder_directions() + base.b_dec


class CbSae(torch.nn.Module):
    """A pruned base dictionary (frozen) with a concept bottleneck of C latents appended."""

    def __init__(self, base, keep: Tensor, W_c: Tensor, b_c: Tensor, D_c: Tensor, concepts: Sequence[str],
                 theta: Tensor | None = None) -> None:
        super().__init__()
        if getattr(base, "n_sources", 1) != 1:
            raise ValueError("CB-SAE needs a single-source dictionary; crosscoders are not supported")
        self.base = base
        self.register_buffer("keep", keep.long())
        self.W_c, self.b_c, self.D_c = (torch.nn.Parameter(t.float().clone()) for t in (W_c, b_c, D_c))
        self.register_buffer("theta", torch.zeros(len(b_c)) if theta is None else theta.float().clone())
        self.concepts = list(concepts)
        self.kind, self.d_in, self.k, self.n_sources = "cbsae", base.d_in, base.k, 1
        self.n_latents = len(keep) + len(self.concepts)

    def bottleneck(self, x: Tensor) -> Tensor:
        """[N, C] concept codes: the pre-activation where it exceeds the latent's threshold, else 0."""
        pre = x.float() @ self.W_c + self.b_c
        return pre * (pre > self.theta)

    def encode(self, x: Tensor) -> Tensor:
        return torch.cat([self.base.encode(x)[:, self.keep], self.bottleneck(x)], dim=1)

    def dense_activations(self, x: Tensor) -> Tensor:
        return torch.cat([self.base.dense_activations(x)[:, self.keep], self.bottleneck(x)], dim=1)

    def decode(self, f: Tensor) -> Tensor:
        kept = self.base.decoder_directions()[self.keep]
        n = len(self.keep)
        return f[:, :n] @ kept + self.base.b_dec + f[:, n:] @ self.D_c

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x))

    def decoder_directions(self) -> Tensor:
        return torch.cat([self.base.decoder_directions()[self.keep], self.D_c.detach()])


def prune_mask(cd: ConceptDictionary, cfg: CbSaeConfig) -> tuple[Tensor, dict[str, Any]]:
    """[L] bool: latents kept by the thresholds (module docstring), and how the decision was made."""
    keep, steer_seen = [], 0
    for c in cd.concepts:
        interp = c.scores.get(cfg.interpretability, {}).get("score")
        steer = c.scores.get("steering", {}).get("score")
        steer_seen += steer is not None
        ok = interp is not None and interp >= cfg.min_interpretability
        keep.append(ok and (steer is None or steer >= cfg.min_steerability))
    if not any(cfg.interpretability in c.scores for c in cd.concepts):
        raise ValueError(f"no concept has a {cfg.interpretability!r} score; run `conceptdict score` first")
    how = {"interpretability": cfg.interpretability, "min_interpretability": cfg.min_interpretability,
           "steerability": "steering" if steer_seen else None, "min_steerability": cfg.min_steerability,
           "note": None if steer_seen else "no steering scores stored: pruned on interpretability only"}  # fmt: skip
    return torch.tensor(keep), how


def lacking_concepts(concepts: Sequence[str], kept_names: Sequence[str], embed, match_cosine: float):
    """Split user concepts into (present: {concept: [latent positions]}, lacking: [concepts])."""
    present, lacking = {}, []
    names = [n.strip().lower() for n in kept_names]
    named = [i for i, n in enumerate(names) if n]
    vecs = embed([names[i] for i in named]) if named else None
    for concept in concepts:
        if vecs is None:
            lacking.append(concept)
            continue
        cos = vecs @ embed([concept.strip().lower()])[0]
        hits = [named[i] for i in torch.nonzero(cos >= match_cosine).flatten().tolist()]
        if hits:
            present[concept] = hits
        else:
            lacking.append(concept)
    return present, lacking


def sim3(a: Tensor, b: Tensor, eps: float = 1e-6) -> Tensor:
    """Label-free CBM's cos-cubed similarity per column of a, b [N, C]: standardise over rows, cube, cosine."""
    def std3(t):
        t = (t - t.mean(0)) / (t.std(0) + eps)
        return t**3

    return torch.nn.functional.cosine_similarity(std3(a), std3(b), dim=0)


def fvu(x: Tensor, x_hat: Tensor) -> float:
    """Fraction of variance unexplained: sum |x - x_hat|^2 / sum |x - mean(x)|^2."""
    return float(((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum().clamp_min(1e-12))


@dataclass
class Bottleneck:
    W_c: Tensor
    b_c: Tensor
    D_c: Tensor
    theta: Tensor
    history: list[float] = field(default_factory=list)


def train_bottleneck(x: Tensor, residual: Tensor, targets: Tensor, cfg: CbSaeConfig) -> Bottleneck:
    """Fit W_c, b_c, D_c (module docstring) on rows x [N, D], residuals [N, D] and concept targets [N, C]."""
    gen = torch.Generator().manual_seed(cfg.seed)
    D, C = x.shape[1], targets.shape[1]
    if C == 0:  # every listed concept is present already: nothing to add, the CB-SAE is the pruned dictionary
        return Bottleneck(x.new_zeros(D, 0), x.new_zeros(0), x.new_zeros(0, D), x.new_zeros(0))
    W = torch.nn.Parameter(torch.randn(D, C, generator=gen) / math.sqrt(D))
    b = torch.nn.Parameter(torch.zeros(C))
    Dc = torch.nn.Parameter(W.detach().T.clone() / W.detach().T.norm(dim=1, keepdim=True))
    opt = torch.optim.Adam([W, b, Dc], lr=cfg.lr)
    total_var = ((x - x.mean(0)) ** 2).sum(1).mean()
    history = []
    theta = torch.zeros(C)
    order = torch.zeros(0, dtype=torch.int64)
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:  # a fresh permutation when the current one is used up
            order = torch.randperm(x.shape[0], generator=gen)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        pre = x[idx] @ W + b
        with torch.no_grad():  # running estimate of the (1 - fire_fraction) quantile, as BatchTopK's threshold
            q = pre.quantile(1 - cfg.fire_fraction, dim=0).clamp_min(0)
            theta = q if step == 0 else 0.9 * theta + 0.1 * q
        c = pre * (pre > theta)
        recon = ((residual[idx] - c @ Dc) ** 2).sum(1).mean() / total_var
        loss = recon + cfg.align_weight * (1 - sim3(c, targets[idx]).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            Dc /= Dc.norm(dim=1, keepdim=True).clamp_min(1e-8)
        if step % 100 == 0 or step == cfg.steps - 1:
            history.append(float(loss.detach()))
    return Bottleneck(W.detach(), b.detach(), Dc.detach(), theta, history)


def save_cbsae(model: CbSae, directory: str | Path, base_dir: str | Path, extra: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"W_c": model.W_c.detach().contiguous(), "b_c": model.b_c.detach().contiguous(),
               "D_c": model.D_c.detach().contiguous(), "keep": model.keep.contiguous(),
               "theta": model.theta.contiguous()},
              str(directory / "weights.safetensors"))  # fmt: skip
    doc = {"format": FORMAT, "base": str(base_dir), "concepts": model.concepts, "kind": "cbsae",
           "d_in": model.d_in, "n_latents": model.n_latents, **(extra or {})}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(doc, indent=1) + "\n")
    return directory


def is_cbsae_dir(directory: str | Path) -> bool:
    path = Path(directory) / "config.json"
    return path.exists() and json.loads(path.read_text()).get("format") == FORMAT


def load_cbsae(directory: str | Path, device: str = "cpu") -> CbSae:
    """Read a CB-SAE written by :func:`save_cbsae` (its base dictionary is loaded from the recorded path)."""
    from conceptdict.saes import load_dictionary

    directory = Path(directory)
    doc = json.loads((directory / "config.json").read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{directory}/config.json is not a CB-SAE (format {doc.get('format')!r})")
    t = load_file(str(directory / "weights.safetensors"))
    base = load_dictionary(doc["base"], device=device)
    return CbSae(base, t["keep"], t["W_c"], t["b_c"], t["D_c"], doc["concepts"], t["theta"])


def config_dict(cfg: CbSaeConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
