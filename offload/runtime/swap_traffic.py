"""The swap bytes a step moves, for the user who weighs them against a drive's endurance.

An SSD is rated for so many terabytes written (TBW) over its life. With a tier on NVMe,
every optimizer step rewrites what the step updated: the parameter shard on disk of each unit
with something optimized in this rank's shard (after its update), and that unit's optimizer
state on disk (fp32 master and moments). A rank whose shard of a unit is all padding or
frozen parameters writes nothing for it. So the bytes written per step are fixed by the layout, and `initialize` can say
once, per node, how many terabytes 1,000 steps write (`wear_estimate`); the step report then
shows what was measured (`SwapMeter`: the NVMe tiers' I/O counters, `IOStats`, per step
since the previous report). Reads do not wear a drive; the report shows them beside.

The estimate is the engine's own arithmetic, the planner's disk model
(`offload.plan.tier_bytes.disk_bytes_per_step`: 1 write of the master and state per
trainable parameter, 1 write of each trainable parameter shard) applied to the engine's
units as they were built: this rank's shard of each (its swap-slot sizes, page-rounded) and
the per-unit placement `initialize` chose (`ShardedState.placement`) (units kept in RAM by `offload.ram_budget_bytes`
write nothing). Per node it is this rank's figure times the ranks on the node
(`LOCAL_WORLD_SIZE`), an estimate: ranks' shards differ only by padding.
tests/test_swap_traffic.py pins the figure to the bytes measured per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from offload.runtime.step_deltas import StepDeltas
from offload.runtime.view import ShardedState
from offload.sizes import align_up, format_bytes
from offload.storage.nvme import NVMeContext
from offload.storage.state_layout import state_layout

__all__ = ["SwapMeter", "WearEstimate", "bytes_written_per_step", "wear_estimate"]

TB = 10**12
"""Drive endurance is rated in decimal terabytes (TBW)."""
STEPS = 1000
"""The estimate's number of steps."""


def bytes_written_per_step(state: ShardedState) -> int:
    """This rank's swap bytes written by one optimizer step (see the module docstring), per
    unit with parameters an optimizer updates: its parameter shard when on NVMe (its slot,
    page-rounded; only the optimized prefix when the unit also holds frozen parameters, which
    are never written back: offload/units/layout.py), plus its optimizer state's slot when
    that is on NVMe (fp32 master and the optimizer's state tensors, this rank's shard)."""
    layouts = [u.layout for u in state.units]
    specs = tuple(state.optimizer.specs)
    placement = state.placement  # the one initialize built, not a second choice made here
    itemsize, rank = state.dtype.itemsize, state.rank
    written = 0
    for lay, p_disk, s_disk in zip(layouts, placement.param_on_nvme, placement.state_on_nvme):
        master = lay.shard_master_numel(rank)
        if lay.shard_optimized_numel(rank) == 0:
            continue  # nothing optimized in this rank's shard (frozen, padding): never written back
        if p_disk:
            written += align_up(lay.shard_numel * itemsize) if master == lay.shard_numel else master * itemsize
        if s_disk:
            written += state_layout(master, lay.shard_optimized_numel(rank), specs).nbytes
    return written


@dataclass(frozen=True)
class WearEstimate:
    """The one-time figure `initialize` logs."""

    rank_bytes_per_step: int
    """This rank's swap bytes written per optimizer step."""
    node_ranks: int
    """Ranks on this node (they share its disk): LOCAL_WORLD_SIZE."""

    @property
    def node_bytes_per_step(self) -> int:
        return self.rank_bytes_per_step * self.node_ranks

    @property
    def node_tb_per_1000_steps(self) -> float:
        """Decimal terabytes this node writes in 1,000 optimizer steps."""
        return self.node_bytes_per_step * STEPS / TB

    def line(self) -> str:
        ranks = f" x {self.node_ranks} ranks on this node" if self.node_ranks > 1 else ""
        return (f"swap writes: ~{self.node_tb_per_1000_steps:.3g} TB per 1,000 optimizer steps on "
                f"this node ({format_bytes(self.rank_bytes_per_step)} per step per rank{ranks}); "
                f"weigh it against the drive's rated endurance (TBW), or keep more units in RAM "
                f"(offload.ram_budget_bytes) to write less")

    def as_dict(self) -> dict[str, Any]:
        return {"rank_bytes_per_step": self.rank_bytes_per_step, "node_ranks": self.node_ranks,
                "node_bytes_per_step": self.node_bytes_per_step,
                "node_tb_per_1000_steps": self.node_tb_per_1000_steps}


def wear_estimate(state: ShardedState) -> Optional[WearEstimate]:
    """The estimate, or None when no tier is on NVMe (nothing is written)."""
    if state.nvme is None:
        return None
    per_step = bytes_written_per_step(state)
    return WearEstimate(per_step, state.pg.local_world_size) if per_step else None


class SwapMeter:
    """Swap bytes written and read per optimizer step, measured from the NVMe tiers' I/O
    counters (`IOStats`): `per_step(n)` is the mean over the steps since its previous call
    (the first: since `initialize`, whose own writes of the initial shards it leaves out)."""

    def __init__(self, nvme: Optional[NVMeContext], node_ranks: int) -> None:
        self.nvme = nvme
        self.node_ranks = node_ranks
        self._deltas = StepDeltas(self._counters)

    def _counters(self) -> tuple[int, int]:
        stats = self.nvme.stats if self.nvme is not None else None
        return (stats.bytes_written, stats.bytes_read) if stats is not None else (0, 0)

    def per_step(self, n: int) -> Optional[dict[str, float]]:
        """{"swap_written_bytes", "swap_read_bytes"} per step on this rank, and
        "node_swap_written_bytes" (this rank's x the node's ranks: an estimate); None
        without an NVMe tier. `n`: the optimizer steps taken so far."""
        if self.nvme is None:
            return None
        written, read = self._deltas.per_step(n)
        return {"swap_written_bytes": written, "swap_read_bytes": read,
                "node_swap_written_bytes": written * self.node_ranks}


def swap_text(r: dict[str, Any]) -> str:
    """The step report's part: 'swap written 704.00 KiB/step (node ~1.38 MiB), read ...'."""
    node = (f" (node ~{format_bytes(r['node_swap_written_bytes'])})"
            if r["node_swap_written_bytes"] != r["swap_written_bytes"] else "")
    return (f"swap written {format_bytes(r['swap_written_bytes'])}/step{node}, "
            f"read {format_bytes(r['swap_read_bytes'])}/step")
