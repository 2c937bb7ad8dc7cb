"""How many units' optimizer state the planner puts on the GPU (`placement: auto`): the update
split ([Note: the update split] in offload/storage/device_states.py), sized from rates.

[Note: the split rule]
The units go to the device in the engine's order (the root, then the first blocks: backward
reduces them last, the next forward needs them first). With k of them there:
- the GPU runs the step's compute (`SplitRates.compute_s`) and then, on the same stream, the
  device units' updates: compute_s + (their trainable elements) / device rate;
- the CPU runs the other units' updates beside it, most of them under backward:
  (their elements) / CPU rate;
and the step is about the larger of the two. The rule takes the k that makes it smallest,
the fewest units among equals, such that the device units' bytes (fp32 master, state
tensors, gradient shard, and the parameter shard where the parameter tier is not the device)
fit in the device memory left after parameters, working set and activations. The rates are
inputs: a measured machine profile's CPU optimizer rate where there is one, the step-time
model's compute time where it has one (offload/plan/step_time.py), else the nominal figures
below (the compute from the model's shape at `NOMINAL_DEVICE_FLOPS`), said so in the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["SplitRates", "DeviceSplit", "choose_device_split", "split_for_plan", "unit_split_sizes",
           "NOMINAL_CPU_ELEMS_PER_S", "NOMINAL_DEVICE_ELEMS_PER_S", "NOMINAL_DEVICE_FLOPS", "nominal_compute_s",
           "split_compute_s", "ASSUMED_TOKENS"]

NOMINAL_CPU_ELEMS_PER_S = 5e9
"""Elements/s of the CPU Adam on a 16-core host at memory bandwidth (~28-30 B per element:
about 1.3e9 parameters in 0.26 s), when no profile measured it."""
NOMINAL_DEVICE_ELEMS_PER_S = 5e10
"""Elements/s of torch's fused AdamW on a current data-centre GPU (~32 B per element at
half of an H100's 3.35 TB/s), when no profile measured it."""


NOMINAL_DEVICE_FLOPS = 4e14
"""bf16 FLOP/s a current data-centre GPU sustains on a transformer's matmuls (about 40 % of an
H100's dense peak), for the compute time when no profile measured it."""


ASSUMED_TOKENS = 8 * 1024
"""Tokens per step the split assumes when neither a model shape nor `logging.tokens_per_step`
says (8 sequences of 1024): the compute the CPU updates overlap grows with them."""


def split_compute_s(predicted_s: Optional[float], shape: Any, params: int,
                    tokens: Optional[int]) -> tuple[float, str]:
    """The compute the rule weighs, and in words where it comes from: the step-time model's
    (a profile and a shape), else the shape's tokens, else `tokens` (the config's
    `logging.tokens_per_step`), else `ASSUMED_TOKENS`, at `NOMINAL_DEVICE_FLOPS`."""
    if predicted_s is not None:
        return predicted_s, "measured rates, the step-time model's compute"
    if shape is not None:
        return nominal_compute_s(shape.params, shape.tokens), f"nominal rates, {shape.tokens} tokens per step"
    n = tokens or ASSUMED_TOKENS
    return nominal_compute_s(params, n), f"nominal rates, {n} tokens per step{'' if tokens else ' assumed'}"


def nominal_compute_s(params: int, tokens: int) -> float:
    """Forward and backward of `params` over `tokens` at `NOMINAL_DEVICE_FLOPS` (6 FLOPs per
    parameter per token): the compute the CPU updates overlap, when nothing measured it."""
    return 6.0 * params * tokens / NOMINAL_DEVICE_FLOPS


@dataclass(frozen=True)
class SplitRates:
    """What the rule weighs (see [Note: the split rule])."""

    cpu_elems_per_s: float
    """The CPU optimizer's rate (elements per second, all its threads)."""
    device_elems_per_s: float
    """The device update's rate (elements per second)."""
    compute_s: float = 0.0
    """The step's compute on the device (forward and backward), which the CPU updates overlap."""
    measured: bool = False
    """Whether the rates come from a machine profile (else the nominal figures)."""


@dataclass(frozen=True)
class DeviceSplit:
    """The rule's answer: the first `units` units on the device, their `bytes`, and the step
    times it weighed (seconds) for that count and for none."""

    units: int
    bytes: int
    step_s: float
    all_cpu_step_s: float
    room_bytes: int


def choose_device_split(elems: Sequence[int], device_bytes: Sequence[int], room_bytes: int,
                        rates: SplitRates) -> DeviceSplit:
    """The count of units, taken from the first, whose optimizer state goes on the device
    ([Note: the split rule]): `elems[i]` unit i's trainable elements on this rank,
    `device_bytes[i]` what putting it there adds to device memory, `room_bytes` the memory
    left for them."""
    if len(elems) != len(device_bytes):
        raise ValueError(f"{len(elems)} element counts for {len(device_bytes)} byte counts")
    if rates.cpu_elems_per_s <= 0 or rates.device_elems_per_s <= 0:
        raise ValueError(f"rates must be > 0: {rates}")
    total = sum(int(e) for e in elems)

    def step(on_device: int) -> float:
        return max(rates.compute_s + on_device / rates.device_elems_per_s,
                   (total - on_device) / rates.cpu_elems_per_s)

    none = step(0)
    best, best_s, best_bytes = 0, none, 0
    used = on = 0
    for k in range(1, len(elems) + 1):
        used += int(device_bytes[k - 1])
        if used > room_bytes:
            break
        on += int(elems[k - 1])
        t = step(on)
        if t < best_s * (1 - 1e-9):  # strictly faster: among equals, the fewest units
            best, best_s, best_bytes = k, t, used
    return DeviceSplit(best, best_bytes, best_s if math.isfinite(best_s) else none, none,
                       max(0, int(room_bytes)))


def unit_split_sizes(spec: Any, param_on_device: bool, p_bytes: int,
                     world_size: int) -> tuple[list[int], list[int]]:
    """Per unit of `spec` (a `ModelSpec`, offload/plan/tier_bytes.py): its trainable elements
    on the largest rank, and the device bytes its optimizer state adds there (fp32 master,
    state tensors, gradient shard; its parameter shard too unless the parameter tier is the
    device already), as `rank_bytes` counts a device unit."""
    elems, sizes = [], []
    for u in spec.units:
        lay = u.layout
        opt = max(lay.shard_optimized_numel(r) for r in range(world_size))
        master = max(lay.shard_master_numel(r) for r in range(world_size)) * 4
        state = sum(s.numel(opt) * s.dtype.itemsize for s in spec.states)
        elems.append(opt)
        sizes.append(2 * master + state + (0 if param_on_device else lay.shard_numel * p_bytes))
    return elems, sizes


def split_for_plan(spec: Any, param_tier: str, room_bytes: int, p_bytes: int, world_size: int,
                   rates: SplitRates, recompute_frees_bytes: int = 0) -> tuple[DeviceSplit, int]:
    """The split the planner recommends within `room_bytes` of GPU memory, and how many units
    more would go there with the `recompute_frees_bytes` activation recompute frees."""
    elems, sizes = unit_split_sizes(spec, param_tier == "device", p_bytes, world_size)
    split = choose_device_split(elems, sizes, room_bytes, rates)
    more = 0
    if recompute_frees_bytes > 0:
        more = choose_device_split(elems, sizes, room_bytes + recompute_frees_bytes, rates).units - split.units
    return split, more
