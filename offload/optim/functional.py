"""The flat-shard Adam step the engine calls on offloaded partitions.

`adam_step_flat` is the contract between the optimizer and the engine: one fused update of
one flat fp32 master partition, in place, with optional low-precision output written in
the same pass. `adam_step_flat_reference` is the same update in plain torch ops: the
definition the native kernels are tested against.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from offload._native import C
from offload.optim.flat_args import (
    DTYPE_CODE,
    GRAD_DTYPES,
    OUT_DTYPES,
    STATE_DTYPES,
    check_isa_and_threads,
    check_no_overlap,
    check_same_numel,
    check_step,
    check_tensor,
    forced_isa,
)


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
    # fp32 moments were updated in place (.float() returned the tensor itself); bf16
    # moments were updated in an fp32 copy, rounded back here.
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if out_lowp is not None:
        out_lowp.copy_(master)


def adam_step_flat(
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
    isa: Optional[str] = None,
    threads: Optional[int] = None,
) -> None:
    """One fused Adam/AdamW update of a flat fp32 master partition, in place, natively.

    Same arguments and result as `adam_step_flat_reference` (up to the last bits of fp32
    rounding, see csrc/adam/adam_math.h), in one pass over memory: `master` (fp32) and
    the moments (fp32, or bf16 to halve their memory and I/O) are updated in place, `grad`
    (fp32, bf16 or fp16) is read once and multiplied by `grad_scale` on the way in, and
    `out_lowp` (bf16 or fp16), if given, receives the updated master rounded to nearest
    even. All tensors are CPU (pinned is fine), contiguous, with the same number of
    elements; any shape, including views into a larger flat buffer.

    `isa` forces a kernel ('scalar', 'portable', 'avx2', 'avx512'; None: the one `adam_isa()`
    names, the best this CPU supports unless OFFLOAD_ADAM_ISA forces another), `threads`
    the thread count (None: the default of `set_num_threads`). Results do not depend on
    either. The GIL is released while the update runs.
    """
    check_tensor("master", master, (torch.float32,))
    check_tensor("grad", grad, GRAD_DTYPES)
    check_tensor("exp_avg", exp_avg, STATE_DTYPES)
    check_tensor("exp_avg_sq", exp_avg_sq, STATE_DTYPES)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(
            f"exp_avg is {exp_avg.dtype} but exp_avg_sq is {exp_avg_sq.dtype}; both moments "
            "must have the same dtype (torch.float32, or torch.bfloat16 for bf16 moments)"
        )
    named = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out_lowp is not None:
        check_tensor("out_lowp", out_lowp, OUT_DTYPES)
        named.append(("out_lowp", out_lowp))
    n = check_same_numel(named)
    check_no_overlap(named)
    step_int = check_step(step)
    isa, threads = check_isa_and_threads(isa, threads)
    if n == 0:
        return
    C.adam_step(
        master.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out_lowp.data_ptr() if out_lowp is not None else 0,
        n,
        DTYPE_CODE[grad.dtype],
        DTYPE_CODE[exp_avg.dtype],
        DTYPE_CODE[out_lowp.dtype] if out_lowp is not None else -1,
        step_int,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(decoupled_weight_decay),
        float(grad_scale),
        isa,
        threads,
    )


def adam_isa() -> str:
    """The kernel `adam_step_flat` uses by default in this process: the best this CPU
    supports ('avx512', 'avx2' or 'portable'), or the one OFFLOAD_ADAM_ISA forces."""
    forced = forced_isa()
    return C.adam_isa() if forced == "auto" else forced


def supported_isas() -> list[str]:
    """Every kernel that can run on this CPU (always 'scalar' and 'portable')."""
    return list(C.adam_supported_isas())


def get_num_threads() -> int:
    """Threads an Adam step uses by default; initially len(os.sched_getaffinity(0))."""
    return C.adam_num_threads()


def set_num_threads(threads: int) -> None:
    """Sets the default thread count of every later Adam step (process-wide)."""
    if not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an int >= 1")
    C.set_adam_num_threads(int(threads))
