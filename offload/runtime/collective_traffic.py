"""The bytes a step's collectives send within this rank's node and across nodes, for the
step report (`CollectiveMeter`), from the engine's own accounting: the counters the unit
collectives keep (`NodeTraffic` in offload/units/groups.py, [Note: bytes a collective
sends] there). What they should be for each sharding mode is docs/multinode.md's arithmetic;
tests/test_hybrid.py pins the counters to it."""

from __future__ import annotations

from typing import Any, Optional

from offload.sizes import format_bytes
from offload.runtime.step_deltas import StepDeltas
from offload.units.groups import ProcessGroupInfo

__all__ = ["CollectiveMeter", "collective_text"]


class CollectiveMeter:
    """`per_step(n)`: this rank's collective bytes per optimizer step, within its node and
    across nodes, the mean over the steps since its previous call (the first: since
    `initialize`); None at world size 1 (no collective)."""

    def __init__(self, pg: ProcessGroupInfo) -> None:
        self.hybrid = pg.hybrid
        self._deltas = StepDeltas(self._counters)

    def _counters(self) -> tuple[int, int]:
        t = self.hybrid.traffic if self.hybrid is not None else None
        return (t.within_node_bytes, t.across_nodes_bytes) if t is not None else (0, 0)

    def per_step(self, n: int) -> Optional[dict[str, Any]]:
        """{"collective_within_node_bytes", "collective_across_nodes_bytes"} per step on this
        rank, and "sharding" (the mode's name). `n`: the optimizer steps taken so far."""
        if self.hybrid is None:
            return None
        within, across = self._deltas.per_step(n)
        return {"sharding": self.hybrid.mode.name, "collective_within_node_bytes": within,
                "collective_across_nodes_bytes": across}


def collective_text(r: dict[str, Any]) -> str:
    """The step report's part: 'HSDP collectives 1.62 MiB/step within node, 144.00 KiB across'."""
    return (f"{r['sharding']} collectives {format_bytes(r['collective_within_node_bytes'])}/step within "
            f"node, {format_bytes(r['collective_across_nodes_bytes'])} across")
