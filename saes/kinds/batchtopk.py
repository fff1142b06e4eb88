"""``batchtopk`` (row-relative BatchTopK: the batch's top k*B entries ranked relative to each row's norm,
docs/results/batchtopk.md) and ``batchtopk-absolute`` (BatchTopK as published, Bussmann et al. 2024). Both keep a running
estimate of one inference threshold (:class:`ThresholdSettings`), which calibration replaces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from ..comm import StepInputs
from .common import relative_encode, relative_scores, relu_scores, sparse_train_forward, threshold_encode
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


@dataclass
class ThresholdSettings:
    """Settings of the kinds that estimate one inference threshold while training (batchtopk, matryoshka and
    crosscoder rules)."""

    threshold_start_step: int | None = field(default=None, metadata={"help": (
        "Step from which the inference threshold is estimated; None: min(1000, 3/4 of the run) "
        "(docs/results/defaults.md).")})
    threshold_momentum: float = field(default=0.999, metadata={"help": (
        "theta <- m * theta + (1 - m) * smallest kept activation of the batch: the running estimate, replaced "
        "at the end by the calibrated one when calibration_batches > 0.")})

    def __post_init__(self) -> None:
        if not 0 <= self.threshold_momentum < 1:
            raise ValueError(f"threshold_momentum={self.threshold_momentum} must lie in [0, 1)")


def relative_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    """Row-relative BatchTopK with the tie-break; per row (TopK) while ``inputs.per_row`` (the run's TopK start,
    ``TrainConfig.topk_start``)."""
    return sparse_train_forward(model, x, inputs, batch=not inputs.per_row, relative=True, tie_break=True)


def absolute_train(model: "SparseCoder", x: Tensor, inputs: StepInputs) -> TrainOutput:
    return sparse_train_forward(model, x, inputs, batch=True)


BATCHTOPK_DEFAULTS = {"code_l1": 0.15, "aux_alpha": 0.25, "dead_share": 1 / 64, "topk_start": 0.3}
"""batchtopk's TopK start, AuxK weight and window and tie-break, measured together (docs/results/defaults.md)."""

KINDS = (
    KindSpec(relative_train, relative_encode, uses_aux=True, uses_threshold=True, scores=relative_scores,
             relative=True, name="batchtopk", settings=ThresholdSettings, defaults=BATCHTOPK_DEFAULTS,
             calibrated=True, mixed_precision=True, shardable=True),
    # the absolute rule trains as published: the shared defaults (docs/results/defaults.md)
    KindSpec(absolute_train, threshold_encode, uses_aux=True, uses_threshold=True, scores=relu_scores,
             name="batchtopk-absolute", settings=ThresholdSettings, calibrated=True, mixed_precision=True,
             shardable=True, saelens="jumprelu"),  # SAELens reads it as the JumpReLU it runs as at inference
)
