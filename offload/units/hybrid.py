"""A unit's collectives over the hybrid-sharding groups (offload/units/groups.py): the
all-gather (over the group the units shard over, or, with hpZ, over the node group from the
secondary copy `SecondaryShard`), the gradient reduce-scatter and HSDP's average across
replicas; each counts the bytes it sends within and across nodes ([Note: bytes a collective
sends] in offload/units/groups.py).

[Note: hpZ's secondary copy]
ZeRO++ hpZ (arXiv:2306.10209, section 3.2): a unit's forward all-gather runs over every rank
from the primary shards (the optimizer's); right after it, each rank keeps its 1/L slice of
the gathered full buffer (L = `sharding.hpz_partition_size`, its node group's ranks), which
holds the same values the primary shards do. The next gather of the unit - backward's
re-gather, or a later micro-batch's forward - all-gathers those slices within the node
group: the same bytes, without crossing nodes. The copy is dropped whenever the unit's shard
changes (`FlatUnit.invalidate`: an optimizer update, a load, a write through
`engine.gathered`), so the next gather goes over the world again and no rank ever reads a
stale value. Every rank of the world invalidates the same units at the same points, so all
ranks choose the same group for each gather (the collectives stay matched).
"""

from __future__ import annotations

import datetime
import enum
from typing import Callable, Optional

import torch
import torch.distributed as dist

import offload.units.collectives as _dist
from offload.units.groups import HybridGroups, ProcessGroupInfo

__all__ = ["SecondaryShard", "SecondaryState", "all_gather_unit", "reduce_scatter_unit", "all_reduce_unit",
           "average_across_replicas", "secondary_for"]


class SecondaryState(enum.Enum):
    EMPTY = "no copy: the unit's next gather goes over the world and keeps one"
    HELD = ("`copy` holds this rank's 1/L of the unit's full buffer, as of its last gather over "
            "the world; the next gather runs within the node group from it")


class SecondaryShard:
    """hpZ's node-local copy of one unit's parameters on one rank ([Note: hpZ's secondary
    copy]): `numel` = the unit's padded size / L elements, in the compute dtype, where the
    full buffer was gathered. Owned by its `FlatUnit`; called from the compute thread."""

    def __init__(self, hybrid: HybridGroups, numel: int) -> None:
        assert hybrid.node is not None, "hpZ has a node group"
        self.hybrid = hybrid
        self.node: ProcessGroupInfo = hybrid.node
        self.numel = numel
        self.state = SecondaryState.EMPTY
        self.copy: Optional[torch.Tensor] = None

    def gather(self, full: torch.Tensor, own: torch.Tensor, pg: ProcessGroupInfo,
               async_op: bool) -> Optional[dist.Work]:
        """All-gather the unit into `full`: within the node group when the copy is held, else
        over `pg` (the world), keeping the copy once the gather completed."""
        h = self.hybrid
        if self.state is SecondaryState.HELD and self.copy is not None:
            h.count(h.node_ranks, self.copy.numel() * self.copy.element_size())
            return _dist.all_gather_into(full, self.copy, self.node, async_op=async_op)
        h.count(h.shard_ranks, own.numel() * own.element_size())
        work = _dist.all_gather_into(full, own, pg, async_op=async_op)
        if work is None:
            self._keep(full)
            return None
        return _ThenWork(work, lambda: self._keep(full))

    def _keep(self, full: torch.Tensor) -> None:
        i = self.node.rank
        self.copy = full[i * self.numel:(i + 1) * self.numel].clone()
        self.state = SecondaryState.HELD

    def drop(self) -> None:
        """The unit's shard changed: the copy is stale (see the note)."""
        self.copy = None
        self.state = SecondaryState.EMPTY

    def nbytes(self) -> int:
        return 0 if self.copy is None else self.copy.numel() * self.copy.element_size()


class _ThenWork(dist.Work):
    """A collective's work whose `wait()` also runs `then` once it completed."""

    def __init__(self, work: dist.Work, then: Callable[[], None]) -> None:
        super().__init__()
        self._work: Optional[dist.Work] = work
        self._then = then

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._work is None:
            return True
        done = bool(self._work.wait(timeout))
        self._work = None
        self._then()
        return done

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


def secondary_for(pg: ProcessGroupInfo, padded_numel: int) -> Optional[SecondaryShard]:
    """A unit's hpZ secondary copy (None unless hpZ is on)."""
    h = pg.hybrid
    if h is None or h.node is None:
        return None
    return SecondaryShard(h, padded_numel // h.node.world_size)


def all_gather_unit(full: torch.Tensor, own: torch.Tensor, pg: ProcessGroupInfo,
                    secondary: Optional[SecondaryShard], async_op: bool = False) -> Optional[dist.Work]:
    """`collectives.all_gather_into` for a unit's parameters: through hpZ's secondary copy
    when there is one, and counted."""
    if secondary is not None:
        return secondary.gather(full, own, pg, async_op)
    if pg.hybrid is not None:
        pg.hybrid.count(pg.hybrid.shard_ranks, own.numel() * own.element_size())
    return _dist.all_gather_into(full, own, pg, async_op=async_op)


def reduce_scatter_unit(out: torch.Tensor, flat: torch.Tensor, pg: ProcessGroupInfo,
                        async_op: bool) -> Optional[dist.Work]:
    """`collectives.reduce_scatter_mean` for a unit's gradients, counted."""
    if pg.hybrid is not None:
        pg.hybrid.count(pg.hybrid.shard_ranks, out.numel() * out.element_size())
    return _dist.reduce_scatter_mean(out, flat, pg, async_op=async_op)


def all_reduce_unit(flat: torch.Tensor, pg: ProcessGroupInfo, async_op: bool) -> Optional[dist.Work]:
    """`collectives.all_reduce_mean_` for a unit's gradients (ZeRO stage 1), counted."""
    if pg.hybrid is not None:
        pg.hybrid.count(pg.hybrid.shard_ranks, _all_reduce_bytes(flat, pg.world_size))
    return _dist.all_reduce_mean_(flat, pg, async_op=async_op)


def _all_reduce_bytes(t: torch.Tensor, ranks: int) -> int:
    """What an all-reduce of `t` over `ranks` ranks sends to each peer: a reduce-scatter and an
    all-gather of t / ranks ([Note: bytes a collective sends])."""
    return 2 * t.numel() * t.element_size() // ranks


def average_across_replicas(t: torch.Tensor, pg: ProcessGroupInfo) -> None:
    """HSDP: `t` (this rank's reduced gradient shard) = its mean over the replicate group,
    the ranks holding the same shard in the other groups; nothing without HSDP."""
    h = pg.hybrid
    if h is None or h.replicate is None:
        return
    h.count(h.replicate_ranks, _all_reduce_bytes(t, h.replicate.world_size))
    _dist.all_reduce_mean_(t, h.replicate)
