"""Which sharding mode to run past one node: the planner's placements for full sharding,
ZeRO++ hpZ and HSDP on the same nodes, the bytes each sends within and across nodes per
step, and the mode it recommends with its reason (docs/multinode.md).

    python -m offload.plan --params 70e9 --nodes 4 --gpus 8 --gpu-mem 80GiB --cpu-mem 2TiB --sharding
    compare_sharding(70e9, machine=Machine(world_size=32, ranks_per_node=8, ...))

Memory: full sharding and hpZ keep each rank's 1/W of the optimizer state, so a node holds
L/W of it; HSDP shards within the node only (`shard_group_size` = the ranks per node), so
every node holds a whole replica: it is planned as `plan` plans one node alone (world size
L). hpZ adds its secondary copy, 1/L of the parameters in the compute dtype, on each rank's
compute device. Traffic: the arithmetic of docs/multinode.md (`collective_bytes`), which
tests/test_hybrid.py pins to the engine's own counters. The recommendation: the mode that
fits and sends the fewest bytes across nodes (HSDP, then hpZ, then full sharding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from offload.config import load_config
from offload.dtypes import DTYPES
from offload.plan.machine import Machine, format_size
from offload.plan.planner import Plan, plan
from offload.plan.table import choice_text

__all__ = ["ShardingChoice", "ModePlan", "collective_bytes", "compare_sharding", "MODES"]

MODES = ("HSDP", "hpZ", "full sharding")
"""In the order of preference: fewest bytes across nodes first."""

GRAD_BYTES = 4
"""offload reduces gradients in fp32 whatever the compute dtype (offload/units/shard.py)."""


def collective_bytes(mode: str, world_size: int, ranks_per_node: int, param_bytes: int) -> tuple[float, float]:
    """(within the node, across nodes): bytes one rank sends per optimizer step per parameter
    of the model, one micro-batch per step, every unit gathered for forward and again for
    backward (docs/multinode.md's table; HSDP's shard group is the node)."""
    w, l, b, g = world_size, ranks_per_node, param_bytes, GRAD_BYTES
    if mode == "full sharding":
        return (2 * b + g) * (l - 1) / w, (2 * b + g) * (w - l) / w
    if mode == "hpZ":
        return b * (l - 1) / w + b * (l - 1) / l + g * (l - 1) / w, (b + g) * (w - l) / w
    assert mode == "HSDP", mode
    groups = w // l
    return (2 * b + g) * (l - 1) / l, 2 * g * (groups - 1) / (groups * l)


@dataclass(frozen=True)
class ModePlan:
    mode: str
    plan: Plan
    within_node_bytes_per_step: float
    """Bytes one rank sends to ranks on its node per step (collectives of the units)."""
    across_nodes_bytes_per_step: float
    secondary_bytes_per_rank: int = 0
    """hpZ: the node-local copy on each rank's compute device."""

    @property
    def fits(self) -> bool:
        return self.plan.recommended is not None

    def to_dict(self) -> dict[str, Any]:
        e = self.plan.recommended
        return {"mode": self.mode, "fits": self.fits,
                "placement": None if e is None else {"param_tier": e.param_tier, "optimizer_tier": e.optimizer_tier},
                "host_bytes_per_node": None if e is None else e.per_node.host_total,
                "within_node_bytes_per_step": self.within_node_bytes_per_step,
                "across_nodes_bytes_per_step": self.across_nodes_bytes_per_step,
                "secondary_bytes_per_rank": self.secondary_bytes_per_rank, "reason": self.plan.reason}


@dataclass(frozen=True)
class ShardingChoice:
    modes: tuple[ModePlan, ...]
    recommended: Optional[ModePlan]
    reason: str

    def config_snippet(self) -> dict[str, Any]:
        r = self.recommended
        if r is None or r.plan.recommended is None:
            return {}
        l = r.plan.machine.local_ranks
        section = ({"shard_group_size": l} if r.mode == "HSDP" else
                   {"hpz_partition_size": l} if r.mode == "hpZ" else {})
        out: dict[str, Any] = dict(r.plan.config_snippet())
        if section:
            out["sharding"] = section
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"modes": [m.to_dict() for m in self.modes],
                "recommended": None if self.recommended is None else self.recommended.mode,
                "reason": self.reason, "config": self.config_snippet()}

    def __str__(self) -> str:
        full = next(m for m in self.modes if m.mode == "full sharding")
        m = full.plan.machine
        head = ["mode", "fastest placement that fits", "host/node", "within node/step", "across nodes/step"]
        rows = []
        for mp in self.modes:
            e = mp.plan.recommended
            rows.append([mp.mode, "none fits" if e is None else f"params {e.param_tier}, optimizer {e.optimizer_tier}",
                         "" if e is None else format_size(e.per_node.host_total),
                         format_size(mp.within_node_bytes_per_step), format_size(mp.across_nodes_bytes_per_step)])
        title = (f"sharding modes for {full.plan.params:,} parameters on {m.nodes} nodes of "
                 f"{m.local_ranks} ranks ({m.describe()}); bytes one rank sends per step")
        return choice_text(title, head, rows, None if self.recommended is None else self.recommended.mode,
                           "mode", self.reason, self.config_snippet())


def compare_sharding(model_or_params: Any, *, machine: Machine, config: Any = None, **kw: Any) -> ShardingChoice:
    """`plan` for each mode of `MODES` on `machine` (several nodes: world size > ranks per
    node; keyword arguments as `plan`'s), the bytes each sends, and the mode to run (see the
    module docstring)."""
    cfg = load_config(config)
    w, l = machine.world_size, machine.local_ranks
    if machine.nodes < 2 or w % l:
        raise ValueError(f"comparing sharding modes needs several whole nodes: world size {w} with "
                         f"{l} ranks per node; give --nodes N (N >= 2) or a --world-size that is a "
                         f"multiple of the ranks per node")
    full = plan(model_or_params, machine=machine, config=cfg, **kw)
    one_node = plan(model_or_params, machine=replace(machine, world_size=l, ranks_per_node=l), config=cfg, **kw)
    b = DTYPES[kw.get("dtype") or cfg.precision.dtype].itemsize
    secondary = -(-full.params // l) * b
    modes = []
    for mode, p in (("HSDP", one_node), ("hpZ", full), ("full sharding", full)):
        within, across = collective_bytes(mode, w, l, b)
        modes.append(ModePlan(mode, p, within * full.params, across * full.params,
                              secondary if mode == "hpZ" else 0))
    by_mode = {mp.mode: mp for mp in modes}
    gpu_room = (machine.gpu_mem_bytes or 0) - machine.gpu_reserve_bytes
    for mode in MODES:
        mp = by_mode[mode]
        e = mp.plan.recommended
        if e is None:
            continue
        if mode == "hpZ" and machine.gpus_per_node and \
                e.per_rank.device + e.working_device_bytes + secondary > gpu_room:
            continue  # its node-local copy does not fit beside the rest on the GPU
        why = f"sends {format_size(mp.across_nodes_bytes_per_step)} per rank per step across nodes"
        if mode == "HSDP":
            why += f" (a whole replica per node: {format_size(e.per_node.host_total)} of host memory fits)"
        else:
            hsdp = by_mode["HSDP"].plan
            why += (f"; HSDP would need a whole replica per node, which does not fit ({hsdp.reason})"
                    if hsdp.recommended is None else "")
            if mode == "hpZ":
                why += f"; its node-local copy takes {format_size(secondary)} per rank"
        return ShardingChoice(tuple(modes), mp, why)
    return ShardingChoice(tuple(modes), None, full.reason)
