"""A unit's fp32 gradient shard on this rank: its memory, what it holds, and its way there.

The reduce-scatter of a unit's gradients writes into its shard (`units/grad_reduce.py`), the
optimizer reads it at the unit's update, `engine.full_grad` and the checkpoint look at it.
`GradShard` is the one owner of what it holds (`GradState`) and of the facts beside the
values: which slots got a gradient on this rank, how many reductions it summed (every rank
must have made the same: `offload.runtime.agreement`), and the CUDA event of its copy down
from the GPU while that is in flight.

    RELEASED --acquire--> EMPTY --reduced--> SUMMED or UNAVERAGED --release--> CONSUMED
       ^                    ^                  |  (averaged: UNAVERAGED -> SUMMED) |
       |                    +------clear-------+                                   |
       +-------------------------------------clear---------------------------------+

- `RELEASED`: a transient shard (`offload.optim.sharded.transient_grad_shards`) before its
  reduce: sized, holding no memory, no gradient.
- `EMPTY`: memory, no gradient of this window: the next reduce overwrites it.
- `SUMMED`: this window's reductions, summed (and averaged across replicas where HSDP
  runs): what the update takes once `ready` has passed.
- `UNAVERAGED`: HSDP sums not yet averaged across the replicas ([Note: HSDP averages once
  per step] in offload/units/hybrid.py).
- `CONSUMED`: a transient shard after its update during backward: the window's gradient
  was there and is used; its memory is gone until the step clears it (then RELEASED). A
  read of it is refused, not answered with "no gradient".
`ready` is orthogonal: a reduction's copy from the GPU into the shard may still be in flight
in either holding state (`arriving`; `wait_arrived` before any read on the host).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch

from offload.device_runtime import runtime
from offload.units.full_buffers import CAN_POINT, point_storage, unpoint_storage
from offload.units.storage_bytes import alloc_storage, free_storage

if TYPE_CHECKING:
    from offload.units.layout import UnitLayout

__all__ = ["GradState", "GradShard", "GradScratch", "GradSnapshot", "zero_unwritten"]


class GradState(enum.Enum):
    """What a gradient shard holds."""

    RELEASED = "released"
    """A transient shard with no memory (its size kept): no gradient."""
    EMPTY = "empty"
    """Memory and no gradient of this window: the next reduce overwrites, not adds."""
    SUMMED = "summed"
    """This window's reductions, summed; averaged across replicas where that applies."""
    UNAVERAGED = "unaveraged"
    """HSDP: this window's sums, not yet averaged across the replicas."""
    CONSUMED = "consumed"
    """A transient shard whose update ran during backward: its gradient was used, its
    memory given back."""


class GradSnapshot(NamedTuple):
    """What a shard held as a backward pass began (`GradShard.restore` puts it back)."""

    state: GradState
    slot_has: tuple[bool, ...]
    reduces: int


class GradShard:
    """One unit's fp32 gradient shard on this rank (`tensor`: as long as the master; host
    memory, pinned on a GPU run)."""

    def __init__(self, tensor: torch.Tensor, n_slots: int, released: bool = False) -> None:
        self.tensor = tensor
        self.state = GradState.RELEASED if released else GradState.EMPTY
        if released:
            free_storage(tensor)
        self.slot_has: list[bool] = [False] * n_slots
        """Per slot: a gradient reached it this window (on this rank; the step agrees across
        ranks before it uses them)."""
        self.reduces = 0
        """Reduce-scatters into the shard since it was last cleared."""
        self.ready: Optional[Any] = None
        """A CUDA event after which the shard holds its newest reduction (its copy down from
        the GPU runs on a side stream: `GradReduce.wait(host_async=True)`), or None."""
        self.arrived: Optional[Any] = None
        """The event `wait_arrived` waited for since the newest reduction (None: that one was
        written on the host): the unit's backward and reduce had run on the device by then."""
        self._lender: Optional["GradScratch"] = None
        """The scratch whose memory the shard borrows, while it does."""

    @property
    def has_gradient(self) -> bool:
        """This window reduced gradients into it (SUMMED, UNAVERAGED, or CONSUMED by its
        update): the next reduce adds, a checkpoint is refused, `full_grad` answers."""
        return self.state in (GradState.SUMMED, GradState.UNAVERAGED, GradState.CONSUMED)

    @property
    def unaveraged(self) -> bool:
        return self.state is GradState.UNAVERAGED

    @property
    def consumed(self) -> bool:
        return self.state is GradState.CONSUMED

    # -- memory --------------------------------------------------------------------------

    def acquire(self, layout: "UnitLayout", rank: int, whole: bool,
                scratch: Optional["GradScratch"] = None) -> None:
        """RELEASED -> EMPTY: memory again, from `scratch` where it lends, else fresh. What a
        world-size-1 reduce never writes (the alignment gaps between slots; all of it,
        `whole`) reads as zeros. A shard in any other state is left as it is."""
        if self.state is not GradState.RELEASED:
            return
        if scratch is None or not scratch.lend(self):
            alloc_storage(self.tensor)
        zero_unwritten(self.tensor, layout, rank, whole)
        self.state = GradState.EMPTY

    def release(self) -> None:
        """Give the memory back, keeping the size (a transient shard after its update): the
        scratch it borrowed, or its own. A gradient it held is CONSUMED."""
        if self._lender is not None:
            self._lender.take_back(self)
        else:
            free_storage(self.tensor)
        self.state = GradState.CONSUMED if self.has_gradient else GradState.RELEASED

    def borrowed(self, lender: Optional["GradScratch"]) -> None:
        """Called by `GradScratch` as it lends (a scratch) and takes back (None)."""
        self._lender = lender

    # -- what it holds -------------------------------------------------------------------

    def reduced(self, have: Sequence[bool], averaged_later: bool) -> None:
        """A reduce-scatter was issued into the shard (it overwrote an EMPTY shard, added to
        a holding one): SUMMED, or UNAVERAGED while HSDP defers the replicas' average."""
        assert self.state in (GradState.EMPTY, GradState.SUMMED, GradState.UNAVERAGED), \
            f"a reduce into a {self.state.value} gradient shard"
        self.state = GradState.UNAVERAGED if averaged_later else GradState.SUMMED
        self.reduces += 1
        self.slot_has = [a or b for a, b in zip(self.slot_has, have)]

    def agreed(self, slot_has: Sequence[bool]) -> None:
        """The slots that got a gradient on any rank (the step's agreement across ranks)."""
        assert len(slot_has) == len(self.slot_has)
        self.slot_has = list(slot_has)

    def arriving(self, event: Optional[Any]) -> None:
        """The newest reduction comes down from the GPU until `event` (None: it is here)."""
        self.ready = event
        self.arrived = None  # until it is waited for

    def wait_arrived(self, keep_event: bool = True) -> None:
        """Block until the shard holds its newest reduction on the host. Without
        `keep_event`, `arrived` is forgotten: what follows is ordered after the device's
        work so far, not after the unit's own (the step's updates at `engine.step()`)."""
        ready, self.ready = self.ready, None
        if not keep_event:
            self.arrived = None
        elif ready is not None:
            self.arrived = ready
            runtime().synchronize(ready)

    def averaged(self) -> None:
        """UNAVERAGED -> SUMMED: the replicas' average was applied to it."""
        if self.state is GradState.UNAVERAGED:
            self.state = GradState.SUMMED

    def clear(self) -> None:
        """The window's gradients are used or dropped: EMPTY, or RELEASED where the shard
        has no memory; the next reduce overwrites."""
        if self.state in (GradState.CONSUMED, GradState.RELEASED):
            self.state = GradState.RELEASED
        else:
            self.state = GradState.EMPTY
        self.reduces = 0
        self.slot_has = [False] * len(self.slot_has)

    def snapshot(self) -> GradSnapshot:
        return GradSnapshot(self.state, tuple(self.slot_has), self.reduces)

    def restore(self, snap: GradSnapshot) -> None:
        """Back to what `snap` held, where that was no gradient (an aborted pass's partial
        reduction into it: the next reduce overwrites it again). A shard that already held
        gradients cannot be restored exactly (the caller tells by `snap.state`)."""
        assert snap.state in (GradState.EMPTY, GradState.RELEASED), "no exact way back"
        # Memory the pass acquired stays (EMPTY, as after acquire); a shard the pass
        # released again (its update ran) has none.
        gone = self.state in (GradState.CONSUMED, GradState.RELEASED)
        self.state = GradState.RELEASED if gone else GradState.EMPTY
        self.slot_has = list(snap.slot_has)
        self.reduces = snap.reduces
        self.ready = None


class GradScratch:
    """One host buffer that transient gradient shards borrow from their reduce to their
    update ([Note: one scratch for transient gradient shards] in offload/runtime/backward.py).
    It keeps its borrower: one shard at a time. Used from the engine's thread; `enabled`
    only at world size 1 with transient shards."""

    def __init__(self, shards: Sequence[GradShard], enabled: bool) -> None:
        self.shards = shards
        self.enabled = enabled and CAN_POINT
        self.buf: Optional[torch.Tensor] = None
        self.holder: Optional[GradShard] = None
        """The shard that borrows the buffer now."""

    def busy(self) -> bool:
        return self.holder is not None

    def lend(self, shard: GradShard) -> bool:
        """Point `shard`'s storage into the buffer; False when it cannot (taken, disabled,
        not an fp32 host shard): the shard takes fresh memory then."""
        t = shard.tensor
        if not self.enabled or self.busy() or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
        if self.buf is None:
            self.buf = torch.empty(max(s.tensor.numel() for s in self.shards), dtype=torch.float32)
        point_storage(t, self.buf)
        self.holder = shard
        shard.borrowed(self)
        # Not fresh memory: the previous unit's values are there. The reduce writes every
        # slot (copy, or zeros); what it never writes the shard zeroes, as for fresh memory.
        return True

    def take_back(self, shard: GradShard) -> None:
        assert self.holder is shard, "a gradient shard gave back a scratch it did not borrow"
        unpoint_storage(shard.tensor)  # resizable and empty, as released
        self.holder = None
        shard.borrowed(None)


def zero_unwritten(t: torch.Tensor, layout: "UnitLayout", rank: int, whole: bool) -> None:
    """Zero what a world-size-1 reduce never writes into gradient shard `t`: the alignment
    gaps between slots (`whole`: all of it)."""
    if whole:
        t.zero_()
        return
    lo, hi = layout.shard_range(rank)
    pos = lo
    for slot in sorted(layout.slots, key=lambda s: s.offset):
        if slot.offset > pos:
            t[pos - lo : min(slot.offset, hi) - lo].zero_()
        pos = max(pos, slot.end)
    if pos < hi:
        t[pos - lo :].zero_()
