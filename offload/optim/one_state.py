"""The flat-shard Lion and Adagrad steps: one fused native pass over a flat fp32 master.

The same contract as `adam_step_flat` (offload/optim/functional.py), so the engine can call
any of them the same way: `master` (fp32) and the optimizer's one state tensor (fp32, or
bf16 to halve its memory and I/O) are updated in place, `grad` (fp32, bf16 or fp16) is read
once and multiplied by `grad_scale` on the way in (the engine's 1 / (loss scale x
accumulation) times the clip coefficient), and `out_lowp` (bf16 or fp16), if given,
receives the updated master rounded to nearest even in the same pass. `isa` and `threads`
choose the kernel and the thread count as for Adam (OFFLOAD_ADAM_ISA forces the kernel of
every native optimizer; `set_num_threads` sets the default of all of them); results do not
depend on either. The GIL is released while an update runs.

Each step has a `*_reference` twin in plain torch ops: the definition, as torch (Adagrad)
and lion-pytorch (Lion) compute it, that tests/test_native_optimizers.py holds the native
kernels against. csrc/optim/one_state_math.h has the kernels' exact operation order.
"""

from __future__ import annotations

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
)

__all__ = [
    "adagrad_step_flat",
    "adagrad_step_flat_reference",
    "lion_step_flat",
    "lion_step_flat_reference",
]


# -- Lion -------------------------------------------------------------------------------------


def lion_step_flat_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
    step: Optional[int] = None,
) -> None:
    """One Lion update (Chen et al. 2023, Algorithm 2), as lion-pytorch computes it:

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay) - lr * sign(c)       (sign(0) = 0)
        m = beta2 * m + (1 - beta2) * g

    with g = grad * grad_scale. Works in float64 too (master and exp_avg float64: the
    truth the tests measure fp32 against). `step` is accepted for a uniform call with the
    other optimizers and unused: Lion has no bias correction.
    """
    g = grad.to(master.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.to(master.dtype)
    if weight_decay != 0.0:
        master.mul_(1.0 - lr * weight_decay)
    update = m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()
    master.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1.0 - beta2)
    if m is not exp_avg:  # a bf16 state was updated in a copy: round it back
        exp_avg.copy_(m)
    if out_lowp is not None:
        out_lowp.copy_(master)


def lion_step_flat(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
    step: Optional[int] = None,
    isa: Optional[str] = None,
    threads: Optional[int] = None,
) -> None:
    """One fused Lion update of a flat fp32 master partition, in place, natively.

    Same arguments and definition as `lion_step_flat_reference` (the module docstring has
    the dtypes); `exp_avg` is Lion's momentum, fp32 or bf16. `step` is checked when given
    and otherwise unused (Lion has no bias correction).
    """
    if step is not None:
        check_step(step)
    n, codes, isa, threads = _check_update(
        master, grad, "exp_avg", exp_avg, out_lowp, isa, threads
    )
    if n == 0:
        return
    C.lion_step(
        master.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        out_lowp.data_ptr() if out_lowp is not None else 0,
        n,
        *codes,
        float(lr),
        float(beta1),
        float(beta2),
        float(weight_decay),
        float(grad_scale),
        isa,
        threads,
    )


# -- Adagrad ----------------------------------------------------------------------------------


def adagrad_step_flat_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    step: int,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
) -> None:
    """One Adagrad update, as torch.optim.Adagrad computes it (single-tensor path):

        g   = grad * grad_scale (+ weight_decay * p)
        sum = sum + g * g
        p   = p - clr * g / (sqrt(sum) + eps),    clr = lr / (1 + (step - 1) * lr_decay)

    `step` is the count after this update (1 for the first), as torch keeps it; torch's
    initial_accumulator_value is the value `state_sum` was filled with when created.
    """
    g = grad.to(master.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        g = g.add(master, alpha=weight_decay)
    s = state_sum.to(master.dtype)
    clr = lr / (1 + (step - 1) * lr_decay)
    s.addcmul_(g, g, value=1)
    master.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
    if s is not state_sum:
        state_sum.copy_(s)
    if out_lowp is not None:
        out_lowp.copy_(master)


def adagrad_step_flat(
    master: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    step: int,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
    isa: Optional[str] = None,
    threads: Optional[int] = None,
) -> None:
    """One fused Adagrad update of a flat fp32 master partition, in place, natively.

    Same arguments and definition as `adagrad_step_flat_reference` (the module docstring has
    the dtypes); `state_sum` is Adagrad's sum of squared gradients (torch's state 'sum'),
    fp32 or bf16. Results differ from torch's in the last bits only: the kernel fuses
    sum + g*g and p - clr*(g/d) into one rounding each, where torch rounds twice.
    """
    step_int = check_step(step)
    n, codes, isa, threads = _check_update(
        master, grad, "state_sum", state_sum, out_lowp, isa, threads
    )
    if n == 0:
        return
    C.adagrad_step(
        master.data_ptr(),
        grad.data_ptr(),
        state_sum.data_ptr(),
        out_lowp.data_ptr() if out_lowp is not None else 0,
        n,
        *codes,
        step_int,
        float(lr),
        float(lr_decay),
        float(weight_decay),
        float(eps),
        float(grad_scale),
        isa,
        threads,
    )


# -- shared argument checks -------------------------------------------------------------------


def _check_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    state_name: str,
    state: torch.Tensor,
    out_lowp: Optional[torch.Tensor],
    isa: Optional[str],
    threads: Optional[int],
) -> tuple[int, tuple[int, int, int], str, int]:
    """Checks one update's tensors, kernel and thread count (a bad one raises, naming it) and
    returns (n, (grad, state, out) dtype codes, the kernel name, threads; 0 = default)."""
    check_tensor("master", master, (torch.float32,))
    check_tensor("grad", grad, GRAD_DTYPES)
    check_tensor(state_name, state, STATE_DTYPES)
    named = [("master", master), ("grad", grad), (state_name, state)]
    if out_lowp is not None:
        check_tensor("out_lowp", out_lowp, OUT_DTYPES)
        named.append(("out_lowp", out_lowp))
    n = check_same_numel(named)
    check_no_overlap(named)
    isa, threads = check_isa_and_threads(isa, threads)
    out_code = DTYPE_CODE[out_lowp.dtype] if out_lowp is not None else -1
    return n, (DTYPE_CODE[grad.dtype], DTYPE_CODE[state.dtype], out_code), isa, threads
