"""Model-state memory per device under the ZeRO paper's assumptions (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3 and
Figure 1): mixed-precision Adam with fp16 parameters and gradients (2 + 2 bytes per
parameter) and K = 12 bytes of optimizer state (fp32 master, momentum and variance), over
N_d data-parallel devices.

    stage 0 (baseline)  (2 + 2 + K) Ψ
    stage 1 (P_os)      2Ψ + 2Ψ + KΨ / N_d
    stage 2 (P_os+g)    2Ψ + (2 + K)Ψ / N_d
    stage 3 (P_os+g+p)  (2 + 2 + K)Ψ / N_d

This is the paper's arithmetic, for comparing with it; what offload's engine holds (fp32
gradient partitions on the host, tiers, frozen parameters, alignment) is
`offload.plan.tier_bytes.rank_bytes`, which the planner uses.
"""

from __future__ import annotations

__all__ = ["zero_model_state_bytes"]


def zero_model_state_bytes(params: float, world_size: int, stage: int, *, k: float = 12.0,
                           param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Bytes of model state per device for `params` parameters at ZeRO `stage` (0-3) over
    `world_size` data-parallel devices, by the paper's formulas (module docstring)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage = {stage!r}; ZeRO stages are 0 (baseline), 1, 2 and 3")
    if world_size < 1:
        raise ValueError(f"world_size = {world_size!r}; it must be >= 1")
    n = float(world_size)
    p, g, o = param_bytes * params, grad_bytes * params, k * params
    return {0: p + g + o, 1: p + g + o / n, 2: p + (g + o) / n, 3: (p + g + o) / n}[stage]
