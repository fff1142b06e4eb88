"""Adam for the training loop: ``torch.optim.Adam(fused=True)``'s update through the same fused kernel, without
``torch.optim``.

Why not ``torch.optim.Adam`` itself: every ``torch.optim`` optimizer's methods are wrapped so that their first call
imports ``torch._dynamo``, which took 1.45 s of a 4.4 s start of ``conceptdict train`` on the demo store and
part of its exit (``bench/startup.py``; docs/results/speed.md), for a compiler the loop never uses. This class calls
the kernel ``torch.optim.Adam(fused=True)`` calls (``torch._fused_adam_``) on the same tensors, so the weights are
bit-identical (tests/test_adam.py steps both side by side), and its ``state_dict`` is ``torch.optim.Adam``'s layout:
checkpoints written by either load into the other.

What it leaves out: weight decay, AMSGrad, ``maximize``, gradient scaling, hooks and several parameter groups: the
loop uses none of them.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch
from torch import Tensor

from . import kernels


class RowsStep(NamedTuple):
    """How a 2-D parameter steps through ``kernels.adam_rows`` instead of the group's fused call: Adam, then with
    ``unit`` its rows renormalised, then with ``copy`` its bf16 copy written, in one pass with ``impl``."""
    unit: bool
    copy: Tensor | None
    impl: str


class Adam:
    """Adam (Kingma & Ba) with bias correction, one parameter group, the fused kernel on every device torch has one for
    (CPU and CUDA). ``param_groups[0]["lr"]`` may be changed between steps, as with torch.optim."""

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.param_groups: list[dict[str, Any]] = [{
            "params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": True, "decoupled_weight_decay": False}]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    @property
    def params(self) -> list[Tensor]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        if p not in self.state:
            self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return self.state[p]

    @torch.no_grad()
    def step(self, rows: dict[int, RowsStep] | None = None) -> None:
        """One update of every parameter that has a gradient (the others keep their state, as torch.optim's do).
        ``rows``: parameter index -> :class:`RowsStep` for the parameters that step through ``kernels.adam_rows``
        (the same Adam arithmetic, bit for bit, with the renormalisation and the copy in the same pass)."""
        group = self.param_groups[0]
        rows = rows or {}
        by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        beta1, beta2 = group["betas"]
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if i not in rows:
                by_device.setdefault((p.device, p.dtype), []).append(p)
                continue
            s = self._state(p)
            s["step"] += 1
            how = rows[i]
            kernels.adam_rows(p, p.grad, s["exp_avg"], s["exp_avg_sq"], s["step"], group["lr"], (beta1, beta2),
                              group["eps"], unit=how.unit, copy=how.copy, impl=how.impl)
            torch.autograd.graph.increment_version([p])  # as below: the kernel writes the weights behind autograd
        for ps in by_device.values():
            states = [self._state(p) for p in ps]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            torch._fused_adam_(ps, [p.grad for p in ps], [s["exp_avg"] for s in states],
                               [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=group["lr"],
                               beta1=beta1, beta2=beta2, weight_decay=0.0, eps=group["eps"], maximize=False,
                               grad_scale=None, found_inf=None)
            # the fused kernel writes the weights without telling autograd: bump their version counters, which
            # say when a weight changed (saes.kernels.copies remakes its bf16 copies by them)
            torch.autograd.graph.increment_version(ps)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Adam.state_dict()``'s layout: state by parameter index, the group with indices for params."""
        index = {id(p): i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Load a state written by :meth:`state_dict` or by ``torch.optim.Adam`` over the same parameters."""
        groups = saved.get("param_groups", [])
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            sizes = [len(g["params"]) for g in groups]
            raise ValueError(f"the optimizer state holds parameter groups of sizes {sizes}, this model has one group "
                             f"of {len(self.params)} parameters; resume with the kind and settings that wrote it")
        position = {idx: i for i, idx in enumerate(groups[0]["params"])}
        self.state = {}
        for idx, s in saved["state"].items():
            p = self.params[position[idx]]
            if s["exp_avg"].shape != p.shape:
                raise ValueError(f"the optimizer state of parameter {position[idx]} has shape "
                                 f"{tuple(s['exp_avg'].shape)}, the parameter {tuple(p.shape)}; resume the same model")
            # copies: the loaded dict may be another optimizer's live state
            self.state[p] = {"step": s["step"].to(device=p.device, dtype=torch.float32, copy=True),
                             "exp_avg": s["exp_avg"].to(device=p.device, dtype=p.dtype, copy=True),
                             "exp_avg_sq": s["exp_avg_sq"].to(device=p.device, dtype=p.dtype, copy=True)}
        keep = {k: v for k, v in groups[0].items() if k in ("lr", "betas", "eps")}
        self.param_groups[0].update(keep)
