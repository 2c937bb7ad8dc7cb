"""CPUAdam: torch.optim.AdamW / torch.optim.Adam on CPU tensors, one fused native pass each.

A drop-in: same constructor arguments, param groups, schedulers (they write group['lr']),
and a state_dict in torch's exact format (per parameter 'step' as a float32 scalar tensor,
'exp_avg', 'exp_avg_sq'; the group keys of torch.optim.Adam), so a checkpoint moves
between CPUAdam and torch's optimizers in both directions. What differs is only speed:
each parameter is updated by `adam_step_flat` (SIMD, multi-threaded, one pass over memory)
instead of torch's op-by-op kernels; results agree with torch's to fp32 rounding.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, overload

import torch
from torch.optim import Optimizer

from offload.optim.functional import adam_step_flat

__all__ = ["CPUAdam"]


class CPUAdam(Optimizer):
    """Adam with decoupled weight decay (AdamW, the default) or L2 weight decay (Adam).

    `decoupled_weight_decay=True` computes what torch.optim.AdamW does, False what
    torch.optim.Adam does. Parameters must be dense, contiguous fp32 CPU tensors;
    gradients may be fp32, bf16 or fp16. `maximize` is honoured; `amsgrad` and
    `differentiable` are not implemented (a group asking for them raises at step());
    torch's `foreach`, `fused` and `capturable` flags are kept in the groups for the
    state_dict's sake and have no effect here.
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        *,
        maximize: bool = False,
    ) -> None:
        lr_value = float(lr)
        if not 0.0 <= lr_value:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        # The same keys, in the same order, as torch.optim.Adam's groups: the state_dict
        # must load into torch's optimizers unchanged (and theirs into ours).
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch.optim.Adam does for checkpoints written by older versions.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if len(p_state) != 0 and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):
                raise NotImplementedError(
                    f"param group {index} has amsgrad=True, which CPUAdam does not implement; "
                    "use torch.optim.Adam(amsgrad=True) for it"
                )
            if group.get("differentiable", False):
                raise NotImplementedError(
                    f"param group {index} has differentiable=True, which CPUAdam does not "
                    "implement (it updates memory in place, outside autograd)"
                )
            beta1, beta2 = (float(b) for b in group["betas"])
            lr = float(group["lr"])
            decoupled = group.get("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
            grad_scale = -1.0 if group.get("maximize", False) else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = self._checked_grad(p)
                state = self.state[p]
                if len(state) == 0:
                    # As torch.optim.Adam initialises (step lives on the CPU as float32).
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self._make_state_contiguous(state)
                state["step"] += 1
                adam_step_flat(
                    p,
                    grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    decoupled_weight_decay=bool(decoupled),
                    grad_scale=grad_scale,
                )
                # The native kernel writes memory behind autograd's back; bump the version
                # counters as torch's in-place ops would, so a graph that saved these
                # tensors before the step fails loudly instead of using the new values.
                torch.autograd.graph.increment_version(p)
                torch.autograd.graph.increment_version(state["exp_avg"])
                torch.autograd.graph.increment_version(state["exp_avg_sq"])
        return loss

    @staticmethod
    def _checked_grad(p: torch.Tensor) -> torch.Tensor:
        if p.layout != torch.strided or p.is_complex() or p.dtype != torch.float32:
            raise TypeError(
                f"CPUAdam updates dense fp32 parameters; got a {p.layout} {p.dtype} tensor of "
                f"shape {tuple(p.shape)}. Keep an fp32 master copy on the CPU, or use "
                "torch.optim.AdamW for this parameter"
            )
        if p.device.type != "cpu":
            raise ValueError(
                f"CPUAdam updates CPU parameters; this one (shape {tuple(p.shape)}) is on "
                f"{p.device}. Move the model to the CPU, or use torch.optim.AdamW on the device"
            )
        if not p.is_contiguous():
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} with stride {p.stride()} is not "
                "contiguous; CPUAdam updates parameter memory in place, so make the parameter "
                "contiguous (p.data = p.data.contiguous()) before creating the optimizer"
            )
        grad = p.grad
        assert grad is not None, "step() skips parameters without a gradient"
        if grad.is_sparse or grad.layout != torch.strided:
            raise TypeError(
                f"CPUAdam does not support {grad.layout} gradients (parameter of shape "
                f"{tuple(p.shape)}); use torch.optim.SparseAdam for sparse gradients"
            )
        if grad.shape != p.shape:
            raise ValueError(
                f"gradient shape {tuple(grad.shape)} differs from its parameter's "
                f"{tuple(p.shape)}"
            )
        if grad.device.type != "cpu":
            raise ValueError(f"gradient is on {grad.device}; CPUAdam needs CPU gradients")
        # The gradient is only read: a non-contiguous one can be copied.
        return grad if grad.is_contiguous() else grad.contiguous()

    @staticmethod
    def _make_state_contiguous(state: dict[str, Any]) -> None:
        # A loaded checkpoint may carry moments in another layout; the kernel needs flat
        # memory in the parameter's element order (load_state_dict already cast dtype and
        # device to the parameter's).
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            if not t.is_contiguous() or t.dtype != torch.float32 or t.device.type != "cpu":
                state[key] = t.to(device="cpu", dtype=torch.float32).contiguous()
