"""The update of a unit whose optimizer state lives on the compute device ([Note: the update
split] in offload/storage/device_states.py): torch's kernels instead of the native CPU ones.

One builder per kernel family, with the `UpdateBuilder` signature (offload/optim/kind.py), so
that an `OptimizerKind` names its device update beside its CPU one (`device_build`):
- Adam/AdamW with fp32 moments: torch's fused kernel (`torch._fused_adamw_` /
  `torch._fused_adam_`, the kernels `torch.optim.AdamW(fused=True)` runs; on CUDA and on the
  CPU alike) over the run's flat slice, one launch per run. The gradient is read once and
  divided by the kernel's `grad_scale` (1 / the engine's scale: the loss-scale un-scaling and
  the clip factor), so the gradient shard is left as it was (`engine.full_grad` may read it
  after the update). The new low-precision parameters are one more pass (`out_lowp.copy_`),
  on the device.
- Adam/AdamW with bf16 moments, Lion, Adagrad: the kind's torch reference update
  (offload/optim/functional.py, offload/optim/one_state.py), plain torch ops on any device:
  the definitions the native kernels are tested against.
- 8-bit moments have no device update (their quantisation tables are host code): refused at
  `initialize` by `device_update`'s caller, with what to do.
A generic kind's update is torch's own class already, on any device (`OptimizerKind.device_update`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from offload.optim.functional import adam_step_flat_reference
from offload.optim.kind import OptimizerKind, UpdateFn
from offload.optim.one_state import adagrad_step_flat_reference, lion_step_flat_reference

__all__ = ["adam_device_update", "lion_device_update", "adagrad_device_update"]


def adam_device_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                       adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    if moments == "8bit":
        raise NotImplementedError(
            "optimizer.moments_dtype='8bit' keeps Adam's moments as blockwise 8-bit codes that only "
            "the CPU kernels update; put no unit's optimizer state on the device (leave "
            "offload.optimizer_device_units / optimizer_device_fraction out, optimizer_tier 'cpu' "
            "or 'nvme'), or use moments_dtype 'fp32' or 'bf16'")
    if moments != "fp32":
        return _reference_adam(decoupled)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def adam_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                    step: int, group: dict[str, Any], grad_scale: float,
                    out_lowp: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        dev = master.device
        # The kernel reads the step count as it is (torch.optim adds 1 before calling it).
        steps = [torch.full((), float(step), dtype=torch.float32, device=dev)]
        scale = None if grad_scale == 1.0 else torch.full((), 1.0 / float(grad_scale),
                                                          dtype=torch.float32, device=dev)
        fused([master], [grad], [states[0]], [states[1]], [], steps, lr=float(group["lr"]),
              beta1=float(beta1), beta2=float(beta2), weight_decay=float(group["weight_decay"]),
              eps=float(group["eps"]), amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
        if out_lowp is not None:
            out_lowp.copy_(master)

    return adam_update


def _reference_adam(decoupled: bool) -> UpdateFn:
    def adam_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                    step: int, group: dict[str, Any], grad_scale: float,
                    out_lowp: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        adam_step_flat_reference(master, grad, states[0], states[1], step=step, lr=float(group["lr"]),
                                 beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                                 weight_decay=float(group["weight_decay"]),
                                 decoupled_weight_decay=decoupled, grad_scale=float(grad_scale),
                                 out_lowp=out_lowp)

    return adam_update


def lion_device_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                       adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    def lion_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                    step: int, group: dict[str, Any], grad_scale: float,
                    out_lowp: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lion_step_flat_reference(master, grad, states[0], lr=float(group["lr"]), beta1=float(beta1),
                                 beta2=float(beta2), weight_decay=float(group["weight_decay"]),
                                 grad_scale=float(grad_scale), out_lowp=out_lowp, step=step)

    return lion_update


def adagrad_device_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                          adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    def adagrad_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                       step: int, group: dict[str, Any], grad_scale: float,
                       out_lowp: Optional[torch.Tensor]) -> None:
        adagrad_step_flat_reference(master, grad, states[0], step=step, lr=float(group["lr"]),
                                    lr_decay=float(group["lr_decay"]),
                                    weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                                    grad_scale=float(grad_scale), out_lowp=out_lowp)

    return adagrad_update
