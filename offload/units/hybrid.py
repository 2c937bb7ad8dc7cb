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

[Note: HSDP averages once per step]
Under HSDP a unit's gradient is reduce-scattered within its shard group every micro-batch,
and averaged across the replicas (the other groups, on the other nodes) once per optimizer
step: inside an accumulation window the rank's gradient shard sums the group's
reductions (`ReplicaMean.LATER`), and the reduction of the window's last micro-batch adds
that sum in before the average (`FOLD`), so each gradient crosses the nodes once per step,
not once per micro-batch. The mean is linear, so this is the same average. A pass at the
boundary onto a shard already averaged (a second backward pass of the last micro-batch)
averages only its own reduction (`NOW`): an average of an average would divide and sum
again, and round. A unit no micro-batch at the boundary reached still holds un-averaged
sums at the step: the step averages its shard there (`average_shard_across_replicas`),
before the norm or any update reads it. Every rank reduces the same units at the same
points, so the replicas' collectives stay matched.
"""

from __future__ import annotations

import datetime
import enum
from typing import Callable, Optional

import torch
import torch.distributed as dist

import offload.units.collectives as _dist
from offload.units.groups import HybridGroups, ProcessGroupInfo

__all__ = ["ReplicaMean", "SecondaryShard", "SecondaryState", "all_gather_unit", "reduce_scatter_unit",
           "all_reduce_unit", "average_across_replicas", "average_shard_across_replicas", "replica_mean",
           "secondary_for"]


class ReplicaMean(enum.Enum):
    """What a unit's gradient reduction does across HSDP's replicas ([Note: HSDP averages
    once per step])."""

    NONE = "no replicas (not HSDP): the shard group's mean is the mean"
    LATER = "inside an accumulation window: the shard sums the group's reductions, averaged at the boundary"
    NOW = "at the boundary, onto a shard with nothing un-averaged: this reduction is averaged, then stored"
    FOLD = "at the boundary, onto a shard holding un-averaged sums: the shard is added in, the whole averaged"


def replica_mean(pg: ProcessGroupInfo, at_boundary: bool, accumulate: bool, unaveraged: bool) -> ReplicaMean:
    """The `ReplicaMean` of a unit's reduction: `at_boundary`, this backward pass ends the
    step's accumulation window; `accumulate`, the gradient shard holds earlier reductions of
    this step; `unaveraged`, some of them are not averaged across the replicas yet."""
    if pg.hybrid is None or pg.hybrid.replicate is None:
        return ReplicaMean.NONE
    if not at_boundary:
        return ReplicaMean.LATER
    return ReplicaMean.FOLD if accumulate and unaveraged else ReplicaMean.NOW


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


def average_shard_across_replicas(shard: torch.Tensor, pg: ProcessGroupInfo,
                                  compute_device: torch.device) -> None:
    """HSDP, at the step: a gradient shard that still holds un-averaged sums (no reduction
    at the boundary folded them in: [Note: HSDP averages once per step]) = its mean across
    the replicas, through the device the replicate group's backend needs (NCCL: the GPU)."""
    h = pg.hybrid
    assert h is not None and h.replicate is not None, "only HSDP has replicas"
    x = shard.to(_dist.collective_device(h.replicate, compute_device))
    average_across_replicas(x, pg)
    if x is not shard:
        shard.copy_(x)
