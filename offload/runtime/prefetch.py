"""Fetching units' shards ahead of use, as the schedule (offload.runtime.schedule) says.

The prefetcher holds what was fetched ahead and hands it to the gather; what a fetch is
depends on where the shard lives, which the tier says (`offload.storage.tiers`), never on
which tier it is.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from offload.runtime.timeline import Timeline, now

__all__ = ["Prefetcher"]


class Prefetcher:
    """Fetches units' shards ahead of use, per tier, and hands them to the gather.

    - NVMe parameter tier: the shard's read is submitted into a pooled staging buffer
      (`NVMeTier.read_ahead`); the gather waits for it (the wait is stall time) and copies
      it into its slot of the full buffer.
    - Host tier with a CUDA compute device: the unit's full buffer is allocated and the
      shard copied into its slot on a side stream; the gather makes the compute stream wait
      for the copy's event (see `_CudaCopy`).
    - Device tier, or host tier with CPU compute: the shard is already addressable where
      compute runs; nothing to fetch ahead (`start` returns False).

    Entries are dropped (buffer back to the pool) at the end of every iteration and when the
    staging pool needs room (`reclaim`, registered with `Staging.reclaimers`).
    """

    def __init__(self, units: Sequence[Any], tier: Any, timeline: Timeline) -> None:
        self.units = units
        self.tier = tier
        self.timeline = timeline
        self.pending: dict[int, Any] = {}
        self.write_through: frozenset[int] = frozenset()
        """Units whose next store is kept as a ready entry (the next iteration's first)."""
        self._stream: Any = None
        device = units[0].device if units else torch.device("cpu")
        self.mode = "none"
        self._unit_of = {u.key: u.index for u in units}
        if tier.kind == "nvme":
            self.mode = "nvme"
            tier.store_listeners.append(self._on_store)
        elif tier.kind == "host" and device.type == "cuda":
            self.mode = "cuda_copy"
            self._stream = torch.cuda.Stream(device)

    def start(self, index: int) -> bool:
        """Begin fetching unit `index` ahead; False when nothing was started (nothing to
        fetch for this tier, already started or gathered, or no buffer free right now)."""
        if self.mode == "none" or index in self.pending:
            return False
        unit = self.units[index]
        if unit.is_gathered:
            return False
        if self.mode == "nvme":
            entry = self.tier.read_ahead(unit.key, block=False)
            if entry is None:
                return False
            self.pending[index] = _Entry(entry, now())
            return True
        self.pending[index] = _Entry(_CudaCopy(unit, self._stream), now())
        return True

    def start_in_order(self, indices: Sequence[int]) -> None:
        """Start fetching these units, in order, skipping those already started or gathered,
        and stopping at the first that cannot start now (no buffer, or nothing to fetch for
        this tier): the rest are fetched later or on demand, never out of order."""
        for index in indices:
            if index in self.pending or self.units[index].is_gathered:
                continue
            if not self.start(index):
                break

    def poll(self) -> None:
        """Note which fetches have completed (never blocks): their timeline spans then end
        when the bytes landed, not when the gather got to them."""
        if not self.timeline.enabled:
            return
        t = now()
        for e in self.pending.values():
            if e.done_at is None and e.done():
                e.done_at = t

    def take(self, index: int) -> Optional["_Entry"]:
        """The entry started for unit `index` (the caller consumes it), or None."""
        return self.pending.pop(index, None)

    def fetch_now(self, index: int) -> Optional["_Entry"]:
        """An on-demand fetch through the same path (NVMe: a blocking buffer acquire), so
        the engine measures the wait the same way; None for tiers gathered in place."""
        if self.mode != "nvme":
            return None
        entry = self.tier.read_ahead(self.units[index].key, block=True)
        return _Entry(entry, now())

    def drop(self, index: Optional[int] = None, keep_fresh: bool = False) -> None:
        """Forget fetches started ahead (all, or unit `index`'s), giving buffers back.
        `keep_fresh`: keep entries made from a store of this step (`_on_store`), which stay
        valid until the unit's shard is stored again."""
        for i in list(self.pending) if index is None else [index]:
            e = self.pending.get(i)
            if e is None or (keep_fresh and e.fresh):
                continue
            del self.pending[i]
            e.drop()

    def _on_store(self, key: Any, src: torch.Tensor) -> None:
        """The tier stored a new shard: any copy of the old one is stale; for a unit the
        next iteration starts with, keep the new bytes as a ready entry."""
        index = self._unit_of.get(key)
        if index is None:
            return
        self.drop(index)
        if index in self.write_through and src.device.type == "cpu":
            what = self.tier.hold_copy(key, src)
            if what is not None:
                entry = _Entry(what, now())
                entry.fresh = True
                entry.done_at = entry.started
                self.pending[index] = entry

    def reclaim(self) -> bool:
        """`Staging.reclaimers` hook: drop every NVMe fetch in flight; True if any was."""
        if self.mode != "nvme" or not self.pending:
            return False
        self.drop()
        return True


class _Entry:
    """One fetch in flight: `what` is a `ReadAhead` (NVMe) or a `_CudaCopy`; `started` is
    when it was issued (the timeline's read/copy span begins there)."""

    __slots__ = ("what", "started", "done_at", "fresh")

    def __init__(self, what: Any, started: float) -> None:
        self.what = what
        self.started = started
        self.done_at: Optional[float] = None
        self.fresh = False

    def done(self) -> bool:
        return self.what.done()

    @property
    def label(self) -> str:
        """'read' (the shard comes into a host buffer) or 'copy' (into the unit's slot)."""
        return self.what.label

    def wait(self) -> Optional[torch.Tensor]:
        """Wait for the fetch. Returns the shard in a host buffer, for the gather to copy
        into the unit's slot of its full buffer (then `drop()`), or None when the fetch
        already put it there (ordered before the compute stream's next use). A fetch that
        failed gives its buffer back and raises."""
        try:
            return self.what.wait()
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        self.what.release()


class _CudaCopy:
    """Host shard -> its slot of the unit's full buffer, on a side stream.

    The full buffer is allocated (on the compute stream, which owns the memory) before the
    copy is queued; the side stream first waits for the compute stream (the memory may have
    been freed by it just before) and records an event after the copy. The gather makes the
    compute stream wait on that event, so the copy is ordered before every use of the bytes
    and before the buffer's next free."""

    __slots__ = ("unit", "event", "local")

    def __init__(self, unit: Any, stream: Any) -> None:
        self.unit = unit
        unit.alloc_full()
        compute = torch.cuda.current_stream(unit.device)
        stream.wait_stream(compute)
        n = unit.layout.shard_numel
        rank = unit.pg.rank
        self.local = unit.full[rank * n : (rank + 1) * n]
        with torch.cuda.stream(stream):
            unit.tier.fetch(unit.key, self.local)  # pinned host -> device, asynchronous
            self.event = torch.cuda.Event()
            self.event.record(stream)

    label = "copy"

    def done(self) -> bool:
        """Whether the copy has finished on its stream (never blocks)."""
        return self.event.query()

    def wait(self) -> None:
        """The shard is in the unit's slot once the compute stream has waited for the copy."""
        self.ready_on_compute_stream()
        return None

    def ready_on_compute_stream(self) -> None:
        torch.cuda.current_stream(self.unit.device).wait_event(self.event)

    def release(self) -> None:
        """Dropped unused: order the compute stream after the copy, then free the buffer
        (unless a gather has since made the unit gathered: then the bytes are in use)."""
        self.ready_on_compute_stream()
        if not self.unit.is_gathered:
            self.unit.free()
