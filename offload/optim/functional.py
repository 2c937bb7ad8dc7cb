"""The flat-shard Adam step the engine calls on offloaded partitions.

`adam_step_flat` is the contract between the optimizer and the engine: one fused update of
one flat fp32 master partition, in place, with optional low-precision output written in
the same pass. `adam_step_flat_reference` is the same update in plain torch ops: the
definition the native kernels are tested against.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Optional

import torch

from offload._native import C

# dtype codes of the native binding (csrc/adam/adam.h, DType).
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_ISAS = ("auto", "scalar", "portable", "avx2", "avx512")
ISA_ENV = "OFFLOAD_ADAM_ISA"
"""The environment variable that forces the kernel of every Adam step in the process (and
in the processes it starts): how a test or a user reproduces another CPU's code path, as
ATEN_CPU_CAPABILITY does for torch's own kernels. Unset or 'auto': the best this CPU runs."""


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
    _check_tensor("master", master, (torch.float32,))
    _check_tensor("grad", grad, _GRAD_DTYPES)
    _check_tensor("exp_avg", exp_avg, _MOMENT_DTYPES)
    _check_tensor("exp_avg_sq", exp_avg_sq, _MOMENT_DTYPES)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(
            f"exp_avg is {exp_avg.dtype} but exp_avg_sq is {exp_avg_sq.dtype}; both moments "
            "must have the same dtype (torch.float32, or torch.bfloat16 for bf16 moments)"
        )
    named = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out_lowp is not None:
        _check_tensor("out_lowp", out_lowp, _OUT_DTYPES)
        named.append(("out_lowp", out_lowp))
    n = master.numel()
    for name, t in named[1:]:
        if t.numel() != n:
            raise ValueError(
                f"{name} has {t.numel()} elements but master has {n}; all buffers of one "
                "update must cover the same elements"
            )
    _check_no_overlap(named)
    step_int = _check_step(step)
    if isa is None:
        isa = _forced_isa()
    elif isa not in _ISAS:
        raise ValueError(f"isa={isa!r} is not a kernel name; choose one of {_ISAS} or None")
    if threads is None:
        threads = 0
    elif not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an int >= 1, or None for the default")
    if n == 0:
        return
    C.adam_step(
        master.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out_lowp.data_ptr() if out_lowp is not None else 0,
        n,
        _DTYPE_CODE[grad.dtype],
        _DTYPE_CODE[exp_avg.dtype],
        _DTYPE_CODE[out_lowp.dtype] if out_lowp is not None else -1,
        step_int,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(decoupled_weight_decay),
        float(grad_scale),
        isa,
        int(threads),
    )


def _forced_isa() -> str:
    """The kernel OFFLOAD_ADAM_ISA names ('auto' when unset), checked against this CPU."""
    name = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    if name == "auto":
        return name
    if name not in _ISAS:
        raise ValueError(
            f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not an Adam kernel; set it to one of "
            f"{', '.join(_ISAS)}, or unset it"
        )
    supported = supported_isas()
    if name not in supported:
        raise ValueError(
            f"{ISA_ENV}={name!r}: this CPU cannot run the {name} Adam kernel; it runs "
            f"{', '.join(supported)} (unset {ISA_ENV} for the best, {C.adam_isa()!r})"
        )
    return name


def adam_isa() -> str:
    """The kernel `adam_step_flat` uses by default in this process: the best this CPU
    supports ('avx512', 'avx2' or 'portable'), or the one OFFLOAD_ADAM_ISA forces."""
    forced = _forced_isa()
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


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} has layout {t.layout}; the CPU Adam updates dense tensors only "
            "(convert with .to_dense(), or use torch.optim.SparseAdam for sparse gradients)"
        )
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}; the CPU Adam works on CPU tensors (pinned memory is "
            "fine): move it with .cpu() or keep the optimizer state on the host"
        )
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); the "
            "update runs over flat memory in place, so pass a contiguous tensor (a "
            ".contiguous() copy would not see the update)"
        )


def _check_no_overlap(named: list[tuple[str, torch.Tensor]]) -> None:
    """No two buffers may share memory: the kernel writes four of them in place."""
    spans = []
    for name, t in named:
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(
                f"{n0} and {n1} share memory; every buffer of an Adam update must be distinct"
            )


def _check_step(step: object) -> int:
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or step != int(step):
        raise ValueError(f"step={step!r} must be a whole number (the count after this update)")
    if step < 1:
        raise ValueError(f"step={step!r} must be >= 1 (the step count after this update)")
    return int(step)
