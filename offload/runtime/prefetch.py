"""Fetching units' shards ahead of use, as the schedule (offload.runtime.schedule) says.

The prefetcher holds what was fetched ahead and hands it to the gather; what a fetch is
depends on where the shard lives, which the tier says (`offload.storage.tiers`: `addressable`,
`device`, `fetch_ahead`), never on which tier it is. It hears nothing from below: a buffer
the pinned pool took back, or a shard stored since its fetch, shows as an entry that is no
longer `live()` when the prefetcher next looks, and is dropped as if never started.
"""

from __future__ import annotations

import enum

from typing import Any, Iterable, Optional, Sequence

import torch

from offload.device_runtime import runtime
from offload.devices import StreamPurpose, compute_stream_event, side_stream
from offload.runtime.timeline import Timeline, now
from offload.storage.tiers import Fetch, Tier
from offload.units.shard import FlatUnit

__all__ = ["Prefetcher", "FetchMode"]


class FetchMode(enum.Enum):
    """What fetching a unit ahead means for its tier (chosen from the tier's properties)."""

    NONE = "none"
    """The shard is addressable where compute runs: gathered where it lives."""
    READ = "read"
    """Not addressable (NVMe): read ahead into a leased pooled buffer."""
    CUDA_COPY = "cuda_copy"
    """Pinned host shard, GPU compute: copied into the unit's slot on a side stream."""
    DIRECT = "direct"
    """Not addressable (NVMe), world size 1 on the CPU (`FlatUnit.reads_into_full`): read
    straight into the unit's full buffer, with no pooled buffer and no copy (a copy the tier
    kept at the shard's last store is still used when there is one)."""


class Prefetcher:
    """Fetches units' shards ahead of use, per tier, and hands them to the gather.

    - A tier that is not addressable (NVMe): the shard comes into a pooled host buffer
      (`tier.fetch_ahead`: a read submitted on the I/O threads, or the copy the tier kept at
      the shard's last store); the gather waits for it (the wait is stall time) and copies
      it into its slot of the full buffer.
    - An addressable tier in host memory with a CUDA compute device: the unit's full buffer
      is allocated and the shard copied into its slot on a side stream; the gather makes the
      compute stream wait for the copy's event (see `_CudaCopy`).
    - An addressable tier where compute runs (the device tier, or host memory with CPU
      compute): the shard is already there; nothing to fetch ahead (`start` returns False).

    Entries are dropped (buffer back to the pool) at the end of every iteration. Buffers
    read ahead are leases the pinned pool may revoke when it needs room ([Note: evictable
    leases] in offload/storage/nvme.py), and the tier revokes them when their shard is stored
    again; a revoked entry is forgotten when next looked at, and its unit fetched on demand.
    """

    def __init__(self, units: Sequence[FlatUnit], tier: Tier, timeline: Timeline) -> None:
        self.units = units
        self.tier = tier
        self.timeline = timeline
        self.pending: dict[int, _Entry] = {}
        self._write_through: frozenset[int] = frozenset()
        self._stream: Optional[Any] = None
        self.modes = [FetchMode.DIRECT if unit.reads_into_full
                      else _mode_of(unit.tier, unit.device) for unit in units]
        """Per unit, from its own tier (per-unit placement: some in RAM, some on NVMe)."""
        if FetchMode.CUDA_COPY in self.modes:
            self._stream = side_stream(units[0].device, StreamPurpose.H2D)

    @property
    def write_through(self) -> frozenset[int]:
        """Units whose next store the tier keeps a pooled copy of (the next iteration's
        first), handed out as a ready entry instead of a read."""
        return self._write_through

    @write_through.setter
    def write_through(self, indices: Iterable[int]) -> None:
        self._write_through = frozenset(indices)
        self.tier.keep_after_store(self.units[i].key for i in self._write_through)

    def start(self, index: int, direct: bool = True) -> bool:
        """Begin fetching unit `index` ahead; False when nothing was started (nothing to
        fetch for this tier, already started or gathered, or no buffer free right now).
        `direct=False` (between iterations, so that no full buffer holds memory between
        steps): a `DIRECT` unit reads into a pooled buffer instead, and a `CUDA_COPY` unit,
        whose copy lands in its full buffer on the GPU, is not started (issue #30, F4).
        A unit that is gathered or being gathered is never fetched again (F1: a second copy
        into a buffer a gather is reading)."""
        mode = self.modes[index]
        if not direct:
            if mode is FetchMode.CUDA_COPY:
                return False
            if mode is FetchMode.DIRECT:
                mode = FetchMode.READ
        if mode is FetchMode.NONE or self._live(index) is not None:
            return False
        unit = self.units[index]
        if not unit.is_sharded:
            return False
        if mode is FetchMode.READ:
            what = unit.tier.fetch_ahead(unit.key, block=False)
            if what is None:
                return False
            self.pending[index] = _Entry(what, now())
            return True
        if mode is FetchMode.DIRECT:
            held = unit.tier.take_held(unit.key)
            self.pending[index] = _Entry(held if held is not None else _DirectRead(unit), now())
            return True
        assert self._stream is not None  # made with the first CUDA_COPY mode
        self.pending[index] = _Entry(_CudaCopy(unit, self._stream), now())
        return True

    def start_in_order(self, indices: Sequence[int], direct: bool = True) -> None:
        """Start fetching these units, in order, skipping those already started or gathered,
        and stopping at the first that cannot start now (no buffer, or nothing to fetch for
        this tier): the rest are fetched later or on demand, never out of order."""
        for index in indices:
            if self._live(index) is not None or not self.units[index].is_sharded:
                continue
            if not self.start(index, direct):
                break

    def poll(self) -> None:
        """Note which fetches have completed (never blocks): their timeline spans then end
        when the bytes landed, not when the gather got to them."""
        if not self.timeline.enabled:
            return
        t = now()
        for i in list(self.pending):
            e = self._live(i)
            if e is not None and e.done_at is None and e.done():
                e.done_at = t

    def take(self, index: int) -> Optional["_Entry"]:
        """The entry started for unit `index`, or the copy the tier kept at its last store;
        the caller consumes it (it is no longer revocable). None when there is neither."""
        entry = self._live(index)
        if entry is not None:
            del self.pending[index]
        elif self.modes[index] in (FetchMode.READ, FetchMode.DIRECT):
            what = self.units[index].tier.take_held(self.units[index].key)
            entry = None if what is None else _Entry(what, now())
        if entry is None or not entry.claim():
            return None
        return entry

    def fetch_now(self, index: int) -> Optional["_Entry"]:
        """An on-demand fetch through the same path (NVMe: a blocking buffer acquire), so
        the engine measures the wait the same way; None for tiers gathered in place."""
        if self.modes[index] is FetchMode.DIRECT:
            return _Entry(_DirectRead(self.units[index]), now())
        if self.modes[index] is not FetchMode.READ:
            return None
        what = self.units[index].tier.fetch_ahead(self.units[index].key, block=True)
        assert what is not None, "a blocking fetch_ahead waits for a buffer, never gives up"
        return _Entry(what, now())

    def drop(self, index: Optional[int] = None, keep_fresh: bool = False) -> None:
        """Forget fetches started ahead (all, or unit `index`'s), giving buffers back.
        `keep_fresh`: keep the copies the tier kept of this step's stores (`write_through`),
        taken or not, which stay valid until the unit's shard is stored again; without it
        the tier gives those back too."""
        for i in list(self.pending) if index is None else [index]:
            e = self.pending.get(i)
            if e is None or (keep_fresh and e.fresh and e.live()):
                continue
            del self.pending[i]
            e.drop()
        if not keep_fresh:
            self.tier.release_held(None if index is None else self.units[index].key)

    def _live(self, index: int) -> Optional["_Entry"]:
        """Unit `index`'s entry, if it still holds its buffer (one the pool or a store took
        back is forgotten here)."""
        e = self.pending.get(index)
        if e is not None and not e.live():
            del self.pending[index]
            e.drop()
            return None
        return e


def _mode_of(tier: Tier, device: torch.device) -> FetchMode:
    """What fetching ahead means for a shard in `tier` when compute runs on `device`."""
    if not tier.addressable:
        return FetchMode.READ
    if tier.device.type == "cpu" and device.type == "cuda":
        return FetchMode.CUDA_COPY
    return FetchMode.NONE


class _Entry:
    """One fetch in flight: `what` is the tier's `Fetch` (a `ReadAhead`), a `_CudaCopy` or a
    `_DirectRead` (the runtime's own fetches, the same `Fetch` protocol); `started` is
    when it was issued (the timeline's read/copy span begins there); `fresh`: a copy kept at
    a store, complete from the start."""

    __slots__ = ("what", "started", "done_at", "fresh")

    def __init__(self, what: Fetch, started: float) -> None:
        self.what = what
        self.started = started
        self.fresh = bool(what.fresh)
        self.done_at: Optional[float] = started if self.fresh else None

    def done(self) -> bool:
        return self.what.done()

    def live(self) -> bool:
        """Whether it still holds its bytes (False: taken back; fetch again)."""
        return self.what.live()

    def claim(self) -> bool:
        """Hold on to it for the gather (no longer revocable); False if already taken back."""
        return self.what.claim()

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

    def drop_after_reads(self, device: torch.device) -> None:
        """The gather has queued its copy of the shard out of the host buffer on `device`'s
        stream (asynchronous from pinned memory): give the buffer back once that copy has run,
        without waiting for it here (issue #30, F8: the wait drained the compute stream)."""
        event = compute_stream_event(device)
        if event is None:
            self.what.release()
        else:
            self.what.release_after(event)


class _CudaCopy:
    """Host shard -> its slot of the unit's full buffer, on a side stream.

    The full buffer is allocated (on the compute stream, which owns the memory) before the
    copy is queued; the side stream first waits for the compute stream (the memory may have
    been freed by it just before) and records an event after the copy. The gather makes the
    compute stream wait on that event, so the copy is ordered before every use of the bytes
    and before the buffer's next free."""

    __slots__ = ("unit", "event", "local")

    def __init__(self, unit: FlatUnit, stream: Any) -> None:
        self.unit = unit
        unit.alloc_full()
        rt = runtime()
        rt.wait_stream(stream, rt.current_stream(unit.device))
        n = unit.layout.shard_numel
        rank = unit.pg.rank
        self.local = unit.full[rank * n : (rank + 1) * n]
        with rt.stream(stream):
            unit.tier.fetch(unit.key, self.local)  # pinned host -> device, asynchronous
            self.event = rt.record(stream, f"h2d {unit.index}")

    label = "copy"
    fresh = False

    def live(self) -> bool:
        """Always: nobody takes a device buffer back."""
        return True

    def claim(self) -> bool:
        return True

    def done(self) -> bool:
        """Whether the copy has finished on its stream (never blocks)."""
        return runtime().query(self.event)

    def wait(self) -> None:
        """The shard is in the unit's slot once the compute stream has waited for the copy."""
        self.ready_on_compute_stream()
        return None

    def ready_on_compute_stream(self) -> None:
        rt = runtime()
        rt.wait_event(rt.current_stream(self.unit.device), self.event)

    def release_after(self, event: Optional[Any]) -> None:
        self.release()  # no host buffer: nothing a later copy reads

    def release(self) -> None:
        """Dropped unused: order the compute stream after the copy, then free the buffer
        (unless a gather has since used it, or is using it: then the bytes are in use)."""
        self.ready_on_compute_stream()
        if self.unit.is_sharded:
            self.unit.free()


class _DirectRead:
    """NVMe shard -> the unit's full buffer itself (`FetchMode.DIRECT`, `FlatUnit.start_read`):
    the gather finds the shard in place. Nobody takes the buffer back while the read is in
    flight: freeing the unit's buffer waits for it, and a change of the shard drops it."""

    __slots__ = ("unit", "handle")

    label = "read"
    fresh = False

    def __init__(self, unit: FlatUnit) -> None:
        self.unit = unit
        self.handle = unit.start_read()

    def live(self) -> bool:
        """Whether the read still fills the unit's buffer (not dropped with it)."""
        return self.unit.reading(self.handle)

    def claim(self) -> bool:
        return self.live()

    def done(self) -> bool:
        return self.handle is None or self.handle.done()  # None: read synchronously, done

    def wait(self) -> None:
        """The shard is in the unit's full buffer once the read landed: nothing to copy."""
        self.unit.finish_read(self.handle)
        return None

    def release(self) -> None:
        """Dropped unused: free the buffer (after the read lands), unless a gather has since
        used it, or is using it (then the bytes are in use)."""
        if self.unit.is_sharded:
            self.unit.free()

    def release_after(self, event: Optional[Any]) -> None:
        self.release()  # no host buffer: nothing a later copy reads
