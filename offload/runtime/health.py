"""Whether an engine may go on: its `EngineState`, the error that failed it, the parked
device memory, and the checks every public call makes first.

The owner of `EngineState` (offload/runtime/lifecycle.py has the Enum): a step that fails
part-way puts the engine in FAILED (`fail`); forward, backward, step and saves refuse with
the cause (`check_ready`); `load_checkpoint` recovers (`recover`, then `ready`).
"""

from __future__ import annotations

from typing import Optional

from offload.runtime.backward import BackwardTracker
from offload.runtime.gather import Gatherer
from offload.runtime.gathered import Gathering
from offload.runtime.lifecycle import EngineState
from offload.runtime.optimizer_step import StepPolicy
from offload.runtime.residency import DeviceResidency
from offload.storage.nvme import NVMeContext
from offload.storage.state_store import OptimizerStates
from offload.storage.tiers import Tier

__all__ = ["Health"]


class Health:
    """One engine's readiness; see the module docstring."""

    def __init__(self, policy: StepPolicy, gather: Gatherer, tracker: BackwardTracker,
                 gathering: Gathering, residency: DeviceResidency, param_tier: Tier,
                 store: OptimizerStates, nvme: Optional[NVMeContext]) -> None:
        self.state = EngineState.READY
        self.failure: Optional[BaseException] = None
        """What put the engine in EngineState.FAILED (the step's own error)."""
        self.policy, self.gather, self.tracker, self.gathering = policy, gather, tracker, gathering
        self.residency, self.param_tier, self.store, self.nvme = residency, param_tier, store, nvme

    def fail(self, exc: BaseException) -> None:
        """Enter EngineState.FAILED after `exc` interrupted an update part-way."""
        self.state = EngineState.FAILED
        self.failure = exc
        self.policy.reset()
        self.gather.drop()

    def settle(self, what: str) -> None:
        """Wait for the optimizer worker; an update that failed there part-applied the step.
        Refuses while device memory is parked (`engine.offload_states()`)."""
        self.residency.check(what)
        if (err := self.policy.settle()) is not None and self.state is EngineState.READY:
            self.fail(err)

    def check_ready(self, what: str) -> None:
        """Before `what` (a forward, backward, step, save): consistent, nothing gathered."""
        self.settle(what)
        if self.state is EngineState.READY:
            # A write that failed after its step returned (it surfaced in a later forward's
            # read, say) lost a shard just the same.
            lost = self.lost_write()
            if lost is not None:
                self.fail(lost)
        if self.state is EngineState.FAILED:
            exc = self.failure
            raise RuntimeError(
                f"{what}: an earlier optimizer step or backward failed part-way ({type(exc).__name__}: "
                f"{exc}), so the parameters, gradients and optimizer state may be inconsistent (some "
                "units updated or written, others not). Fix the cause, then engine.load_checkpoint(...) restores "
                "a consistent state and training goes on; or engine.close()"
            ) from exc
        self.gathering.check_closed(what)  # no step inside engine.gathered(...)

    def lost_write(self) -> Optional[BaseException]:
        """The error of a write whose failure has been seen (its slot is lost), or None."""
        return self.param_tier.write_failure() or self.store.write_failure()

    def recover(self) -> None:
        """Before a load restores the state of a failed engine: let every write still in
        flight finish and drop the failures it already reported."""
        if self.state is not EngineState.FAILED and self.lost_write() is None:
            return
        for owner in (self.param_tier, self.store):
            owner.settle()
        if self.nvme is not None:
            try:
                self.nvme.staging.drain()
            except OSError:
                pass  # already raised by the step that failed
        self.gather.free_all()
        self.tracker.reset()

    def ready(self) -> None:
        """Every unit's parameters and state come from a checkpoint: consistent again."""
        self.state, self.failure = EngineState.READY, None
        self.policy.reset()
