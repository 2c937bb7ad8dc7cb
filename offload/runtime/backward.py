"""The backward tracker: which units a backward pass has reached, and their gradients'
way into the rank's fp32 gradient shards (docs/engine.md).

Per unit it keeps a `UnitPass` (IDLE → FORWARD: a grad-enabled forward ran, gradients will
need reducing → BACKWARD: its pre-backward hook fired, it is gathered for backward → IDLE
once reduced). Gradients complete through an autograd function on the unit's inputs
(`PostBackward`): when the gradient of a unit's input is produced, every parameter
gradient of that forward call is already accumulated (autograd runs a leaf's
AccumulateGrad before other ready nodes; FSDP2 relies on the same ordering), so the
unit's gradients are reduce-scattered into its host shard then, and the full buffer is
freed. A callback at the end of backward (`finish`) catches every unit the trigger could
not (inputs without grad, the root).

With more than one rank a reduce-scatter is only issued at its unit and completed at the
next unit's (or at the end of backward), so it runs under the backward of the unit before.
`reduce` and `finish` return the units whose reduction completed: the optimizer-step
policy updates them during backward when it runs the optimizer there.

[Note: when a unit's gradients are final]
A unit is reduced (and, with the optimizer in backward, updated) during backward only when
no further gradient can reach its parameters in this pass: every grad-enabled forward call
of the unit in the iteration carried the trigger, and every trigger has fired. A call
whose inputs need no grad (DeepSpeed's SimpleModel runs layers[0] on the raw input and
again later; ALBERT-style sharing; a first block after a frozen embedding) still produces
parameter gradients, but nothing on its inputs fires when they are in; the unit then waits
for the end of backward (`finish`), when autograd has run every node. Any call we cannot
account for makes the unit wait; none is ever reduced early (issue #29: the early reduce
lost the untracked call's gradients, raised, or freed a buffer its backward still read).

[Note: one scratch for transient gradient shards]
A transient gradient shard (`offload.optim.sharded.transient_grad_shards`) holds memory
only from its unit's reduce to its update. Given fresh memory at every reduce, the copy of
the gradients into it runs at page-fault speed, not memory speed (a 98 MB shard: 55 ms
instead of 5 ms on this machine): most of what `step_stats()` counted as `collective_s` at
world size 1, where there is no collective. At world size 1 the reduce and the update of
a unit are back to back (the reduce completes at once), so one buffer as large as the
largest shard serves every unit: `GradScratch` points the shard's storage into it at the
reduce and `release_grad` points it away again after the update. The scratch is touched
once, at the first step; the peak is the one a fresh shard had (one unit's), now held
between steps as well. A shard is given fresh memory as before when the scratch is taken
(a step whose updates do not all run in backward keeps its shards until `engine.step()`)
and at world size > 1 (two reduces in flight).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import torch

from offload.runtime.build import acquire_storage, zero_unwritten
from offload.runtime.timeline import Timeline, now
from offload.units.full_buffers import CAN_POINT, point_storage, unpoint_storage
from offload.units.hybrid import ReplicaMean, replica_mean
from offload.units.partition import ROOT
from offload.units.shard import FlatUnit

__all__ = ["BackwardTracker", "GradScratch", "Pass", "UnitPass", "PostBackward", "release_grad"]


class Pass(enum.Enum):
    """Whether a backward pass is running (from its first pre-backward hook to its end)."""

    FORWARD = "forward"
    """No backward running: forwards (and their recording for backward) only."""
    BACKWARD = "backward"


class UnitPass(enum.Enum):
    """Where one unit is in the current forward/backward pass."""

    IDLE = "idle"
    FORWARD = "forward"
    """A grad-enabled forward ran: gradients will need reducing."""
    BACKWARD = "backward"
    """Its pre-backward hook fired: it is gathered for backward."""


@dataclass
class _Track:
    state: UnitPass = UnitPass.IDLE
    n_forward: int = 0
    """Grad-enabled forwards whose inputs carry our post-backward trigger."""
    n_post_backward: int = 0
    untracked: int = 0
    """Grad-enabled forwards none of whose inputs needs grad: no trigger can say when their
    parameter gradients are in, so the unit waits for the end of backward ([Note: when a
    unit's gradients are final])."""


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward says "backward has left this unit"."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


class BackwardTracker:
    """Per-unit pass state and the gradient reduce-scatters in flight."""

    def __init__(self, units: list[FlatUnit], states: list[Any], transient_grads: bool,
                 timeline: Timeline, compute_started: Callable[[FlatUnit], float],
                 share_scratch: bool = True) -> None:
        self.units = units
        self.states = states
        self.transient_grads = transient_grads
        self.timeline = timeline
        self._compute_started = compute_started
        self.state = Pass.FORWARD
        self._tracks = [_Track() for _ in units]
        self._reduces: list[tuple[FlatUnit, Any, float]] = []
        """Gradient reduce-scatters issued, not yet completed, with when they were issued."""
        self.world_size = units[0].pg.world_size if units else 1
        self.rank = units[0].pg.rank if units else 0
        self.async_grads = False
        """This pass's gradient shards come down from the GPU asynchronously (set per pass
        by the engine: with the optimizer worker): the shard's `grad_ready` event says when."""
        self.at_boundary = True
        """This pass ends the step's accumulation window (set per pass by the engine)."""
        self.scratch = GradScratch(states, enabled=share_scratch and transient_grads and self.world_size == 1)
        self._before: list[tuple[bool, bool, list[bool], int]] = []
        """Each unit's gradient-shard flags as the current pass began (`abort` restores them)."""
        self._reduced: set[int] = set()
        """Units this pass has reduced into their shard."""
        """Memory for transient gradient shards ([Note: one scratch for transient gradient
        shards]); not shared when the optimizer worker updates one unit while the next is
        reduced (`share_scratch` False)."""

    @property
    def active(self) -> bool:
        """A backward pass is running (forwards now are recomputations)."""
        return self.state is Pass.BACKWARD

    # -- forward -----------------------------------------------------------------------

    def is_recomputation(self, unit: FlatUnit) -> bool:
        """A forward inside backward of a unit whose original forward carries the trigger
        (non-reentrant activation checkpointing): it stays as it is; the recomputed graph
        is never back-propagated, so a trigger on it would never fire. (Re-entrant
        recomputation finds n_forward == 0: its original forward ran without grad.)"""
        t = self._tracks[unit.index]
        return self.active and (t.state is UnitPass.BACKWARD or t.n_forward > 0)

    def forward_with_grad(self, unit: FlatUnit, inputs: list[torch.Tensor],
                          on_post_backward: Callable[[], None]) -> list[torch.Tensor]:
        """A grad-enabled forward of `unit` starts: its gradients will need reducing. Returns
        the inputs that need grad, passed through the post-backward trigger (the root gets
        none: the end of backward reduces it; a call with no such input is counted as
        untracked: [Note: when a unit's gradients are final])."""
        t = self._tracks[unit.index]
        if t.state is UnitPass.IDLE:
            t.state = UnitPass.FORWARD
        if unit.index == ROOT:
            return inputs
        if not inputs:
            t.untracked += 1
            return inputs
        t.n_forward += 1
        return list(PostBackward.apply(on_post_backward, *inputs))

    def called_outside(self, unit: FlatUnit) -> None:
        """A submodule of the unit ran with gradients enabled outside the model's forward:
        the unit's gradients will need reducing, at the end of backward (no trigger)."""
        t = self._tracks[unit.index]
        if t.state is UnitPass.IDLE:
            t.state = UnitPass.FORWARD
        t.untracked += 1

    def untrack(self, unit: FlatUnit) -> None:
        """A gradient can reach the unit's parameters by a way its trigger does not see (a
        view of them in its output): it waits for the end of backward ([Note: when a unit's
        gradients are final])."""
        self._tracks[unit.index].untracked += 1

    def nothing_pending(self, unit: FlatUnit) -> None:
        """A forward backward will never visit (eval, no_grad) ended at `unit`."""
        self._tracks[unit.index].state = UnitPass.IDLE

    # -- backward ------------------------------------------------------------------------

    def start(self) -> bool:
        """The first pre-backward hook of a pass: True when this starts the pass."""
        if self.state is Pass.BACKWARD:
            return False
        self.state = Pass.BACKWARD
        self._before = [(st.grad_valid, st.grad_unaveraged, list(st.slot_has_grad), st.grad_reduces)
                        for st in self.states]
        self._reduced = set()
        return True

    def entered(self, unit: FlatUnit) -> None:
        self._tracks[unit.index].state = UnitPass.BACKWARD

    def post_backward(self, unit: FlatUnit, check: Callable[[FlatUnit], None]) -> list[FlatUnit]:
        """The trigger on one of the unit's forward calls fired; once all have, reduce
        (unless an untracked call leaves the unit to the end of backward)."""
        t = self._tracks[unit.index]
        t.n_post_backward += 1
        if t.n_post_backward >= t.n_forward and not t.untracked:
            return self.reduce(unit, check)
        return []

    def reduce(self, unit: FlatUnit, check: Callable[[FlatUnit], None]) -> list[FlatUnit]:
        """Reduce-scatter the unit's gradients into its host shard and free it; returns the
        units whose reduction completed now (all but the newest in flight, world size > 1).
        `check(unit)` raises when the unit must not receive gradients now."""
        st = self.states[unit.index]
        t0 = now()
        if not unit.layout.has_optimized:
            for p in unit.params:  # nothing trains them: their gradients are not kept
                p.grad = None
        else:  # on every rank, also one whose part of the unit is frozen (no gradient shard)
            check(unit)
            if st.grad.untyped_storage().nbytes() == 0:  # a transient shard: bytes now
                self.scratch.acquire(st.grad, unit.layout, self.rank,
                                     whole=self.world_size > 1 or st.grad_valid)
            mean = replica_mean(unit.pg, self.at_boundary, st.grad_valid, st.grad_unaveraged)
            red = unit.start_reduce_scatter(st.grad, accumulate=st.grad_valid, replicas=mean)
            self._reduced.add(unit.index)
            st.grad_valid = True
            st.grad_reduces += 1
            st.grad_unaveraged = mean is ReplicaMean.LATER
            st.slot_has_grad = [a or b for a, b in zip(st.slot_has_grad, red.have)]
            self._reduces.append((unit, red, t0))
        t1 = now()
        tl = self.timeline
        tl.count("collective", t1 - t0)
        if tl.enabled:
            name = unit.name or "<root>"
            if self._tracks[unit.index].state is UnitPass.BACKWARD:
                tl.add(f"bwd {name}", "compute", "compute", self._compute_started(unit), t0, unit.index)
            tl.add(f"reduce-issue {name}", "reduce", "compute", t0, t1, unit.index)
        self._tracks[unit.index] = _Track()
        if unit.index != ROOT:
            unit.free()
        return self.complete(keep=1 if self.world_size > 1 else 0)

    def complete(self, keep: int) -> list[FlatUnit]:
        """Complete the reduce-scatters in flight but the newest `keep`, oldest first (every
        rank completes them at the same points); returns their units."""
        done = []
        while len(self._reduces) > keep:
            unit, red, issued = self._reduces.pop(0)
            t0 = now()
            self.states[unit.index].grad_ready = red.wait(host_async=self.async_grads)
            t1 = now()
            self.timeline.count("collective", t1 - t0)
            self.timeline.add(f"reduce {unit.name or '<root>'}", "reduce", "comm", issued, t1, unit.index)
            done.append(unit)
        return done

    def set_boundary(self, at_boundary: bool) -> None:
        """Whether this backward pass ends the step's accumulation window (HSDP averages
        across replicas there: [Note: HSDP averages once per step] in units/hybrid.py), set as
        each backward pass starts."""
        self.at_boundary = at_boundary

    def copy_grads_async(self, on: bool) -> None:
        """Whether this backward's gradient shards come down from the GPU on a side stream
        (the optimizer worker waits for each), set as each backward pass starts."""
        self.async_grads = on

    def has_work(self) -> bool:
        return self.active or any(t.state is not UnitPass.IDLE for t in self._tracks)

    def finish(self, check: Callable[[FlatUnit], None],
               updated: Callable[[list[FlatUnit]], None]) -> None:
        """End of a backward pass: reduce every unit still pending, in one fixed order on
        every rank (collectives must match), then free the root. `updated(units)` takes the
        units whose reduction completed, as they complete (the optimizer in backward)."""
        for unit in reversed(self.units):
            if self._tracks[unit.index].state is not UnitPass.IDLE:
                updated(self.reduce(unit, check))
            elif unit.index != ROOT:
                unit.free()
            self._tracks[unit.index] = _Track()
        updated(self.complete(keep=0))
        self.units[ROOT].free()
        self.state = Pass.FORWARD

    def abort(self) -> bool:
        """A backward died half-way: issued collectives complete on every rank; the pass's
        partial gradients and state go. A shard the pass reduced into is put back as it was
        before the pass where that is exact: one that held no gradient yet holds none again
        (its next reduce overwrites it). Returns False when the pass had added to a shard that
        already held earlier micro-batches' sums (no exact way back: the caller marks the
        accumulation window lost), True otherwise."""
        for _, red, _ in self._reduces:
            try:
                red.wait()
            except Exception:  # noqa: BLE001 - the backward's own error is what is raised
                pass
        self._reduces = []
        exact = True
        for i in sorted(self._reduced):
            if i >= len(self._before):
                continue
            valid, unaveraged, has, reduces = self._before[i]
            st = self.states[i]
            if valid:
                exact = False  # the sum of earlier micro-batches has this pass's part in it
                continue
            st.grad_valid, st.grad_unaveraged, st.slot_has_grad = valid, unaveraged, list(has)
            st.grad_reduces = reduces
            st.grad_ready = None
        self._reduced = set()
        for unit in self.units:
            for p in unit.params:
                p.grad = None
            unit.free()
        self.reset()
        return exact

    def reset(self) -> None:
        self._tracks = [_Track() for _ in self.units]
        self.state = Pass.FORWARD

    def drain(self) -> None:
        """Wait for every reduce-scatter in flight (close)."""
        for _, red, _ in self._reduces:
            red.wait()
        self._reduces = []


_SCRATCH_ATTR = "_offload_grad_scratch"
"""Set on a gradient shard whose storage points into a `GradScratch`: keeps the scratch
alive as long as the shard points into it."""


class GradScratch:
    """One host buffer that transient gradient shards borrow from their reduce to their
    update ([Note: one scratch for transient gradient shards]). Used from the engine's
    thread; `enabled` only at world size 1 with transient shards."""

    def __init__(self, states: list[Any], enabled: bool) -> None:
        self.states = states
        self.enabled = enabled and CAN_POINT
        self.buf: Any = None
        self.holder: Any = None
        """The gradient shard that last borrowed the buffer."""

    def busy(self) -> bool:
        h = self.holder
        return h is not None and getattr(h, _SCRATCH_ATTR, None) is self.buf \
            and h.untyped_storage().nbytes() != 0

    def acquire(self, grad: torch.Tensor, layout: Any, rank: int, whole: bool) -> None:
        """Give the released shard `grad` memory: the scratch when it is free, else fresh
        memory (`acquire_storage`). Either way its alignment gaps (or all of it, `whole`)
        read as zeros."""
        if not self.enabled or self.busy() or grad.dtype != torch.float32 or grad.device.type != "cpu":
            acquire_storage(grad, layout, rank, whole)
            return
        if self.buf is None:
            n = max(st.grad.numel() for st in self.states)
            self.buf = torch.empty(n, dtype=torch.float32)
        point_storage(grad, self.buf)
        setattr(grad, _SCRATCH_ATTR, self.buf)
        self.holder = grad
        # Not fresh memory: the previous unit's values are there. The reduce writes every
        # slot (copy, or zeros); what it never writes is zeroed here, as for fresh memory.
        zero_unwritten(grad, layout, rank, whole)


def release_grad(grad: torch.Tensor) -> None:
    """Give a transient gradient shard's memory back, keeping its size: its own memory, or
    the `GradScratch` it borrowed (the shard's storage then has 0 bytes again)."""
    storage = grad.untyped_storage()
    if storage.nbytes() == 0:
        return
    if getattr(grad, _SCRATCH_ATTR, None) is None:
        storage.resize_(0)
        return
    unpoint_storage(grad)  # resizable and empty, as released
    delattr(grad, _SCRATCH_ATTR)


