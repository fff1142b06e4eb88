"""``TrainConfig.precision``: the dtype of the encoder matmul and of the weights for each setting, and whether the
device computes bf16 natively."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


MATMUL_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                                "float64": None}
"""``TrainConfig.precision`` -> the encoder matmul's dtype (``StepInputs.matmul_dtype``; None: the weights')."""


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype a run with ``TrainConfig.precision`` keeps its weights, Adam state and loss in: float64 for
    ``float64`` (the saved dictionary is rounded to float32), float32 otherwise."""
    return torch.float64 if precision == "float64" else torch.float32


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX, as oneDNN reports it; a
    torch build without that query counts as not native)."""
    try:
        return device.type == "cuda" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_precision(precision: str, device: torch.device, warn: bool = True) -> None:
    """Refuse fp16 off CUDA (CPUs have no fast fp16 matmul and its range overflows without a loss scale); with
    ``warn``, say when bf16 runs on a CPU that emulates it (several times slower than float32)."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"precision='fp16' needs a CUDA device, not {device.type}; on CPU use precision bf16 "
                         f"(or float32)")
    if warn and precision == "bf16" and not native_bf16(device):
        log.warning("precision bf16 on a CPU without AVX512-BF16 or AMX: its bf16 matmul is emulated and slower "
                    "than float32 (docs/results/speed.md); precision float32 is faster here")
