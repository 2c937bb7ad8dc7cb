"""The optimizer-step policy: when and how the sharded optimizer updates the units.

It owns the step counters, the loss scaler, the non-finite-loss guard and the choice, once
per backward pass, of where updates run (`StepMode`):
- `AT_STEP`: `engine.step()` at a boundary folds the fp16 overflow, the global norm, loss
  scale, accumulation and clipping into one `grad_scale` and runs the CPU Adam (`apply`).
- `IN_BACKWARD`: each unit is updated as soon as its gradient shard is final (its
  reduce-scatter completed), under the backward of the units before it. Only when nothing
  needs the whole gradient first: no clipping, no fp16 loss scale, no non-finite guard
  (`nonfinite_loss: off`), at a boundary, and where the user's micro-batches run one
  backward pass each ([Note: several backward passes per step]; docs/prefetch.md).

The non-finite guard: [Note: no non-finite value is applied] in offload/runtime/nonfinite.py.
[Note: the norm of every step]
The global gradient norm is reported for every applied step (`counters.last_grad_norm`,
`engine.get_global_grad_norm()`), clipping or not, in either mode, for the cost of one dot
per unit shard and one all-reduce. In `AT_STEP` the step takes each unit's sum of squares
from its shard. In `IN_BACKWARD` a unit's shard may be gone by the step (a transient shard
is released after its update), so `update_in_backward` takes the unit's sum of squares just
before its update, when the shard is final, and the step adds these partial sums in the
same unit order. Either way the sum runs in float64 over units in index order and is
all-reduced once, so the norm clipping uses is the one it always used: training does not
change. A step that is skipped reports inf (as DeepSpeed's ZeRO-3 does).

[Note: several backward passes per step]
A loop may call `engine.backward()` more than once before `engine.step()` without marking
the accumulation boundary (a loss computed in parts, each part's backward run as soon as it
is ready). DeepSpeed accumulates such passes, and so does the engine. An update that runs
during a backward pass cannot take a later pass's gradients, and nothing at a pass's start
says whether another will follow before `step()`, so the policy learns the pattern
(`Pattern` in offload/runtime/update_mode.py, which learns reads into the window too:
[Note: the update mode is learned]):
- It counts the backward passes begun at a boundary since the last `step()`
  (`boundary_passes`; a pass the user marked with `set_gradient_accumulation_boundary(False)`,
  DeepSpeed's way, is accumulation and does not count).
- The first boundary micro-batch of the run that runs a backward pass updates at `step()`
  (the learning step). If it, or any later boundary micro-batch, ran more than one pass, the
  run is multi-pass: every later boundary updates at `step()`, the passes accumulating into
  the gradient shards as micro-batches do. Only while every boundary micro-batch so far ran
  exactly one pass does the first pass of the next one update during backward. A further
  pass after a first one that updated at `step()` simply accumulates.
- The learning step costs one step's overlap and no memory (outside transient shards
  every gradient shard is held for the whole run anyway; the planner counts it).
- Transient gradient shards (`offload.optim.sharded.transient_grad_shards`: a CPU run with
  the update in backward, gradient_accumulation_steps 1, no clipping) are the exception:
  each shard exists only from its unit's reduce to its update, and the plan counts no
  gradient memory, so holding a whole step's gradients for a learning step would take
  4 bytes per parameter of host memory the plan left out. Such runs update during the first
  backward pass from the first step on.
- A pass that begins after this step's updates already ran (a transient run's second pass,
  or a run that changes from one pass per step to two) raises. It cannot be refused before
  the updates: they ran during the first pass, when nothing said a second would follow. The
  error says so: the weights hold the first pass's update (a whole update, of fewer samples
  than the user meant; never a unit updated twice or left half-done), the refused pass
  added no gradient, and the fixes are `set_gradient_accumulation_boundary(False)` before
  every pass of a step but the last (True or None before the last), or
  `prefetch.optimizer_in_backward=false`. A run without transient shards then updates at
  `step()` from its next step on. With transient shards, either fix holds the gradient
  shards between the passes (4 bytes per parameter the plan did not count).
"""

from __future__ import annotations

import enum
import logging
import math
import warnings
from typing import Any, Callable, Optional

import torch

from offload.device_runtime import runtime
from offload.runtime.agreement import agree_on_step, agree_on_unit, take_unit_agreement, unit_flags
from offload.runtime.loss_scaler import LossScaler
from offload.runtime.nonfinite import LostWindow, may_update_in_backward, nonfinite_units, sum_of_squares
from offload.runtime.optimizer_worker import OptimizerWorker, uses_worker
from offload.runtime.step_scale import Outcome, StepScale, needs_norm, step_scale
from offload.runtime.timeline import Timeline, now
from offload.runtime.update_mode import (Eligibility, Pattern, Site, learn, observed, second_pass_message,
                                         site_of_updates)
from offload.runtime.view import Schedule, StepCounters
from offload.units.collectives import ProcessGroupInfo, all_reduce_host, all_reduce_host_later
from offload.units.hybrid import average_shard_across_replicas
from offload.units.shard import FlatUnit
from offload.config.sections import Config
from offload.optim.sharded import ShardedOptimizer, UnitOptimizerState
from offload.storage.nvme import NVMeContext

logger = logging.getLogger("offload.engine")

__all__ = ["StepMode", "StepPolicy", "may_update_in_backward", "uses_worker"]


class StepMode(enum.Enum):
    AT_STEP = "at_step"
    IN_BACKWARD = "in_backward"


class StepPolicy:
    """Counters, loss scale and the optimizer's updates for one engine."""

    def __init__(self, config: Config, dtype: torch.dtype, optimizer: ShardedOptimizer,
                 states: list[UnitOptimizerState], pg: ProcessGroupInfo, device: torch.device,
                 timeline: Timeline, nvme: Optional[NVMeContext], transient_grads: bool) -> None:
        self.config = config
        self.dtype = dtype
        self.optimizer = optimizer
        self.states = states
        self.pg = pg
        self.device = device
        self.timeline = timeline
        self.nvme = nvme
        self.transient_grads = transient_grads
        self.scaler = LossScaler.from_precision(config.precision)
        self.counters = StepCounters()
        self.gradient_accumulation_steps = int(config.gradient_accumulation_steps)
        self.boundary: Optional[bool] = None
        """Set by `engine.set_gradient_accumulation_boundary`: whether the current micro-batch
        ends an accumulation window, instead of counting micro-batches (None: count)."""
        self.schedule = Schedule()
        """The LR scheduler (`set_scheduler`); the checkpoint view shares this object."""
        self.mode = StepMode.AT_STEP
        self.boundary_passes = 0
        """Backward passes begun at an accumulation boundary since the last `engine.step()`
        ([Note: several backward passes per step])."""
        self.window_passes = 0
        """Backward passes (or non-finite losses) in this accumulation window (`no_gradient`)."""
        self._warned_no_gradient = False
        self.lost = LostWindow()
        """A failed backward that left this window's sums part-added (until `discard_gradients`)."""
        self.pattern = Pattern.LEARNING
        """What the user's boundary micro-batches do ([Note: the update mode is learned] in
        offload/runtime/update_mode.py)."""
        self.updated: set[int] = set()
        """Units whose update already ran during this step's backward."""
        self.pass_updates = 0
        """Updates run by the current backward pass (a failure after one is part-applied)."""
        self._nonfinite_loss: Optional[float] = None
        """A non-finite loss seen in this accumulation step (nonfinite_loss='skip')."""
        self._hyper_at_backward: Optional[list[tuple]] = None
        self._warned_hyper = False
        self._warned_read = False
        self._sum_sq: dict[int, torch.Tensor] = {}
        """Unit index -> its gradient's sum of squares (float64), taken before its update
        during backward ([Note: the norm of every step])."""
        self._norm: Optional[float] = None
        """This step's global gradient norm, once computed (by `clip_this_step`): reused
        by `apply`, forgotten when the gradients change."""
        self.clip_request: Optional[float] = None
        """The max_norm of `engine.clip_grad_norm_` for this step (replaces
        config.gradient_clipping for it)."""
        self.worker: Optional[OptimizerWorker] = (
            OptimizerWorker() if uses_worker(config, device, nvme is not None) else None)
        """Runs the updates during backward off autograd's thread (`prefetch.optimizer_worker`:
        offload/runtime/optimizer_worker.py); None: they run where they are asked for."""

    # -- micro-batches -------------------------------------------------------------------

    @property
    def lr_scheduler(self) -> Any:
        return self.schedule.scheduler

    def set_scheduler(self, scheduler: Any) -> None:
        """A scheduler over the engine's optimizer, stepped at every applied step."""
        self.schedule.scheduler = scheduler

    def set_boundary(self, is_boundary: Optional[bool]) -> None:
        """`engine.set_gradient_accumulation_boundary`: whether the coming micro-batch ends
        an accumulation window (None: count to gradient_accumulation_steps again)."""
        self.boundary = is_boundary

    def abort_backward(self) -> None:
        """A backward pass that died: the worker's updates land first, then the next pass
        starts from AT_STEP."""
        self.settle()
        self.mode = StepMode.AT_STEP

    def is_boundary(self) -> bool:
        if self.boundary is not None:
            return self.boundary
        return (self.counters.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def end_micro_batch(self) -> bool:
        """`engine.step()`: count the micro-batch; returns whether it ends an accumulation
        window. A boundary with a backward pass teaches the policy how many passes the
        user's micro-batches run ([Note: several backward passes per step])."""
        boundary = self.is_boundary()
        if boundary:
            self.window_passes = 0
        self.counters.micro_steps += 1
        if boundary:
            self.pattern = learn(self.pattern, self.boundary_passes)
        self.boundary_passes = 0
        return boundary

    def no_gradient(self) -> bool:
        """`engine.step()` at a boundary whose whole window ran no backward: nothing to count
        or apply (torch warns alike for a scheduler stepped before its optimizer). Warns once."""
        if self.window_passes or not self.is_boundary():
            return False
        if not self._warned_no_gradient:
            self._warned_no_gradient = True
            message = ("engine.step() ends an accumulation window in which no engine.backward() ran: "
                       "there is no gradient to apply, so nothing was done (global_steps, the "
                       "micro-batch count and the LR schedule stay where they are). Call "
                       "engine.backward(loss) before each engine.step()")
            logger.warning(message)
            warnings.warn(message, UserWarning, stacklevel=3)
        return True

    @property
    def step_index(self) -> int:
        """Optimizer steps taken so far, applied or skipped."""
        return self.counters.global_steps + self.counters.skipped_steps

    def nonfinite_loss(self, loss: torch.Tensor) -> Optional[float]:
        """config.nonfinite_loss (bf16/fp32): the loss value when any rank's loss is NaN/inf
        (every rank agrees, so collectives stay matched), else None."""
        mode = self.config.nonfinite_loss
        if mode == "off" or self.dtype == torch.float16:
            return None
        value = float(loss.detach().float())
        flag = torch.tensor([0.0 if math.isfinite(value) else 1.0])
        if self.pg.world_size > 1:
            flag = self._all_reduce(flag, "max")
        return value if flag.item() else None

    def skip_for_loss(self, value: float) -> None:
        """The micro-batch with loss `value` ran no backward: skip this step at its boundary,
        or raise (nonfinite_loss='raise')."""
        self.window_passes += 1  # a micro-batch all the same: its step counts (skipped)
        if self.config.nonfinite_loss == "raise":
            where = f"loss {value}" if not math.isfinite(value) else "a non-finite loss on another rank"
            raise FloatingPointError(
                f"{where} at optimizer step {self.step_index}, micro-batch "
                f"{self.counters.micro_steps}: nothing was applied; skip this batch and go on, "
                "lower the learning rate, or set nonfinite_loss='skip' to skip such steps"
            )
        self._nonfinite_loss = value

    # -- updates during backward -----------------------------------------------------------

    def start_backward(self) -> StepMode:
        """Decide, once per backward pass, whether units update as their gradients finish
        ([Note: several backward passes per step])."""
        self.pass_updates = 0
        self.window_passes += 1
        self._norm = None  # the gradients are about to change
        at_boundary = self.is_boundary()
        self.boundary_passes += int(at_boundary)
        if self.updated:
            # Raised at the first moment anything shows a second pass: the updates ran
            # during the first one, when nothing said another would follow.
            self.pattern = learn(self.pattern, 2)  # a run without transient shards accumulates from now on
            raise RuntimeError(second_pass_message(self.transient_grads, self.step_index))
        eligible = Eligibility(
            enabled=self.config.prefetch.optimizer_in_backward,
            whole_gradient_first=(
                not may_update_in_backward(self.config)  # [Note: no non-finite value is applied]
                or self._nonfinite_loss is not None  # this step will be skipped
                or float(self.config.gradient_clipping) > 0.0
                or self.dtype == torch.float16
                or self.scaler.scale != 1.0
            ),
            at_boundary=at_boundary,
            first_pass=self.boundary_passes == 1,  # a later pass adds to what the first one left
        )
        in_backward = site_of_updates(eligible, self.pattern, self.transient_grads) is Site.IN_BACKWARD
        self.mode = StepMode.IN_BACKWARD if in_backward else StepMode.AT_STEP
        return self.mode

    def observe(self) -> None:
        """Something reads or changes gradients or weights (or clips) now: where that is
        between a boundary backward and `step()`, the run's later steps update at `step()`
        ([Note: the update mode is learned])."""
        if self.boundary_passes and self.is_boundary():
            self.pattern = observed(self.pattern)

    def warn_read_after_update(self, what: str) -> None:
        """A read of state this step's backward already updated: it shows the value after the
        update (plain PyTorch would show it before). Warned once; later steps update at step()."""
        if self._warned_read:
            return
        self._warned_read = True
        warnings.warn(
            f"{what} was read between engine.backward() and engine.step() after this step's update "
            "ran during backward (prefetch.optimizer_in_backward): it is the value after this step. "
            "From the next step on the engine updates at engine.step(), so such reads see the value "
            "before it, as in plain PyTorch; set prefetch.optimizer_in_backward=false to have it so "
            "from the first step", RuntimeWarning, stacklevel=4)

    def check_gradients_wanted(self, unit: FlatUnit) -> None:
        """Raise when `unit` would receive gradients after its update ran in backward."""
        if unit.index in self.updated:
            raise RuntimeError(
                f"unit {unit.name or '<root>'} received gradients after its optimizer update "
                "ran during backward (two backward passes before engine.step() at an "
                "accumulation boundary?); set prefetch.optimizer_in_backward=false for such "
                "loops, or call engine.step() after each engine.backward()"
            )

    def updates_at_step(self) -> bool:
        """Whether `apply` has units left to update (not all ran during backward)."""
        return not self.optimizer.work_units <= self.updated

    def settle(self) -> Optional[BaseException]:
        """Wait for the updates the worker runs, the gradients' copies down from the device,
        and the uploads to it; returns the error of one that failed (the step is then
        part-applied), or None. Called before anything reads or writes what an update touches."""
        err = self.worker.settle() if self.worker is not None else None
        for st in self.states:  # gradients still coming down (a backward without updates)
            st.grad_shard.wait_arrived(keep_event=False)  # later uploads follow all compute
        self.optimizer.settle_uploads()
        return err

    def close(self) -> None:
        """Let the worker's updates land, then stop it."""
        self.settle()
        if self.worker is not None:
            self.worker.close()

    def update_in_backward(self, unit: FlatUnit) -> None:
        """Update `unit`, whose gradient shard is final: now, or on the worker (the
        collective that agrees on its gradient-less parameters runs here first: every rank
        reduces units in the same order)."""
        st = self.states[unit.index]
        tl = self.timeline
        agreed: Optional[Callable[[], None]] = None
        if self.pg.world_size > 1:
            # Which parameters got a gradient on any rank (the step's sync_has_grad, for this
            # unit now), and that every rank is at this unit: every rank issues it in the same
            # order. With the worker, the flags come down asynchronously and the worker reads
            # them before the update: no host wait on autograd's thread.
            t0 = now()
            if self.worker is None:
                agree_on_unit(st, self.pg.rank, self._all_reduce)
            else:
                flags = all_reduce_host_later(unit_flags(st), "max", self.pg, self.device)
                agreed = lambda: take_unit_agreement(st, self.pg.rank, flags())  # noqa: E731
            tl.count("collective", now() - t0)
        if self._hyper_at_backward is None:
            self._hyper_at_backward = self._hyperparameters()
        if self.worker is None:
            self._update_unit(unit, st)
        else:
            self.worker.submit(lambda: self._update_unit(unit, st, agreed))
        self.updated.add(unit.index)
        self.pass_updates += 1

    def _update_unit(self, unit: FlatUnit, st: Any, agreed: Optional[Callable[[], None]] = None) -> None:
        """One unit's update during backward (on the worker, or autograd's thread), after the
        ranks' agreement on its gradients where that is still coming (`agreed`)."""
        tl = self.timeline
        if agreed is not None:
            agreed()
        st.grad_shard.wait_arrived()  # its gradient shard may still be coming down from the GPU
        io0 = self._io_wait()
        t0 = now()
        with runtime().host_work(f"adam {unit.index}"):
            sq = sum_of_squares(st)  # the shard is final; after the update it may be gone
            if sq is not None:
                self._sum_sq[unit.index] = sq
            updated = self.optimizer.update_unit(
                unit.index, grad_scale=1.0 / (self.scaler.scale * self.gradient_accumulation_steps))
        t1 = now()
        if self.transient_grads:
            st.grad_shard.release()  # consumed; re-acquired by the next step's reduce-scatter
        tl.count("optimizer", t1 - t0)
        tl.count("optimizer_in_backward", t1 - t0)
        if self.nvme is not None:
            tl.count("optimizer_io", self._io_wait() - io0)
        if tl.current is not None:
            tl.current.optimizer_in_backward_units += int(updated)
        tl.add(f"adam {unit.name or '<root>'}", "optimizer", "optimizer", t0, t1, unit.index)

    # -- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self) -> Optional[FloatingPointError]:
        """Apply (or skip) the optimizer step at a boundary, in named stages (DeepSpeed's
        `stage3.step()` shape); returns the error to raise once the step's bookkeeping is
        done (nonfinite_loss='raise' and a non-finite norm)."""
        self._settle_backward_updates()
        self._prepare_gradients()
        scale, nonfinite = self._scale_of_step()
        self._run_updates(scale.grad_scale)
        self._advance(skipped=scale.outcome.skipped)
        return nonfinite

    def _settle_backward_updates(self) -> None:
        """Stage 1: the updates the worker runs for this step's backward have landed (one that
        failed is raised: the step is part-applied)."""
        t0 = now()
        err = self.settle()
        if self.worker is not None:
            self.timeline.count("optimizer_wait", now() - t0)
        if err is not None:
            raise err

    def _prepare_gradients(self) -> None:
        """Stage 2: HSDP's deferred replica average, the first units' NVMe state reads started
        (they run under the checks), and every rank's agreement on the shards."""
        self.average_across_replicas()
        self.optimizer.prefetch(self.updated)
        self._sync_has_grad()

    def _scale_of_step(self) -> tuple[StepScale, Optional[FloatingPointError]]:
        """Stage 3: the fp16 overflow, a non-finite loss, the norm and the clip factor folded
        into one scale, or the skip with its reason (`step_scale.step_scale`), said once."""
        unscale = 1.0 / (self.scaler.scale * self.gradient_accumulation_steps)
        overflow = self._fp16_overflow()
        lost_loss, self._nonfinite_loss = self._nonfinite_loss, None
        norm = None
        if needs_norm(overflow, lost_loss is not None):
            # reported every step ([Note: the norm of every step]); used if clipping
            norm = self._norm if self._norm is not None else self._grad_norm(unscale)
        clip = float(self.config.gradient_clipping) if self.clip_request is None else self.clip_request
        scale = step_scale(unscale=unscale, overflow=overflow, nonfinite_loss=lost_loss is not None, norm=norm,
                           guard=self.config.nonfinite_loss, updated_in_backward=bool(self.updated), clip=clip)
        nonfinite = self._say_skipped(scale.outcome, lost_loss, norm)
        self.counters.last_grad_norm = scale.reported_norm
        return scale, nonfinite

    def _run_updates(self, grad_scale: Optional[float]) -> None:
        """Stage 4: every unit not updated in backward (a skip records the step only), and the
        device-tier uploads the next forward reads."""
        tl = self.timeline
        io0 = self._io_wait()
        t0 = now()
        with tl.span("adam (step)", "optimizer", "optimizer"):
            self.optimizer.step(grad_scale=grad_scale, skip=self.updated)
        tl.count("optimizer", now() - t0)
        if self.nvme is not None:
            tl.count("optimizer_io", self._io_wait() - io0)
        self.optimizer.settle_uploads()  # the next forward reads what the step uploaded
        self._check_hyperparameters()

    def _advance(self, skipped: bool) -> None:
        """Stage 5: the counters, the loss scale, the schedule; the gradients cleared."""
        self.updated = set()
        self.mode = StepMode.AT_STEP
        self.scaler.update(skipped)
        if skipped:
            self.counters.skipped_steps += 1
        else:
            self.counters.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.discard_gradients()

    def _fp16_overflow(self) -> bool:
        """fp16: whether any rank's gradient shard holds an inf or NaN (one all-reduce)."""
        if self.dtype != torch.float16:
            return False
        flag = torch.zeros(1, dtype=torch.float32)
        for st in self.states:
            g = st.grad[: st.optimized_numel] if st.grad_shard.has_gradient else st.grad[:0]
            if g.numel() and not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
        return bool(self._all_reduce(flag, "max").item())

    def _say_skipped(self, outcome: Outcome, loss: Optional[float], norm: Optional[float]
                     ) -> Optional[FloatingPointError]:
        """Log a step skipped for a non-finite value; returns the error `raise` wants."""
        skipped = self.counters.skipped_steps + 1
        if outcome is Outcome.NONFINITE_LOSS:
            logger.warning("optimizer step %d skipped: a micro-batch's loss was %s (nonfinite_loss='skip'); "
                           "%d step(s) skipped so far", self.step_index, loss, skipped)
        elif outcome is Outcome.NONFINITE_GRAD:
            logger.warning("optimizer step %d skipped: a non-finite gradient (the norm is %s) in %s "
                           "(nonfinite_loss='skip'); %d step(s) skipped so far", self.step_index, norm,
                           self._nonfinite_units(), skipped)
        elif outcome is Outcome.NONFINITE_GRAD_RAISE:
            return FloatingPointError(
                f"a non-finite gradient at optimizer step {self.step_index} (the norm is {norm}), in "
                f"{self._nonfinite_units()}: the step was skipped on every rank, nothing was applied; "
                "skip this batch and go on, lower the learning rate, or set nonfinite_loss='skip' to "
                "skip such steps without raising")
        return None

    def _grad_norm(self, unscale: float) -> float:
        """The global norm of this step's gradients, un-scaled: one all-reduce (every rank
        calls it at the same point)."""
        sq = torch.zeros(1, dtype=torch.float64)
        for st in self.states:
            part = self._sum_sq.get(st.unit.index)
            if part is None:
                part = sum_of_squares(st)
            if part is not None:
                sq += part.to(sq.device)  # a device unit's sum stays on the device until here
        return math.sqrt(self._all_reduce(sq, "sum").item()) * unscale

    def _nonfinite_units(self) -> str:
        return nonfinite_units([sum_of_squares(st) for st in self.states], [st.unit.name for st in self.states],
                               lambda flags: self._all_reduce(flags, "max") if self.pg.world_size > 1 else flags)

    # -- what the user asks of this step's gradients -----------------------------------------

    def clip_this_step(self, max_norm: float) -> float:
        """`engine.clip_grad_norm_`: clip this step with `max_norm`; returns the global norm
        (a collective: every rank calls it at the same point)."""
        gas = self.gradient_accumulation_steps
        if not self.is_boundary():
            k = self.counters.micro_steps % gas + 1
            raise RuntimeError(
                f"engine.clip_grad_norm_ at micro-batch {k} of an accumulation window of {gas}: "
                "the gradients are not complete before the window's last backward; call it "
                "after that backward, when engine.is_gradient_accumulation_boundary() is True"
            )
        if self.updated:
            raise RuntimeError(
                "engine.clip_grad_norm_: this step's optimizer updates already ran during "
                "backward, unclipped (prefetch.optimizer_in_backward, the default), so it can "
                "no longer clip. Set gradient_clipping=<max_norm> in the config (the engine "
                "clips every step itself, and runs those steps' updates at engine.step()), or "
                "set prefetch.optimizer_in_backward=false to call clip_grad_norm_ yourself; "
                "call engine.step() to finish this step"
            )
        if self._norm is None:
            self.average_across_replicas()
            self._norm = self._grad_norm(1.0 / (self.scaler.scale * gas))
        self.clip_request = float(max_norm)
        self.observe()  # learned as several passes are: later steps update at step()
        return self._norm

    def average_across_replicas(self) -> None:
        """HSDP: average the gradient shards that still hold un-averaged sums (no reduction
        at the boundary reached their unit) across the replicas, in unit order on every rank
        ([Note: HSDP averages once per step] in offload/units/hybrid.py)."""
        for st in self.states:
            if st.grad_shard.unaveraged:
                st.grad_shard.wait_arrived()
                average_shard_across_replicas(st.grad, st.unit.pg, self.device)
                st.grad_shard.averaged()

    def discard_gradients(self) -> None:
        """Forget the gradients accumulated since the last step (the step's own clearing,
        `engine.zero_grad()`, a checkpoint load)."""
        self.optimizer.clear_grads()
        self.lost.clear()
        self._sum_sq = {}
        self._norm = None
        self.clip_request = None

    def reset(self) -> None:
        """After a failure, or a load that restored every unit: no update is pending."""
        self.updated = set()
        self.mode = StepMode.AT_STEP
        self._sum_sq = {}
        self._norm = None
        self.clip_request = None
        self.pass_updates = 0
        self.boundary_passes = 0
        self._hyper_at_backward = None

    # -- helpers ---------------------------------------------------------------------------

    def _hyperparameters(self) -> list[tuple]:
        keys = self.optimizer.record.hyperparams  # the optimizer type's (offload/optim/kind.py)
        return [
            tuple(tuple(g[k]) if k == "betas" else float(g[k]) for k in keys)
            for g in self.optimizer.param_groups
        ]

    def _check_hyperparameters(self) -> None:
        """Units updated during backward used the hyperparameters of that moment: say so
        (once) if the user changed them between backward and step."""
        before, self._hyper_at_backward = self._hyper_at_backward, None
        if before is None or self._warned_hyper or before == self._hyperparameters():
            return
        self._warned_hyper = True
        warnings.warn(
            "optimizer hyperparameters (lr, betas, eps, weight_decay) changed between "
            "engine.backward() and engine.step(); with prefetch.optimizer_in_backward the units "
            "updated during backward used the earlier values. Set them before the forward "
            "(or before engine.backward()), or set prefetch.optimizer_in_backward=false",
            RuntimeWarning, stacklevel=4,
        )

    def _sync_has_grad(self) -> None:
        """Agree across ranks on which parameters got a gradient this step, and that every
        rank reduced the same units (offload/runtime/agreement.py)."""
        if self.pg.world_size > 1:
            agree_on_step(self.states, self.pg.rank, self._all_reduce)

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return all_reduce_host(t, op, self.pg, self.device)

    def _io_wait(self) -> float:
        return self.nvme.stats.wait_s if self.nvme is not None else 0.0
