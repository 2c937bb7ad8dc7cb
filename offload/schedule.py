"""The trace-based prefetch schedule: which unit will be needed next, fetched ahead.

A training iteration (one forward and its backward) uses the units in an order that is, for
almost every model, the same every iteration. The first iteration records it (the *trace*:
one `(unit, phase)` entry per use, phase 'f' forward, 'b' backward, 'r' recomputation
during backward); later iterations follow it with a cursor, and at every use the engine
asks `ahead()` which units come next within the byte budget `prefetch.prefetch_bytes`, and
starts fetching them (`Prefetcher`). Units the trace shows are needed again soon after their
forward (the last blocks of forward are the first of backward) are kept gathered rather than
freed and fetched again, within `prefetch.keep_bytes` (`keep_after_forward`).

Data-dependent control flow: when a use does not match the trace at the cursor, the
iteration is *off trace*: no more prefetching or keeping in it (everything is fetched on
demand, exactly as with prefetch off), and at its end the recorded order becomes the trace
(a re-trace). Prefetching only ever reads a unit's own shard into a private buffer, which the
unit's gather consumes or which is dropped, so a wrong guess costs bandwidth, never
correctness: no collective is issued ahead, so ranks cannot disagree on what they gather.

Traces are kept per kind of iteration (grad mode and train/eval), so an eval loop between
training steps does not throw the training trace away.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from offload.timeline import Timeline, now

__all__ = ["Schedule", "Prefetcher"]

Use = tuple[int, str]


class Schedule:
    """Trace, cursor and budgets; pure bookkeeping (no tensors, no I/O).

    full_bytes[u]: bytes unit u occupies when gathered (what the budgets count).
    pinned: units that are always gathered (the root), never prefetched or kept.
    """

    def __init__(
        self,
        full_bytes: Sequence[int],
        prefetch_bytes: int,
        keep_bytes: int,
        pinned: Sequence[int] = (),
    ) -> None:
        self.full_bytes = [int(b) for b in full_bytes]
        self.prefetch_bytes = int(prefetch_bytes)
        self.keep_bytes = int(keep_bytes)
        self.pinned = frozenset(pinned)
        self._traces: dict[Hashable, list[Use]] = {}
        self._keep: dict[Hashable, frozenset[int]] = {}
        self.kind: Optional[Hashable] = None
        self.trace: Optional[list[Use]] = None
        self.recording: list[Use] = []
        self.pos = 0
        self.off_trace = False
        self.active = False
        self.retraces = 0
        """Iterations whose order differed from an existing trace (each then re-traced)."""

    # -- an iteration -------------------------------------------------------------------------

    def begin(self, kind: Hashable) -> None:
        """A forward starts an iteration of `kind` (ends any open one first)."""
        if self.active:
            self.end()
        self.kind = kind
        self.trace = self._traces.get(kind)
        self.recording = []
        self.pos = 0
        self.off_trace = self.trace is None  # the tracing iteration fetches on demand
        self.active = True

    def end(self) -> bool:
        """Close the iteration; returns True when its order became the new trace."""
        if not self.active:
            return False
        self.active = False
        rec = self.recording
        if not rec or rec == self.trace:
            return False
        if self.trace is not None:
            self.retraces += 1
        self._traces[self.kind] = rec
        self._keep[self.kind] = self._keep_set(rec)
        return True

    def use(self, unit: int, phase: str) -> bool:
        """Unit `unit` is needed now in `phase`; False when the iteration is (now) off trace."""
        if not self.active:
            return False
        self.recording.append((unit, phase))
        if self.off_trace:
            return False
        trace = self.trace
        if self.pos < len(trace) and trace[self.pos] == (unit, phase):
            self.pos += 1
            return True
        self.off_trace = True
        return False

    @property
    def diverged(self) -> bool:
        """This iteration had a trace and left it."""
        return self.active and self.off_trace and self.trace is not None

    @property
    def following(self) -> bool:
        """The iteration is following its trace (prefetching and keeping are on)."""
        return self.active and not self.off_trace

    # -- decisions -----------------------------------------------------------------------------

    def ahead(self) -> list[int]:
        """Units the trace needs next, distinct, in order, whose gathered bytes fit the
        prefetch budget (pinned units skipped). Empty when not following."""
        if not self.following or self.prefetch_bytes <= 0:
            return []
        out: list[int] = []
        seen: set[int] = set()
        total = 0
        for unit, _ in self.trace[self.pos :]:
            if unit in seen or unit in self.pinned:
                continue
            total += self.full_bytes[unit]
            if total > self.prefetch_bytes:
                break
            seen.add(unit)
            out.append(unit)
        return out

    def next_unit(self) -> Optional[int]:
        """The next distinct unit the trace uses after the cursor (pinned ones skipped),
        whatever the budget: the one whose all-gather is issued ahead. None when not
        following or prefetch is off."""
        if not self.following or self.prefetch_bytes <= 0:
            return None
        for unit, _ in self.trace[self.pos :]:
            if unit not in self.pinned:
                return unit
        return None

    def next_iteration(self) -> list[int]:
        """The first units of the last ended iteration's trace (pinned ones included: the
        root starts every iteration), within the prefetch budget: fetched ahead at the end
        of a step, under the gap before the next forward."""
        trace = self._traces.get(self.kind)
        if trace is None or self.prefetch_bytes <= 0:
            return []
        out: list[int] = []
        total = 0
        for unit, phase in trace:
            if phase != "f":
                break
            if unit in out:
                continue
            total += self.full_bytes[unit]
            if total > self.prefetch_bytes:
                break
            out.append(unit)
        return out

    def next_uses(self, phase: str, limit: int) -> list[int]:
        """The next `limit` distinct units the trace uses in `phase` from the cursor on."""
        if not self.following:
            return []
        out: list[int] = []
        for unit, ph in self.trace[self.pos :]:
            if ph == phase and unit not in out:
                out.append(unit)
                if len(out) == limit:
                    break
        return out

    def keep_after_forward(self, unit: int) -> bool:
        """Keep `unit` gathered after its forward: the trace's backward needs it soon."""
        return self.following and unit in self._keep.get(self.kind, ())

    def _keep_set(self, trace: list[Use]) -> frozenset[int]:
        """The last units of forward, newest first, whose bytes fit `keep_bytes`, among
        units whose next use is their backward (so a kept unit is freed by it)."""
        if self.keep_bytes <= 0:
            return frozenset()
        first_b = next((i for i, (_, ph) in enumerate(trace) if ph == "b"), None)
        if first_b is None:
            return frozenset()
        keep: set[int] = set()
        total = 0
        backward_units = {u for u, ph in trace[first_b:] if ph == "b"}
        for unit, ph in reversed(trace[:first_b]):
            if ph != "f" or unit in self.pinned or unit in keep:
                continue
            if unit not in backward_units:
                continue
            if total + self.full_bytes[unit] > self.keep_bytes:
                break
            total += self.full_bytes[unit]
            keep.add(unit)
        return frozenset(keep)


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

    def done(self) -> bool:
        """Whether the copy has finished on its stream (never blocks)."""
        return self.event.query()

    def ready_on_compute_stream(self) -> None:
        torch.cuda.current_stream(self.unit.device).wait_event(self.event)

    def release(self) -> None:
        """Dropped unused: order the compute stream after the copy, then free the buffer
        (unless a gather has since made the unit gathered: then the bytes are in use)."""
        self.ready_on_compute_stream()
        if not self.unit.is_gathered:
            self.unit.free()
