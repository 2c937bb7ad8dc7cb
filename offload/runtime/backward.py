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
largest shard serves every unit: `GradScratch` (offload/optim/grad_shard.py) lends it to
the shard at the reduce (`GradShard.acquire`) and takes it back after the update
(`GradShard.release`); it keeps its one borrower itself. The scratch is touched
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

from offload.optim.grad_shard import GradScratch, GradSnapshot, GradState
from offload.runtime.timeline import Timeline, now
from offload.units.hybrid import ReplicaMean, replica_mean
from offload.units.partition import ROOT
from offload.units.shard import FlatUnit

__all__ = ["BackwardTracker", "Pass", "UnitPass", "PostBackward"]


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
        by the engine: with the optimizer worker): the shard's `ready` event says when."""
        self.at_boundary = True
        """This pass ends the step's accumulation window (set per pass by the engine)."""
        self.scratch = GradScratch([st.grad_shard for st in states],
                                   enabled=share_scratch and transient_grads and self.world_size == 1)
        """Memory for transient gradient shards ([Note: one scratch for transient gradient
        shards]); not shared when the optimizer worker updates one unit while the next is
        reduced (`share_scratch` False)."""
        self._before: list[GradSnapshot] = []
        """Each unit's gradient shard as the current pass began (`abort` restores them)."""
        self._reduced: set[int] = set()
        """Units this pass has reduced into their shard."""

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
        self._before = [st.grad_shard.snapshot() for st in self.states]
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
            shard = st.grad_shard
            shard.acquire(unit.layout, self.rank, whole=self.world_size > 1 or shard.has_gradient,
                          scratch=self.scratch)  # a transient shard: bytes now
            mean = replica_mean(unit.pg, self.at_boundary, shard.has_gradient, shard.unaveraged)
            red = unit.start_reduce_scatter(st.grad, accumulate=shard.has_gradient, replicas=mean)
            self._reduced.add(unit.index)
            shard.reduced(red.have, averaged_later=mean is ReplicaMean.LATER)
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
            shard = self.states[unit.index].grad_shard
            shard.wait_arrived()  # a second pass adds to what the first one's copy brings down
            shard.arriving(red.wait(host_async=self.async_grads, label=str(unit.index)))
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
            before = self._before[i]
            if before.state not in (GradState.EMPTY, GradState.RELEASED):
                exact = False  # the sum of earlier micro-batches has this pass's part in it
                continue
            self.states[i].grad_shard.restore(before)
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
