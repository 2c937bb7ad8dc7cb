"""The gather owner: hands a unit a ready, gathered parameter buffer when its forward or
backward needs it (docs/prefetch.md).

It owns the schedule (the recorded order of units and the cursor following it), the
prefetcher (shards fetched ahead, per tier) and the all-gathers issued ahead. At every use
it follows the trace, waits only for what has not arrived (the wait is stall time, counted
in the timeline), gathers the unit, and starts what the trace needs next within the
budgets. Whether a fetch is a disk read into a pooled buffer or a copy on a side stream
is the prefetcher's and the tier's business: the gather asks the entry to `wait()` and gets
either the shard to copy into the unit's slot or nothing more to do.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from offload.config.sections import PrefetchConfig
from offload.runtime.prefetch import Prefetcher
from offload.runtime.schedule import Phase, Schedule
from offload.runtime.timeline import Timeline, now
from offload.storage.tiers import Tier
from offload.units.partition import ROOT
from offload.units.shard import FlatUnit

__all__ = ["Gatherer"]


class Gatherer:
    """Schedule + prefetcher + gathers issued ahead, for one engine's units."""

    def __init__(self, units: list[FlatUnit], param_tier: Tier, prefetch_config: PrefetchConfig,
                 dtype: torch.dtype, world_size: int, timeline: Timeline) -> None:
        self.units = units
        self.world_size = world_size
        self.timeline = timeline
        self.schedule = Schedule(
            [0 if u.aliased else u.layout.padded_numel * dtype.itemsize for u in units],
            prefetch_config.prefetch_bytes, prefetch_config.keep_bytes, pinned=[ROOT],
        )
        self.prefetcher = Prefetcher(units, param_tier, timeline)
        self._issued: dict[int, float] = {}
        """Units whose all-gather was issued ahead, with when (the timeline's span start)."""
        self._compute_t0 = [0.0] * len(units)
        self._escaped: set[int] = set()
        """Units kept gathered after their forward because the output holds a view of the
        full buffer ([Note: escaped views])."""
        self._for_backward: set[int] = set()
        """Units gathered for a grad-enabled call outside the model's forward: kept until the
        backward reduces them (offload/runtime/gathered.py)."""

    # -- the iteration -----------------------------------------------------------------

    def begin_iteration(self, step: int, training: bool) -> None:
        """A forward of the root outside backward: a new iteration of the schedule (traces
        are kept per grad mode and train/eval). Units kept for an escaped view in the last
        one (that no backward freed) go now."""
        for index in self._escaped:
            self.units[index].free()
        self._escaped.clear()
        if torch.is_grad_enabled():
            self.timeline.begin_step(step)
        self.schedule.begin((torch.is_grad_enabled(), training))

    def use(self, unit: FlatUnit, phase: Phase) -> None:
        """Unit `unit` is needed now: follow the trace, gather it (consuming its prefetch),
        and start fetching what the trace needs next."""
        following = self.schedule.use(unit.index, phase)
        if following:
            self.prefetcher.poll()
        elif self.schedule.diverged:
            self.prefetcher.drop(keep_fresh=True)  # off trace: what was fetched ahead may go unused
            if self.timeline.current is not None:
                self.timeline.current.off_trace = True
        self._gather(unit)
        if following:
            self._prefetch_ahead()
            self._gather_next()
        self._compute_t0[unit.index] = now()

    def compute_started(self, unit: FlatUnit) -> float:
        """When the unit's current compute (forward or backward) began."""
        return self._compute_t0[unit.index]

    def after_forward(self, unit: FlatUnit, backward_follows: bool, output: Any = None) -> bool:
        """The unit's forward is done: free it, unless the trace says its backward comes
        soon (kept within prefetch.keep_bytes), or its output holds a view of its full
        buffer; then fetch ahead (it may be the next one). Returns whether the output
        holds such a view (a parameter returned out of its unit: [Note: escaped views])."""
        if unit.index == ROOT:
            if not backward_follows:
                unit.free()  # a forward backward will never visit (eval, no_grad)
            return False
        if unit.index in self._for_backward:
            return False  # kept for the backward; the tracker counted the outside call
        if _escapes(unit, output):
            self._escaped.add(unit.index)
            return True
        if not (backward_follows and self.schedule.keep_after_forward(unit.index)):
            unit.free()
            if self.schedule.following:
                self._prefetch_ahead()
                self._gather_next()
        return False

    def next_uses(self, phase: Phase, n: int) -> list[int]:
        return self.schedule.next_uses(phase, n)

    def keep_for_backward(self, unit: FlatUnit) -> None:
        """Keep `unit` gathered through its next forward until the backward reduces it."""
        self._for_backward.add(unit.index)

    def end_backward(self) -> None:
        """The backward pass ended: the iteration is over; drop what was fetched ahead and
        not used (except copies of this step's new shards, still valid)."""
        self._for_backward.clear()  # reduced (and freed) by the backward that just ended
        self.schedule.end()
        self.prefetcher.drop(keep_fresh=True)

    def abort(self) -> None:
        """A backward died half-way, or the engine failed: forget everything fetched."""
        self._for_backward.clear()
        self.schedule.end()
        self.prefetcher.drop()

    def drop(self, index: Optional[int] = None, keep_fresh: bool = False) -> None:
        """Unit `index`'s shard (or every shard) is about to change: fetched copies are stale."""
        self.prefetcher.drop(index, keep_fresh=keep_fresh)

    def keep_new_shards_for_next_iteration(self) -> None:
        """The units the next forward uses first keep their new shards when the optimizer
        writes them (no read back from the tier)."""
        self.prefetcher.write_through = frozenset(self.schedule.next_iteration())

    def before_optimizer_step(self) -> None:
        """Shards are about to change: drop stale fetches (fresh ones already did), keep the
        next iteration's first new shards, free anything still gathered (kept by a forward
        without backward)."""
        self.prefetcher.drop(keep_fresh=True)
        self.keep_new_shards_for_next_iteration()
        for unit in self.units:
            unit.invalidate()  # resident units (stages 1, 2) keep their memory, re-gathered at next use

    def prefetch_next_iteration(self) -> None:
        """Between iterations (after a step, or between micro-batches): start fetching the
        first units the next forward will need, the root first."""
        # into pooled buffers: full buffers hold no memory between steps (memory_bytes, the planner)
        self.prefetcher.start_in_order(self.schedule.next_iteration(), direct=False)

    def gather_now(self, unit: FlatUnit) -> None:
        """Gather `unit` outside the schedule (offload/runtime/gathered.py: on purpose, for a
        submodule called alone, for a state dict): its fetched-ahead shard or gather in
        flight is used, the trace is left as it is. Every rank must make the same calls."""
        self._gather(unit)

    def free_all(self) -> None:
        for unit in self.units:
            unit.release()  # waits for a gather in flight (every rank takes part in it)

    # -- fetching and gathering -----------------------------------------------------------

    def _prefetch_ahead(self) -> None:
        self.prefetcher.start_in_order(self.schedule.ahead())

    def _gather_next(self) -> None:
        """Issue the all-gather of the next unit on the trace now (world size > 1), so it
        runs under this unit's compute. Every rank reaches the same trace positions in the
        same order, so they issue the same gathers in the same order (docs/prefetch.md)."""
        if self.world_size == 1:
            return
        u = self.schedule.next_unit()
        if u is None:
            return
        unit = self.units[u]
        if unit.is_gathered or unit.gathering:
            return
        entry, local, filled = self._local_shard(unit)
        try:
            t0 = now()
            issued = unit.start_gather(local=local, filled=filled)
            t1 = now()
        finally:
            if local is not None:
                entry.drop_after_reads(unit.device)  # its copy into the unit's slot is queued
        self.timeline.count("collective", t1 - t0)
        if issued:
            self._issued[u] = t0

    def _gather(self, unit: FlatUnit) -> None:
        if unit.is_gathered:
            return
        tl = self.timeline
        if unit.gathering:  # issued ahead by _gather_next: wait for it
            t0 = now()
            unit.gather()
            t1 = now()
            tl.count("collective", t1 - t0)
            issued = self._issued.pop(unit.index, t0)
            tl.add(f"gather {unit.name or '<root>'}", "gather", "comm", issued, t1, unit.index, ahead=True)
            return
        entry, local, filled = self._local_shard(unit)
        try:
            t1 = now()
            unit.gather(local=local, filled=filled)
            t2 = now()
        finally:
            if local is not None:
                entry.drop_after_reads(unit.device)  # the staging buffer goes back once copied into `full`
        tl.count("collective", t2 - t1)
        tl.add(f"gather {unit.name or '<root>'}", "gather", "compute", t1, t2, unit.index)

    def _local_shard(self, unit: FlatUnit) -> tuple[Any, Optional[torch.Tensor], bool]:
        """This rank's shard of `unit`, for its gather: the prefetcher's entry (or one
        fetched now), waited for. Returns (entry, local, filled): `local` is the shard in a
        pooled host buffer (the caller drops the entry once it is copied), `filled` says a
        copy already put it in the unit's slot; (None, None, False) when the tier's shard is
        gathered from where it lives. Counts the wait and records the spans."""
        tl = self.timeline
        entry = self.prefetcher.take(unit.index)
        ahead = entry is not None
        if entry is None:
            entry = self.prefetcher.fetch_now(unit.index)
        if entry is None:
            return None, None, False
        cur = tl.current
        if cur is not None:
            cur.prefetched += int(ahead)
            cur.on_demand += int(not ahead)
        t0 = now()
        local = entry.wait()
        filled = local is None
        t1 = now()
        tl.count("fetch_wait", t1 - t0)
        if filled and entry.label == "copy":
            tl.count("copy_wait", t1 - t0)  # NVMe waits (reads, direct ones too) are in io_wait
        if tl.enabled:
            kind = entry.label
            name = unit.name or "<root>"
            tl.add(f"{kind} {name}", kind, "io", entry.started, entry.done_at or t1, unit.index, ahead=ahead)
            if t1 - t0 > 1e-5:
                tl.add(f"wait {name}", "wait", "compute", t0, t1, unit.index)
        return entry, local, filled


def _escapes(unit: FlatUnit, output: Any) -> bool:
    """[Note: escaped views] A unit's forward may return one of its own parameters (a
    module handing its bias to a later fused op: DeepSpeed's returned-parameter test). The
    parameter is a view of the unit's full buffer, which is freed after the forward by
    resizing its storage to 0: the view would then read freed memory (issue #29: a
    segfault at world size 2 and with the NVMe tier). Such a unit stays gathered until its
    backward has run (or, with no backward, until the next iteration), and is reduced at
    the end of backward: its gradient through the returned view arrives after its inputs'
    trigger. A unit aliased to its shard (world size 1, in memory) is never freed."""
    if unit.aliased or output is None:
        return False
    storage = unit.full.untyped_storage()
    if storage.nbytes() == 0:
        return False
    ptr = storage.data_ptr()
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr
               for t in tree_flatten(output)[0])
