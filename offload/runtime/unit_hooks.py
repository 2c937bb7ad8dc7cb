"""The per-unit module hooks and the end-of-backward callback: where a forward or backward
pass reaches a unit, and which owner each event goes to.

`UnitHooks` holds no state of a pass itself: each hook asks the owner of what it touches.
- the root's pre-forward: the engine's health (`Health.check_ready`), the inputs' cast, the
  gatherer's iteration, this engine's activation-checkpoint settings;
- each unit's pre-forward: the gatherer hands it a gathered buffer (`Gatherer.use`); the
  backward tracker passes the inputs that need grad through the unit's post-backward
  trigger (`BackwardTracker.forward_with_grad`);
- each unit's post-forward: the tracker learns whether backward will visit (a multi-grad
  hook on the outputs that need grad is the unit's pre-backward);
- the first pre-backward of a pass: the tracker starts the pass, the step policy chooses
  where this pass's updates run (`StepPolicy.start_backward`), and the end-of-backward
  callback is queued in autograd's engine;
- a unit's post-backward trigger: the tracker reduces the unit when its gradients are final
  ([Note: when a unit's gradients are final] in offload/runtime/backward.py), and the units
  whose reduction completed go to the step policy's update in backward (`reduced`);
- the end of backward (`finish_backward`, idempotent: also called by `engine.backward` and
  `engine.step`): the tracker reduces every unit still pending, in one order on every rank.

The engine builds it, registers it once (`register`), and keeps the user's loop.
"""

from __future__ import annotations

import contextvars
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.device_runtime import runtime
from offload.runtime.activations import ActivationSettings, enter_engine, leave_engine
from offload.runtime.backward import BackwardTracker
from offload.runtime.gather import Gatherer
from offload.runtime.grads import Gradients
from offload.runtime.health import Health
from offload.runtime.lifecycle import bind, bind0, cast_inputs
from offload.runtime.optimizer_step import StepMode, StepPolicy
from offload.runtime.schedule import Phase
from offload.runtime.timeline import Timeline, now
from offload.units.partition import ROOT
from offload.units.shard import FlatUnit

__all__ = ["UnitHooks"]


class UnitHooks:
    """The module hooks of every unit of one engine's model."""

    def __init__(self, module: nn.Module, units: list[FlatUnit], gather: Gatherer,
                 tracker: BackwardTracker, policy: StepPolicy, grads: Gradients, timeline: Timeline,
                 device: torch.device, dtype: torch.dtype, activations: Optional[ActivationSettings]) -> None:
        self.module = module
        self.units = units
        self.gather = gather
        self.tracker = tracker
        self.policy = policy
        self.grads = grads
        self.timeline = timeline
        self.device = device
        self.dtype = dtype
        self.activations = activations
        """offload.checkpointing's default while this engine's forward runs (runtime/activations.py)."""
        self.health: Optional[Health] = None
        """Set once the engine's health is built (it needs the gathering, made after the hooks)."""
        self._in_forward: Optional[contextvars.Token] = None

    def register(self, handles: list[Any]) -> None:
        """A pre- and post-forward hook on each unit's module, weakly bound ([Note: weak hooks]
        in offload/runtime/lifecycle.py): the engine's finalizer removes `handles`."""
        for unit in self.units:
            module = self.module if unit.index == ROOT else self.module.get_submodule(unit.name)
            handles.append(module.register_forward_pre_hook(bind(self._pre_forward, unit), with_kwargs=True,
                                                            prepend=True))
            handles.append(module.register_forward_hook(bind(self._post_forward, unit), always_call=False))

    # -- forward ---------------------------------------------------------------------------

    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        tracker = self.tracker
        if unit.index == ROOT and not tracker.active:
            assert self.health is not None, "UnitHooks.health is set before the model can run"
            self.health.check_ready("the model's forward")
            self.grads.check_requires_grad()  # [Note: requires_grad after initialize]
            args, kwargs = cast_inputs(args, kwargs, self.device, self.dtype)
            self.gather.begin_iteration(self.policy.step_index, self.module.training)
            self._in_forward = enter_engine(self.activations)
        self.gather.use(unit, Phase.RECOMPUTE if tracker.active else Phase.FORWARD)
        if tracker.is_recomputation(unit) or not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        outs = tracker.forward_with_grad(unit, [flat[i] for i in idx], bind0(self._post_backward, unit))
        if unit.index == ROOT or not idx:
            return args, kwargs
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, output: Any) -> Any:
        if self.tracker.active:
            return None  # recomputation: stays gathered until the unit's post-backward
        if unit.index == ROOT and self._in_forward is not None:
            leave_engine(self._in_forward)  # this engine's activation settings end with its forward
            self._in_forward = None
        if self.timeline.enabled:
            self.timeline.add(f"fwd {unit.name or '<root>'}", "compute", "compute",
                              self.gather.compute_started(unit), now(), unit.index)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, bind(self._pre_backward, unit), mode="any")
        elif unit.index == ROOT:
            self.tracker.nothing_pending(unit)  # backward will never visit
        if self.gather.after_forward(unit, backward_follows=bool(tensors), output=output):
            self.tracker.untrack(unit)  # a parameter returned out of its unit
        return None

    # -- backward --------------------------------------------------------------------------

    def _pre_backward(self, unit: FlatUnit, grad: Any) -> None:
        tracker, policy = self.tracker, self.policy
        if tracker.start():
            # Runs when this backward pass finishes, inside the autograd engine.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            if policy.start_backward() is StepMode.IN_BACKWARD:
                # The last units updated are the next forward's first: keep their new shards.
                self.gather.keep_new_shards_for_next_iteration()
            # Gradient shards come down from the GPU on a side stream; their reader waits for
            # each: the optimizer worker, or the step (`StepPolicy.settle`).
            tracker.copy_grads_async(runtime().has_streams(self.device))
            tracker.set_boundary(policy.is_boundary())
        self.gather.use(unit, Phase.BACKWARD)
        tracker.entered(unit)
        if policy.mode is StepMode.IN_BACKWARD:
            # This unit's state, and the next two's, are read while its backward computes
            # (as far as the pinned pool has room without waiting; nothing for host state).
            policy.optimizer.prefetch_units([unit.index] + self.gather.next_uses(Phase.BACKWARD, 2))

    def _post_backward(self, unit: FlatUnit) -> None:
        self.reduced(self.tracker.post_backward(unit, self.policy.check_gradients_wanted))

    def reduced(self, units: list[FlatUnit]) -> None:
        """Units whose gradient shard just became final: with the optimizer in backward,
        update them now (their fetched copies are stale first)."""
        if self.policy.mode is not StepMode.IN_BACKWARD:
            return
        for unit in units:
            self.gather.drop(unit.index)
            self.policy.update_in_backward(unit)
            unit.invalidate()  # a resident unit's gathered copy (stages 1, 2) is stale now

    def finish_backward(self) -> None:
        """End of a backward pass (also called by `engine.backward` and `engine.step`:
        idempotent)."""
        if not self.tracker.has_work():
            return
        self.gather.end_backward()
        self.tracker.finish(self.policy.check_gradients_wanted, self.reduced)
        if not self.policy.is_boundary():
            self.gather.prefetch_next_iteration()  # the next micro-batch sees the same shards

    def abort_backward(self, cause: Optional[BaseException] = None) -> None:
        """A backward pass died (or a non-finite loss skips it): the worker's updates end
        first, the gathered units and pending reduces go; a window that cannot be put back
        exactly is marked lost (`step()` refuses until `zero_grad()`)."""
        self.policy.abort_backward()
        self.gather.abort()
        if not self.tracker.abort() and cause is not None:
            self.policy.lost.lose(cause)
