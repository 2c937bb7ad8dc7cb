"""The flat-shard Adam step the engine calls on offloaded partitions.

`adam_step_flat` is the contract between the optimizer and the engine: one fused update of
one flat fp32 master partition, in place, with optional low-precision output written in
the same pass. `adam_step_flat_reference` is the same update in plain torch ops: the
definition the native kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def adam_step_flat_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
) -> None:
    """One Adam/AdamW update, as torch.optim.AdamW / Adam compute it (non-amsgrad, non-foreach).

    `step` is the step count *after* this update (1 for the first update), as torch keeps it.
    `grad_scale` multiplies the gradient before anything else (loss-scale un-scaling and the
    clip factor in one number). Moments may be fp32 or bf16; `grad` fp32, bf16 or fp16;
    `out_lowp` (bf16 or fp16), if given, receives the updated master rounded to nearest even.
    """
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.float()
    v = exp_avg_sq.float()
    if weight_decay != 0.0:
        if decoupled_weight_decay:
            master.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(master, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    master.addcdiv_(m, denom, value=-step_size)
    if exp_avg.dtype != torch.float32:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    else:
        exp_avg.copy_(m) if m.data_ptr() != exp_avg.data_ptr() else None
        exp_avg_sq.copy_(v) if v.data_ptr() != exp_avg_sq.data_ptr() else None
    if out_lowp is not None:
        out_lowp.copy_(master)


# Until the native kernel is bound, the engine runs on the reference (same signature).
adam_step_flat = adam_step_flat_reference
