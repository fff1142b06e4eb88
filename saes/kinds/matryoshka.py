"""Matryoshka BatchTopK (Bussmann, Nabeshima, Karvonen, Nanda 2025; Nabeshima 2024), kinds ``matryoshka``
and ``matryoshka-absolute``.

The latents are split into nested groups; prefix i holds the first i groups. One BatchTopK code is selected
over all latents, and EACH prefix reconstructs x from the code's entries in it:
``x_hat_i = b_dec + sum_{j in code, j < m_i} f_j d_j``. The loss is the full reconstruction's FVU (the loop's own
term) plus ``MatryoshkaSettings.matryoshka_inner_weight`` times the sum of the inner prefixes' FVUs (the kind's extra
loss), plus AuxK on the full residual. Departures: the papers weight every prefix 1 (inner_weight 1.0); the
default 0.03 was measured on planted atoms, where the narrow prefixes at weight 1 hedge -- a prefix narrower
than the atoms it must reconstruct turns its latents into blends of atoms -- and lose 12 points of recovery
(up to 21) against BatchTopK, and 0.1 still loses 3-7 points on heavy-tailed rows (docs/results/kinds.md). And the kind
trains with BatchTopK's defaults (``KindSpec.defaults``), its TopK start included: the first steps select
per row (``StepInputs.per_row``). Early latents must reconstruct on their own, so general concepts are not
absorbed into later, more specific latents. Inference is the BatchTopK threshold rule of the base kind; the
groups leave no trace in the saved dictionary (config.json records them under ``training.config``).

A prefix's reconstruction is a masked sparse decode: ``kernels.prefix_errors`` compacts the code per group,
decodes each entry once (no [B, L] code is ever decoded densely) and returns the whole reconstruction and the
inner prefixes' squared errors without building the inner reconstructions.

Which BatchTopK: ``matryoshka`` uses the row-relative rule of ``batchtopk`` (docs/results/batchtopk.md),
``matryoshka-absolute`` the published one. Measured on bench/synthetic_recovery.py (docs/results/kinds.md): the
relative rule was chosen as the default for the same reason as for ``batchtopk``.

Groups: ``MatryoshkaSettings.matryoshka_groups`` (sizes summing to L), or by default prefixes of L/16, L/8, L/4, L/2
and L latents (Bussmann et al. used similar doubling groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from .. import kernels
from ..comm import StepInputs
from .batchtopk import BATCHTOPK_DEFAULTS, ThresholdSettings
from .common import add_code_l1, relative_encode, relative_scores, relu_scores, threshold_encode, train_code
from .spec import KindSpec, TrainOutput

if TYPE_CHECKING:
    from ..model import SparseCoder


@dataclass
class MatryoshkaSettings(ThresholdSettings):
    """Settings of both Matryoshka rules (and BatchTopK's threshold estimate)."""

    matryoshka_groups: list[int] | None = field(default=None, metadata={"help": (
        "Sizes of the nested groups of latents, in order, summing to latents; None: prefixes L/16, L/8, L/4, "
        "L/2, L.")})
    matryoshka_inner_weight: float = field(default=0.03, metadata={"help": (
        "Weight of the summed FVUs of the inner prefixes (1.0: the paper's); 0.03 measured on planted atoms, "
        "0.3-1.0 when absorption is the concern (docs/results/defaults.md).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.matryoshka_inner_weight >= 0:
            raise ValueError(f"matryoshka_inner_weight={self.matryoshka_inner_weight} must be >= 0 (1.0: the paper's)")

    def check(self, cfg) -> None:
        """The groups against ``cfg.latents``."""
        if self.matryoshka_groups is not None and (any(g < 1 for g in self.matryoshka_groups)
                                                   or sum(self.matryoshka_groups) != cfg.latents):
            raise ValueError(f"matryoshka_groups={self.matryoshka_groups} must be positive sizes summing to "
                             f"latents={cfg.latents}; fix them or leave them unset for the default schedule")


def default_groups(latents: int) -> list[int]:
    """Group sizes of the prefixes L/16, L/8, L/4, L/2, L (prefixes of size 0 and repeats dropped)."""
    bounds = sorted({max(1, latents // d) for d in (16, 8, 4, 2)} | {latents})
    return [b - a for a, b in zip([0, *bounds[:-1]], bounds)]


def prefix_bounds(latents: int, groups: list[int] | None) -> list[int]:
    """Increasing prefix widths (the last is L) of the group sizes (default: :func:`default_groups`)."""
    groups = groups or default_groups(latents)
    if sum(groups) != latents or any(g < 1 for g in groups):
        raise ValueError(f"matryoshka groups {groups} must be positive sizes summing to latents={latents}")
    out, total = [], 0
    for g in groups:
        total += g
        out.append(total)
    return out


def _forward(model: SparseCoder, x: Tensor, inputs: StepInputs, relative: bool) -> TrainOutput:
    settings = inputs.settings
    groups = settings.matryoshka_groups if settings is not None else None
    weight = settings.matryoshka_inner_weight if settings is not None else 1.0
    bounds = prefix_bounds(model.n_latents, groups)
    c = train_code(model, x, inputs, batch=not inputs.per_row, relative=relative)
    x_hat, inner = kernels.prefix_errors(c.values, c.indices, model.W_dec, model.b_dec, bounds, x,
                                         impl=model.kernel_impl)
    extra = weight * sum(inner, x.new_zeros(())) / inputs.stats.total_var
    if relative:
        extra = add_code_l1(extra, c.values, inputs)
    return TrainOutput(x_hat, c.fired, c.l0, extra, c.smallest, c.aux)


def _relative_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    return _forward(model, x, inputs, relative=True)


def _absolute_train(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    return _forward(model, x, inputs, relative=False)


KINDS = (
    # batchtopk's defaults (docs/results/defaults.md)
    KindSpec(_relative_train, relative_encode, uses_aux=True, uses_threshold=True, scores=relative_scores,
             relative=True, name="matryoshka", settings=MatryoshkaSettings, defaults=BATCHTOPK_DEFAULTS,
             calibrated=True, mixed_precision=True),
    # trains as published, like batchtopk-absolute: the shared defaults (docs/results/defaults.md)
    KindSpec(_absolute_train, threshold_encode, uses_aux=True, uses_threshold=True, scores=relu_scores,
             name="matryoshka-absolute", settings=MatryoshkaSettings, calibrated=True,
             mixed_precision=True),
)
