"""The inference threshold of the thresholded kinds (BatchTopK, crosscoders, Matryoshka), set at the end of training on
batches it never trained on, so that the mean L0 on unseen rows is k; for JumpReLU, whose thresholds are learned per
latent, one factor on all of them does the same."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from .comm import LOCAL, Comm
from .model import SparseCoder

log = logging.getLogger(__name__)


@torch.no_grad()
def calibrate_threshold(model: SparseCoder, batches: list[Tensor], chunk: int = 1024,
                        comm: Comm = LOCAL) -> tuple[float, int]:
    """Set the inference threshold of a thresholded kind so that the mean L0 over the rows of ``batches``
    ([B, D] / [B, S, D], a transcoder's (input, output) pairs, in the model's input units) is its k: theta = the (N k)-th largest of the kind's
    scores (``KindSpec.scores``) over the N rows, i.e. BatchTopK over the whole set. Returns (theta, N). A kind
    with learned thresholds per latent (``KindSpec.scales_thresholds``: its scores are the ratios to them) has
    every threshold multiplied by theta instead. A layered kind (a cross-layer transcoder) gets one theta per layer,
    each over its own latents (mean L0 = k per layer); the theta returned is their mean. With latent shards
    (``comm.shards``: ``model`` is this shard's latents, every shard passes the same batches) each shard's top
    ``N k`` scores are gathered and the cut is taken over them: the one-process theta, on every shard."""
    spec = model.spec
    if spec.scores is None:
        raise ValueError(f"kind {model.kind!r} has no threshold to calibrate")
    rows = [model.split(model.flatten_batch(x.to(model.device).float()))[0] for x in batches]  # the inputs
    n = sum(x.shape[0] for x in rows)
    keep = max(1, int(round(n * model.k)))
    groups = model.layer_of_latent()
    tops = [model.W_dec.new_empty(0) for _ in range(int(groups.max()) + 1)]
    for x in rows:
        for part in x.split(chunk):
            scores = spec.scores(model, part)
            for g, top in enumerate(tops):
                got = scores[:, groups == g].flatten()
                top = torch.cat([top, got[got > 0]])
                tops[g] = top.topk(keep, sorted=False).values if top.numel() > keep else top
    if comm.shards.size > 1:  # the top N k of the whole dictionary is among the shards' tops
        tops = [comm.shards.gather_rows(top) for top in tops]
        tops = [top.topk(keep, sorted=False).values if top.numel() > keep else top for top in tops]
    thetas = [float(top.min()) if top.numel() >= keep else 0.0 for top in tops]
    # inference keeps scores strictly above theta: step just below the (N k)-th score so that it is kept too
    thetas = [float(torch.nextafter(torch.tensor(t), torch.tensor(-math.inf))) if t > 0 else 0.0 for t in thetas]
    if 0 in thetas:
        log.warning("fewer than k = %d latents per row are positive on the %d calibration rows: the threshold is 0 "
                    "(every positive activation fires)", model.k, n)
    if spec.scales_thresholds:
        # inference compares z with theta * threshold_j, not z / threshold_j with theta: a relative margin of 1e-6
        # keeps the (N k)-th entry through that product's rounding
        thetas = [t * (1 - 1e-6) for t in thetas]
    if len(thetas) == 1:
        model.threshold.mul_(thetas[0]) if spec.scales_thresholds else model.threshold.fill_(thetas[0])
    else:
        per_latent = torch.tensor(thetas, dtype=model.threshold.dtype, device=model.threshold.device)[groups]
        model.threshold.mul_(per_latent) if spec.scales_thresholds else model.threshold.copy_(per_latent)
    return (thetas[0] if len(thetas) == 1 else sum(thetas) / len(thetas)), n


def threshold_summary(model: SparseCoder, calibration: list[Tensor], comm: Comm = LOCAL) -> dict[str, Any]:
    """Calibrate the threshold on the calibration rows when there are any; say which estimate the model keeps
    (kinds whose threshold is learned per latent, like JumpReLU, keep what training learned, times one factor when
    calibrated). With latent shards (``comm.shards``) every shard calibrates its latents and reports the whole
    dictionary's figures."""
    if not model.spec.estimates_threshold:
        scaled = bool(calibration) and model.spec.scales_thresholds
        factor, n = calibrate_threshold(model, calibration, comm=comm) if scaled else (1.0, 0)
        if n:
            log.info("thresholds scaled by %.4g on %d unseen rows so that their mean L0 is k", factor, n)
        return {"rule": "learned per latent" + (", scaled by one factor: mean L0 = k on rows never trained on"
                                                 if n else ""),
                "factor": factor, "calibrated_on_rows": n, **_spread(model.threshold, comm)}
    running, layers = float(model.threshold[0]), _per_layer(model)
    if not calibration:
        return {"value": running, "running_estimate": running, "calibrated_on_rows": 0,
                "rule": "running estimate from training batches", **({"per_layer": layers} if layers else {})}
    theta, n = calibrate_threshold(model, calibration, comm=comm)
    log.info("inference threshold %.6g calibrated on %d unseen rows (running estimate %.6g)", theta, n, running)
    out = {"value": theta, "running_estimate": running, "calibrated_on_rows": n,
           "rule": "mean L0 = k on rows never trained on"}
    if layers:  # a cross-layer transcoder: one threshold per layer, calibrated per layer ("value" is their mean)
        out.update(running_estimate=sum(layers) / len(layers), rule="mean L0 = k per layer on rows never trained on",
                   per_layer=_per_layer(model), running_per_layer=layers)
    return out


def _spread(t: Tensor, comm: Comm) -> dict[str, float]:
    """Mean, min and max of the per-latent thresholds t [L_s] over every latent shard's."""
    shards = comm.shards
    if shards.size == 1:
        return {"mean": float(t.mean()), "min": float(t.min()), "max": float(t.max())}
    t = t.double().cpu()
    low, high = shards.all_min(torch.stack([t.min(), -t.max()]))
    return {"mean": float(shards.all_sum(t.sum()) / (t.numel() * shards.size)), "min": float(low), "max": float(-high)}


def _per_layer(model: SparseCoder) -> list[float] | None:
    """A layered kind's threshold of each layer (None for other kinds)."""
    if not model.spec.layered:
        return None
    P = model.n_latents // model.n_sources
    return [float(t) for t in model.threshold[::P]]
