"""``TrainConfig.precision``: the dtype of the encoder matmul and of the weights for each setting, whether the
device computes bf16 natively, and what ``auto`` (the default) resolves to on it."""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

log = logging.getLogger(__name__)


MATMUL_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                                "float64": None}
"""``TrainConfig.precision`` -> the encoder matmul's dtype (``StepInputs.matmul_dtype``; None: the weights')."""

AUTO = "auto"
"""The default ``TrainConfig.precision``: :func:`resolve_precision` picks bf16 or float32 when the run starts."""

PIN_ENV = "CONCEPTDICT_PRECISION"
"""Environment variable that pins what ``precision auto`` resolves to (``float32`` or ``bf16``) whatever the device:
runs that must not depend on the machine's bf16 support (the test suite pins float32, tests/conftest.py)."""

PINNABLE = ("float32", "bf16")


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype a run with ``TrainConfig.precision`` keeps its weights, Adam state and loss in: float64 for
    ``float64`` (the saved dictionary is rounded to float32), float32 otherwise."""
    return torch.float64 if precision == "float64" else torch.float32


@functools.cache
def _native_on(device_type: str, index: int | None) -> bool:
    if device_type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively (CUDA with bf16 support; a CPU with AVX512-BF16 or AMX, as oneDNN
    reports it; a torch build without that query counts as not native). Asked once per device."""
    device = torch.device(device)
    return _native_on(device.type, device.index)


def resolve_precision(precision: str, device: torch.device, mixed_precision: bool, kernel_impl: str,
                      resumed: str | None = None) -> str:
    """The precision a run trains in: ``precision`` itself unless it is ``auto``. ``auto`` resolves to the
    precision the checkpoint of a resumed run recorded (``resumed``), else to float32 for a kind that trains in float32 only (``mixed_precision`` False) or with
    ``kernel_impl='reference'`` (bf16 needs a fast kernel), else to the value of :data:`PIN_ENV` when set, else to
    bf16 where ``device`` computes it natively (:func:`native_bf16`) and float32 elsewhere."""
    if precision != AUTO:
        return precision
    if resumed is not None:
        chosen = resumed
    elif not mixed_precision or kernel_impl == "reference":
        chosen = "float32"
    elif os.environ.get(PIN_ENV):
        chosen = os.environ[PIN_ENV]
        if chosen not in PINNABLE:
            raise ValueError(f"{PIN_ENV}={chosen!r}: use one of {list(PINNABLE)}, or unset it to let precision auto "
                             f"choose for the device")
    else:
        chosen = "bf16" if native_bf16(device) else "float32"
    log.info("precision auto -> %s on %s", chosen, device)
    return chosen


@functools.cache
def emulated_bf16_cost(rows: int = 512, d: int = 256, latents: int = 2048) -> float:
    """How many times slower one ``[rows, d] @ [d, latents]`` matmul is in bf16 than in float32 on this CPU (best of
    3 each, measured once per process): the cost an explicit bf16 on a CPU that emulates it warns with."""
    x, w = torch.randn(rows, d), torch.randn(d, latents)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = x.to(dtype), w.to(dtype)
        a @ b  # first call: oneDNN's primitive is built
        times = []
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best[dtype] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


_warned: set[str] = set()


def check_precision(precision: str, device: torch.device, warn: bool = True) -> None:
    """Refuse fp16 off CUDA (CPUs have no fast fp16 matmul and its range overflows without a loss scale); with
    ``warn``, say once per process when bf16 runs on a CPU that emulates it, with the measured cost
    (:func:`emulated_bf16_cost`)."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"precision='fp16' needs a CUDA device, not {device.type}; on CPU use precision bf16 "
                         f"(or float32, or auto)")
    if warn and precision == "bf16" and not native_bf16(device) and "bf16" not in _warned:
        _warned.add("bf16")
        log.warning("precision bf16 on a CPU without AVX512-BF16 or AMX: its bf16 matmul is emulated, %.1fx slower "
                    "than float32 here (measured on a [512, 256] @ [256, 2048] matmul); precision auto or float32 "
                    "is faster on this machine (docs/results/speed.md)", emulated_bf16_cost())


def run_precision(precision: str, device: torch.device, mixed_precision: bool, kernel_impl: str,
                  checkpoint: dict | None = None) -> str:
    """What a run trains in, checked for ``device`` (:func:`check_precision`): :func:`resolve_precision`, a resumed
    run's ``auto`` keeping what its checkpoint recorded (float32 for one written before the setting existed)."""
    recorded = None if checkpoint is None else checkpoint["config"].get("precision", "float32")
    chosen = resolve_precision(precision, device, mixed_precision, kernel_impl, resumed=recorded)
    check_precision(chosen, device)
    return chosen
