"""Adam/AdamW with 8-bit moments: the flat-shard step, its quantiser, and their definitions.

The master stays fp32; each moment is one byte per element plus one fp32 scale per block of
256, so the optimizer state is 6.03 B/param instead of 12 (fp32 moments) or 8 (bf16), and
an NVMe-tier step moves half the optimizer bytes of fp32 moments.

**The definition** (bitsandbytes' blockwise 8-bit optimizers and torchao's `AdamW8bit`,
Dettmers et al. 2022, arXiv:2110.02861; csrc/adam8bit/adam8bit.h, [Note: 8-bit moments]):

- blocks of `BLOCK_SIZE` = 256 consecutive elements, counted from element 0 of the flat
  tensor (the last may be shorter); per block one fp32 scale, the block's absmax;
- per element one uint8 code indexing a sorted 256-entry map: `dynamic_map(signed=True)` for
  exp_avg (0 at code 127), `dynamic_map(signed=False)` for exp_avg_sq (0 at code 0), the
  dynamic ("tree") maps of bitsandbytes' `create_dynamic_map`;
- dequantised value = map[code] * scale (one fp32 multiply);
- code = the map entry nearest to x * (1 / scale) (fp32, the reciprocal rounded once per
  block), exactly; a tie (an fp32 value exactly on a midpoint) goes to the larger code;
- a block whose absmax is below 2^-126 (all zeros, subnormals) stores scale 0 and the zero
  code; a block holding inf or NaN stores scale NaN and the zero code, so the whole block
  dequantises to NaN (a diverged moment stays visible, as it would in fp32 Adam);
- one step: dequantise m and v, the fp32 Adam update exactly as `adam_step_flat` computes it
  (csrc/adam/adam_math.h, [Note: operation order]) with p written from the *unquantised* new
  m and v, then re-quantise m and v with their new absmax. The first step from zero moments
  therefore equals `adam_step_flat`'s bit for bit; afterwards the moments carry the
  quantisation error (relative ~1/2 the map's local spacing: <= 0.7 % near a block's absmax,
  coarser for values a decade or more below it).

The native kernels (scalar reference, portable, AVX2, AVX-512) agree bit for bit with each
other, for every thread count (threads take whole blocks), and with `quantize_blockwise_reference`
(torch ops); `adam8bit_step_flat_reference` is the step in torch ops (torch's op-by-op Adam:
the last fp32 bits of p may differ, and a moment within an ulp of a midpoint may take the
neighbouring code). Block size 256 as torchao: one outlier coarsens only its 255 neighbours,
the scales cost 0.03 B/param, and 256 is a multiple of every vector width and chunk alignment.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from offload._native import C
from offload.optim.flat_args import (
    DTYPE_CODE,
    GRAD_DTYPES,
    OUT_DTYPES,
    check_isa_and_threads,
    check_no_overlap,
    check_same_numel,
    check_step,
    check_tensor,
)
from offload.optim.functional import adam_step_flat_reference

__all__ = [
    "BLOCK_SIZE",
    "Moments8bit",
    "adam8bit_step_flat",
    "adam8bit_step_flat_reference",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "dynamic_map",
    "num_blocks",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "zero_code",
]

BLOCK_SIZE = 256
"""Elements per quantisation block (one fp32 scale each); csrc/adam8bit/adam8bit.h."""

_SMALLEST_NORMAL = 2.0**-126


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of bitsandbytes' dynamic 8-bit map (`create_dynamic_map(signed)`, 7
    exponent bits), ascending, fp32, evaluated with torch's float32 ops as bitsandbytes and
    torchao evaluate it.

    Decade i (values 10^(i-6) * [0.1, 1]) holds 2^i (signed: and their negatives) or 2^(i+1)
    (unsigned) codes at the centres of equal steps of [0.1, 1]; then 0 and 1. Signed: 127
    negative codes down to -0.99297 (no -1), 0 at code 127, 1 at 255. Unsigned: 0 at code 0.
    csrc/adam8bit/code_maps.h is this function's output (tools/gen_adam8bit_maps.py).
    """
    values = [0.0, 1.0]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1)
        centres = (edges[:-1] + edges[1:]) / 2.0
        values += ((10.0 ** (i - 6)) * centres).tolist()
        if signed:
            values += (-(10.0 ** (i - 6)) * centres).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def num_blocks(numel: int) -> int:
    """Scales per moment for `numel` elements: ceil(numel / BLOCK_SIZE)."""
    return (int(numel) + BLOCK_SIZE - 1) // BLOCK_SIZE


class Moments8bit(NamedTuple):
    """The 8-bit moments of one flat partition, in the order `adam8bit_step_flat` takes them."""

    exp_avg_codes: torch.Tensor
    """uint8, one per element: indices into dynamic_map(signed=True)."""
    exp_avg_scales: torch.Tensor
    """fp32, one per block of 256 elements."""
    exp_avg_sq_codes: torch.Tensor
    """uint8, one per element: indices into dynamic_map(signed=False)."""
    exp_avg_sq_scales: torch.Tensor
    """fp32, one per block."""

    @staticmethod
    def zeros(numel: int, *, pin_memory: bool = False) -> "Moments8bit":
        """Zero moments (what Adam starts from): the zero codes and zero scales."""
        blocks = num_blocks(numel)
        return Moments8bit(
            torch.full((numel,), zero_code(True), dtype=torch.uint8, pin_memory=pin_memory),
            torch.zeros(blocks, dtype=torch.float32, pin_memory=pin_memory),
            torch.full((numel,), zero_code(False), dtype=torch.uint8, pin_memory=pin_memory),
            torch.zeros(blocks, dtype=torch.float32, pin_memory=pin_memory),
        )


# -- the quantiser ------------------------------------------------------------------------


def zero_code(signed: bool) -> int:
    """The code whose value is 0: what a fresh moment holds (exp_avg: 127, exp_avg_sq: 0)."""
    return 127 if signed else 0


def _thresholds(signed: bool) -> torch.Tensor:
    """The 255 decision points of the nearest-code rule: for adjacent codes c[j] < c[j+1],
    the smallest fp32 >= their midpoint (exact in float64), so that `y >= t[j]` says "y is at
    least as near c[j+1]" exactly, for every fp32 y."""
    c = dynamic_map(signed).double()
    mid = (c[:-1] + c[1:]) / 2
    t = mid.float()
    low = t.double() < mid
    t[low] = torch.nextafter(t[low], torch.full_like(t[low], math.inf))
    return t


def quantize_blockwise_reference(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in torch ops: (uint8 codes shaped like x, fp32 scales per block)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = torch.zeros(num_blocks(n) * BLOCK_SIZE, dtype=torch.float32)
    blocks[:n] = flat
    blocks = blocks.view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1) if n else torch.zeros(0)  # NaN wins, then inf
    nonfinite = ~torch.isfinite(absmax)
    special = nonfinite | (absmax < _SMALLEST_NORMAL)
    scales = torch.where(nonfinite, torch.full_like(absmax, math.nan),
                         torch.where(special, torch.zeros_like(absmax), absmax))
    inv = torch.where(special, torch.zeros_like(absmax),
                      torch.div(torch.ones_like(absmax), torch.where(special, 1.0, absmax)))
    y = blocks * inv[:, None]
    codes = torch.searchsorted(_thresholds(signed), y.reshape(-1), right=True)  # #{t <= y}
    codes = torch.where(special.repeat_interleave(BLOCK_SIZE), zero_code(signed), codes)
    return codes[:n].to(torch.uint8).view(x.shape), scales


def dequantize_blockwise_reference(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """map[code] * scale in torch ops: fp32, shaped like codes."""
    n = codes.numel()
    values = dynamic_map(signed)[codes.reshape(-1).long()]
    return (values * scales.repeat_interleave(BLOCK_SIZE)[:n]).view(codes.shape)


def quantize_blockwise(
    x: torch.Tensor,
    signed: bool,
    *,
    codes: Optional[torch.Tensor] = None,
    scales: Optional[torch.Tensor] = None,
    isa: Optional[str] = None,
    threads: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blockwise_reference`, natively (the step's own quantiser): returns (codes,
    scales), written into `codes` (uint8, x's numel) and `scales` (fp32, num_blocks) when given.
    x is fp32, contiguous, on the CPU."""
    check_tensor("x", x, (torch.float32,))
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8) if codes is None else codes
    scales = torch.empty(num_blocks(n), dtype=torch.float32) if scales is None else scales
    _check_codes_and_scales("codes", codes, "scales", scales, n)
    check_no_overlap([("x", x), ("codes", codes), ("scales", scales)])
    isa, threads = check_isa_and_threads(isa, threads)
    C.quantize_blockwise(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), n, bool(signed), isa, threads)
    return codes, scales


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    signed: bool,
    *,
    out: Optional[torch.Tensor] = None,
    threads: Optional[int] = None,
) -> torch.Tensor:
    """map[code] * scale, natively: fp32 shaped like codes (or written into `out`)."""
    n = codes.numel()
    _check_codes_and_scales("codes", codes, "scales", scales, n)
    out = torch.empty(codes.shape, dtype=torch.float32) if out is None else out
    check_tensor("out", out, (torch.float32,))
    check_same_numel([("codes", codes), ("out", out)])
    check_no_overlap([("codes", codes), ("scales", scales), ("out", out)])
    _, threads = check_isa_and_threads(None, threads)
    C.dequantize_blockwise(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), n, bool(signed), threads)
    return out


# -- the step ----------------------------------------------------------------------------------


def adam8bit_step_flat_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
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
    """One step of the definition in torch ops: dequantise, `adam_step_flat_reference`
    (torch's op-by-op Adam/AdamW), re-quantise; everything updated in place."""
    m = dequantize_blockwise_reference(exp_avg_codes, exp_avg_scales, True)
    v = dequantize_blockwise_reference(exp_avg_sq_codes, exp_avg_sq_scales, False)
    adam_step_flat_reference(
        master, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
        grad_scale=grad_scale, out_lowp=out_lowp,
    )
    for moment, codes, scales, signed in ((m, exp_avg_codes, exp_avg_scales, True),
                                          (v, exp_avg_sq_codes, exp_avg_sq_scales, False)):
        new_codes, new_scales = quantize_blockwise_reference(moment, signed)
        codes.copy_(new_codes)
        scales.copy_(new_scales)


def adam8bit_step_flat(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_codes: torch.Tensor,
    exp_avg_scales: torch.Tensor,
    exp_avg_sq_codes: torch.Tensor,
    exp_avg_sq_scales: torch.Tensor,
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
    """One fused Adam/AdamW update with 8-bit moments of a flat fp32 master partition, in place.

    `adam_step_flat`'s contract with the moments replaced by `Moments8bit`'s four tensors:
    `master` fp32; `grad` fp32, bf16 or fp16, multiplied by `grad_scale` on the way in; the
    codes uint8 (master's numel), the scales fp32 (`num_blocks(numel)`), all updated in
    place; `out_lowp` (bf16 or fp16), if given, receives the updated master rounded to nearest
    even in the same pass. `step` is the count after this update; the hyper-parameters are
    `adam_step_flat`'s and checked the same way. Blocks start at element 0 of these tensors,
    so a partition must keep the same start (a multiple of 256 within the whole) from step to
    step. `isa` / `threads` as for Adam; results depend on neither. Releases the GIL.
    """
    check_tensor("master", master, (torch.float32,))
    check_tensor("grad", grad, GRAD_DTYPES)
    n = master.numel()
    _check_codes_and_scales("exp_avg_codes", exp_avg_codes, "exp_avg_scales", exp_avg_scales, n)
    _check_codes_and_scales("exp_avg_sq_codes", exp_avg_sq_codes, "exp_avg_sq_scales",
                            exp_avg_sq_scales, n)
    named = [("master", master), ("grad", grad)]
    if out_lowp is not None:
        check_tensor("out_lowp", out_lowp, OUT_DTYPES)
        named.append(("out_lowp", out_lowp))
    check_same_numel(named)
    check_no_overlap(named + [("exp_avg_codes", exp_avg_codes), ("exp_avg_scales", exp_avg_scales),
                              ("exp_avg_sq_codes", exp_avg_sq_codes),
                              ("exp_avg_sq_scales", exp_avg_sq_scales)])
    step_int = check_step(step)
    isa, threads = check_isa_and_threads(isa, threads)
    if n == 0:
        return
    C.adam8bit_step(
        master.data_ptr(), grad.data_ptr(), exp_avg_codes.data_ptr(), exp_avg_scales.data_ptr(),
        exp_avg_sq_codes.data_ptr(), exp_avg_sq_scales.data_ptr(),
        out_lowp.data_ptr() if out_lowp is not None else 0, n, DTYPE_CODE[grad.dtype],
        DTYPE_CODE[out_lowp.dtype] if out_lowp is not None else -1, step_int, float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled_weight_decay),
        float(grad_scale), isa, threads,
    )


def _check_codes_and_scales(codes_name: str, codes: torch.Tensor, scales_name: str,
                            scales: torch.Tensor, numel: int) -> None:
    check_tensor(codes_name, codes, (torch.uint8,))
    check_tensor(scales_name, scales, (torch.float32,))
    if codes.numel() != numel:
        raise ValueError(f"{codes_name} has {codes.numel()} elements but the data has {numel}; "
                         "one code per element")
    if scales.numel() != num_blocks(numel):
        raise ValueError(
            f"{scales_name} has {scales.numel()} elements; {numel} elements need "
            f"{num_blocks(numel)} (one per block of {BLOCK_SIZE}: num_blocks(numel))"
        )
