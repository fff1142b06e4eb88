"""A minimal example kind, as a test fixture: ``topk-l1``, per-row TopK whose kept codes pay an L1 penalty of their
own weight. What a new kind needs: this module (a settings dataclass whose fields carry ``metadata["help"]``, its
defaults for the shared fields, a forward, an inference rule, one ``KindSpec``) and one line in the registry
(saes/kinds/__init__.py ``MODULES``); tests/test_example_kind.py adds it at run time with ``saes.register``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from conceptdict.saes import KindSpec, SparseCoder, TrainOutput
from conceptdict.saes.comm import StepInputs
from conceptdict.saes.kinds import topk
from conceptdict.saes.kinds.common import decode_train_code, train_code


@dataclass
class TopkL1Settings:
    """Settings of topk-l1."""

    topk_l1_coeff: float = field(default=0.01, metadata={"help": (
        "Weight of the L1 penalty on the kept codes, over the batch's RMS norm of x - mean.")})

    def __post_init__(self) -> None:
        if not self.topk_l1_coeff >= 0:
            raise ValueError(f"topk_l1_coeff={self.topk_l1_coeff} must be >= 0")


def train_forward(model: SparseCoder, x: Tensor, inputs: StepInputs) -> TrainOutput:
    """TopK per row (with the AuxK code when asked), decoded, plus topk_l1_coeff x the kept codes' L1 per row."""
    c = train_code(model, x, inputs, batch=False)
    coeff = inputs.settings.topk_l1_coeff if inputs.settings is not None else 0.0
    penalty = coeff * c.values.sum() / inputs.stats.rows / inputs.stats.row_var.sqrt().detach()
    return decode_train_code(model, c, inputs, tie_break=False)._replace(sparsity_loss=penalty)


# a stronger AuxK than topk's, to show a kind's defaults for the shared fields
KINDS = (KindSpec(train_forward, topk.encode, uses_aux=True, uses_threshold=False, name="topk-l1",
                  settings=TopkL1Settings, defaults={"aux_alpha": 1 / 16}),)
