"""The argument checks every flat native optimizer step shares (Adam, Lion, Adagrad).

Python owns the tensors and checks them once, before their addresses go to the native
kernels: dtype, device, layout, contiguity, sizes, no shared memory; then the kernel name
and the thread count. A bad argument is a Python exception that names it.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Optional, Sequence

import torch

from offload._native import C

# dtype codes of the native binding (csrc/adam/adam.h, DType).
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)
"""Optimizer states (Adam's moments, Lion's momentum, Adagrad's sum): fp32, or bf16."""
OUT_DTYPES = (torch.bfloat16, torch.float16)
ISAS = ("auto", "scalar", "portable", "avx2", "avx512")
ISA_ENV = "OFFLOAD_ADAM_ISA"
"""The environment variable that forces the kernel of every native optimizer step (Adam,
Lion, Adagrad) in the process (and in the processes it starts): how a test or a user
reproduces another CPU's code path, as ATEN_CPU_CAPABILITY does for torch's own kernels.
Unset or 'auto': the best this CPU runs. (Named for Adam, the first of them.)"""


def forced_isa() -> str:
    """The kernel OFFLOAD_ADAM_ISA names ('auto' when unset), checked against this CPU."""
    name = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    if name == "auto":
        return name
    if name not in ISAS:
        raise ValueError(
            f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not an Adam kernel; set it to one of "
            f"{', '.join(ISAS)}, or unset it"
        )
    supported = list(C.adam_supported_isas())
    if name not in supported:
        raise ValueError(
            f"{ISA_ENV}={name!r}: this CPU cannot run the {name} Adam kernel; it runs "
            f"{', '.join(supported)} (unset {ISA_ENV} for the best, {C.adam_isa()!r})"
        )
    return name


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} has layout {t.layout}; the CPU optimizer kernels update dense tensors "
            "only (convert with .to_dense(), or use torch.optim.SparseAdam for sparse gradients)"
        )
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}; the CPU optimizer kernels work on CPU tensors (pinned "
            "memory is fine): move it with .cpu() or keep the optimizer state on the host"
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


def check_same_numel(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Every buffer covers as many elements as the first (the master); returns that count."""
    n = named[0][1].numel()
    for name, t in named[1:]:
        if t.numel() != n:
            raise ValueError(
                f"{name} has {t.numel()} elements but {named[0][0]} has {n}; all buffers of one "
                "update must cover the same elements"
            )
    return n


def check_no_overlap(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """No two buffers may share memory: the kernels write most of them in place."""
    spans = []
    for name, t in named:
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(
                f"{n0} and {n1} share memory; every buffer of one optimizer update must be distinct"
            )


def check_step(step: object) -> int:
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or step != math.floor(step):
        raise ValueError(f"step={step!r} must be a whole number (the count after this update)")
    if step < 1:
        raise ValueError(f"step={step!r} must be >= 1 (the step count after this update)")
    return int(math.floor(step))


def check_isa_and_threads(isa: Optional[str], threads: Optional[int]) -> tuple[str, int]:
    """(the kernel name, the thread count: 0 for the default) a native step is called with."""
    if isa is None:
        isa = forced_isa()
    elif isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not a kernel name; choose one of {ISAS} or None")
    if threads is None:
        threads = 0
    elif not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an int >= 1, or None for the default")
    return isa, int(threads)
