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
correctness. The one collective issued ahead is the all-gather of `next_unit()` (world size
> 1, `offload.runtime.gather`): it relies on every rank following the same trace to the same
positions in the same order, which ZeRO-3 needs anyway (on-demand gathers in different
orders would mix shards), so every rank also leaves the trace at the same use
(docs/prefetch.md).

Traces are kept per kind of iteration (grad mode and train/eval), so an eval loop between
training steps does not throw the training trace away.
"""

from __future__ import annotations

from enum import Enum
from typing import Hashable, Optional, Sequence

__all__ = ["Schedule", "Phase"]



class Phase(str, Enum):
    """Why a unit is used: its forward, its backward, or the recomputation of its forward
    during backward (activation checkpointing). A `str` Enum: the trace prints as 'f'/'b'/'r'."""

    FORWARD = "f"
    BACKWARD = "b"
    RECOMPUTE = "r"


Use = tuple[int, Phase]



def bounded_by_model(requested_bytes: int, full_bytes: Sequence[int]) -> int:
    """The keep budget bounded by what the model has gathered in all (the sum of
    its units' full bytes): DeepSpeed's `stage3_max_reuse_distance: 1e9` is 4 GB of fp32
    elements, which on a small model must neither be reported nor reserved as 4 GB."""
    return max(0, min(int(requested_bytes), sum(int(b) for b in full_bytes)))

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
        self.keep_bytes = bounded_by_model(keep_bytes, self.full_bytes)
        self.pinned = frozenset(pinned)
        self._traces: dict[Hashable, list[Use]] = {}
        self._keep: dict[Hashable, frozenset[int]] = {}
        self.iteration: Optional[Hashable] = None
        """The kind of the current iteration (grad mode, train/eval): traces are kept per kind."""
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
        self.iteration = kind
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
        self._traces[self.iteration] = rec
        self._keep[self.iteration] = self._keep_set(rec)
        return True

    def _ahead(self) -> list[Use]:
        """The trace's uses from the cursor on (none while no trace is followed)."""
        return self.trace[self.pos :] if self.trace is not None else []

    def use(self, unit: int, phase: Phase) -> bool:
        """Unit `unit` is needed now in `phase`; False when the iteration is (now) off trace."""
        if not self.active:
            return False
        self.recording.append((unit, phase))
        if self.off_trace:
            return False
        trace = self.trace
        assert trace is not None  # on trace: the iteration follows a recorded trace
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
        prefetch budget (pinned units skipped), and always the next one, however large:
        a budget below one unit (a 7B-class layer is ~400 MB against the 256 MiB default)
        would otherwise fetch nothing ahead (issue #30, F8). Empty when not following or
        prefetch is off (`prefetch_bytes` 0)."""
        if not self.following or self.prefetch_bytes <= 0:
            return []
        out: list[int] = []
        seen: set[int] = set()
        total = 0
        for unit, _ in self._ahead():
            if unit in seen or unit in self.pinned:
                continue
            total += self.full_bytes[unit]
            if total > self.prefetch_bytes and out:
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
        for unit, _ in self._ahead():
            if unit not in self.pinned:
                return unit
        return None

    def next_iteration(self) -> list[int]:
        """The first units of the last ended iteration's trace (pinned ones included: the
        root starts every iteration), within the prefetch budget: fetched ahead at the end
        of a step, under the gap before the next forward."""
        trace = self._traces.get(self.iteration)
        if trace is None or self.prefetch_bytes <= 0:
            return []
        out: list[int] = []
        total = 0
        for unit, phase in trace:
            if phase != Phase.FORWARD:
                break
            if unit in out:
                continue
            total += self.full_bytes[unit]
            if total > self.prefetch_bytes:
                break
            out.append(unit)
        return out

    def next_uses(self, phase: Phase, limit: int) -> list[int]:
        """The next `limit` distinct units the trace uses in `phase` from the cursor on."""
        if not self.following:
            return []
        out: list[int] = []
        for unit, ph in self._ahead():
            if ph == phase and unit not in out:
                out.append(unit)
                if len(out) == limit:
                    break
        return out

    def keep_after_forward(self, unit: int) -> bool:
        """Keep `unit` gathered after its forward: the trace's backward needs it soon."""
        return self.following and unit in self._keep.get(self.iteration, ())

    def _keep_set(self, trace: list[Use]) -> frozenset[int]:
        """The last units of forward, newest first, whose bytes fit `keep_bytes`, among
        units whose next use is their backward (so a kept unit is freed by it)."""
        if self.keep_bytes <= 0:
            return frozenset()
        first_b = next((i for i, (_, ph) in enumerate(trace) if ph == Phase.BACKWARD), None)
        if first_b is None:
            return frozenset()
        keep: set[int] = set()
        total = 0
        backward_units = {u for u, ph in trace[first_b:] if ph == Phase.BACKWARD}
        for unit, ph in reversed(trace[:first_b]):
            if ph != Phase.FORWARD or unit in self.pinned or unit in keep:
                continue
            if unit not in backward_units:
                continue
            if total + self.full_bytes[unit] > self.keep_bytes:
                break
            total += self.full_bytes[unit]
            keep.add(unit)
        return frozenset(keep)
