"""The optimizer over shards: fp32 master + the optimizer's state per unit shard, in CPU memory or on NVMe.

`ShardedOptimizer` (alias `ShardedAdam`) runs Adam, AdamW, Lion or Adagrad
(offload/optim/kinds.py: each one's state tensors, hyperparameters and kernel). It is a `torch.optim.Optimizer` so that every `torch.optim.lr_scheduler` drives
it through `param_groups` (lr, betas, eps, weight_decay per group). Its state is not
torch's per-parameter dict but one `UnitOptimizerState` per unit: flat tensors
covering this rank's shard, kept by a store (`offload.storage.optim_state`: host memory, or a swap
file on NVMe streamed through pinned buffers). One step calls the type's flat kernel
(`adam_step_flat`, `lion_step_flat`, `adagrad_step_flat`) once per run of elements sharing a group and a step count (usually once per group per unit),
with the loss-scale/clip factor folded into `grad_scale` and the new low-precision parameters
written in the same pass (`out_lowp`). The units go through the store's pipeline
([Note: optimizer pipeline] in offload/storage/optim_state.py): with NVMe, unit i+1's state is read
while unit i is updated and unit i-1's state and parameter shard are written back.

Semantics are torch.optim.AdamW's (or Adam's with L2 when type='Adam', torch.optim.Adagrad's,
lion-pytorch's Lion): a parameter that
received no gradient in a step is skipped (no decay, no moment update, its step count does
not advance), as torch skips parameters whose `.grad` is None.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Optional, Sequence, Union

import torch

from offload.config.sections import Config
from offload.device_runtime import runtime
from offload.devices import StreamPurpose, side_stream
from offload.optim.grad_shard import GradShard
from offload.optim.kind import OptimizerKind, UpdateFn
from offload.optim.kinds import KindLike, kind_of, resolve_param_groups
from offload.sizes import align_up
from offload.storage.host_state import HOST_STATE_ALIGN_MIN_BYTES, host_state_bytes, host_state_zeros  # noqa: F401
from offload.storage.pinned import pinned_empty
from offload.storage.optim_state import HostOptimizerStates, UnitTensors
from offload.storage.state_store import OptimizerStates
from offload.storage.tiers import Tier, wait
from offload.units.shard import FROZEN_GROUP, FlatUnit, UnitLayout, UpdateRun, update_runs

@dataclass
class UnitOptimizerState:
    """One unit's optimizer state on this rank.

    master: fp32, the shard's first `unit.master_numel` elements: up to its frozen
        parameters, whose values live in the parameter shard only ([Note: frozen parameters
        cost their shard only] in offload/units/layout.py). With fp32 compute on the CPU it
        is a view of the parameter shard itself.
    grad_shard: the fp32 gradient shard, as long as the master (`GradShard`: the
        reduce-scatter's output, accumulated over micro-batches; always in host memory).
    moments: the optimizer's state tensors by name (`offload.optim.kinds.STATE_NAMES`: Adam's
        exp_avg and exp_avg_sq, Lion's exp_avg, Adagrad's sum), over the shard's optimized
        prefix only (frozen parameters get none).
    With the optimizer tier on NVMe, master and moments are None: the state lives
    in the swap file and is reached through `ShardedOptimizer.unit_state` or the step.
    """

    unit: FlatUnit
    master: Optional[torch.Tensor]
    grad_shard: GradShard
    moments: Optional[dict[str, torch.Tensor]]
    slot_steps: list[int]
    n_optimized: int = 0
    """Elements [0, n_optimized) of the shard carry moments."""
    on_device: bool = False
    """Master, moments, gradient shard on the compute device: [Note: the update split]."""

    @property
    def grad(self) -> torch.Tensor:
        """The gradient shard's values (`grad_shard.tensor`)."""
        return self.grad_shard.tensor

    @property
    def layout(self) -> UnitLayout:
        return self.unit.layout

    @property
    def exp_avg(self) -> Optional[torch.Tensor]:
        return None if self.moments is None else self.moments.get("exp_avg")

    @property
    def exp_avg_sq(self) -> Optional[torch.Tensor]:
        return None if self.moments is None else self.moments.get("exp_avg_sq")

    @property
    def optimized_numel(self) -> int:
        return self.n_optimized

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.master, self.grad, *(self.moments or {}).values())
            if t is not None
        )


def transient_grad_shards(config: Config, compute_on_gpu: bool) -> bool:
    """Whether the engine keeps a unit's fp32 gradient shard only from its reduce-scatter to
    its update during backward, instead of for the whole run (4 bytes per parameter of host
    memory that a model larger than RAM cannot spare).

    That needs every update to run during backward (docs/prefetch.md: the optimizer in
    backward, no clipping, no fp16, no non-finite guard, one micro-batch per step) and a CPU run: on a GPU run
    the shard is pinned memory, whose allocation is too slow to repeat every step."""
    return (
        not compute_on_gpu
        and bool(config.prefetch.optimizer_in_backward)
        and config.nonfinite_loss == "off"  # the guard updates at step() (runtime/optimizer_step.py)
        and float(config.gradient_clipping) <= 0.0
        and config.precision.dtype != "fp16"
        and int(config.gradient_accumulation_steps) == 1
    )


class ShardedOptimizer(torch.optim.Optimizer):
    """Adam/AdamW/Lion/Adagrad over flat shards (`kind`). Built by the engine; users touch `param_groups` (and
    schedulers do). `step(grad_scale=...)` is called by `engine.step()` at accumulation
    boundaries; `grad_scale=None` records a skipped step (fp16 overflow)."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        states: list[UnitOptimizerState],
        *,
        decoupled_weight_decay: bool = False,
        rank: int,
        param_tier: Tier,
        threads: int = 0,
        adam_fn: Optional[Callable[..., None]] = None,
        store: Optional[OptimizerStates] = None,
        kind: Optional[KindLike] = None,
        moments: str = "fp32",
    ) -> None:
        defaults = {k: v for k, v in param_groups[0].items() if k != "params"}
        self._groups_fixed = False  # torch's __init__ adds the engine's groups itself
        super().__init__(param_groups, defaults)
        self._groups_fixed = True
        self._warned_zero_grad = False
        self.unit_states = states
        self.store: OptimizerStates = store if store is not None else HostOptimizerStates(states)
        """Where master and moments live (`offload.storage.optim_state`): host memory
        (`store.resident`) or a swap file on NVMe."""
        self.record: OptimizerKind = kind_of(kind or ("AdamW" if decoupled_weight_decay else "Adam"))
        """The optimizer's kind (offload/optim/kind.py): states, hyperparameters, update."""
        self.kind = self.record.name
        """The optimizer type's name (`offload.optim.kinds.KINDS`, or a generic class's path)."""
        self.moments = moments
        """`optimizer.moments_dtype`: "fp32", "bf16" or "8bit" (Adam's blockwise 8-bit moments)."""
        self.specs = self.record.specs(moments)
        """Its state tensors per unit, beside the master (`offload.optim.kinds.state_specs`)."""
        self.state_names = tuple(spec.name for spec in self.specs)
        """Their names (torch's; 8-bit adds the per-block scales)."""
        self.decoupled_weight_decay = self.record.decoupled
        self.rank = rank
        self.param_tier = param_tier
        self._adam_fn = adam_fn
        self.threads = int(threads)
        """Threads each native update runs on (the engine's `resolve_threads`); 0 = the
        kernels' default (`offload.optim.get_num_threads`)."""
        self._staging: list[Optional[torch.Tensor]] = [None, None]
        """Two pinned host buffers the new low-precision shard of a device-tier unit is
        written to, then uploaded from on `_upload_stream` (double-buffered: the update of
        the next unit writes the other while this one's upload runs; F9)."""
        self._staging_done: list[Optional[Any]] = [None, None]
        """Per staging buffer, the event after its last upload (None: never uploaded)."""
        self._staging_next = 0
        self._upload_stream: Optional[Any] = None
        self._upload_device = torch.device("cpu")
        """The device `_upload_stream` is on."""
        self._work = [
            i for i, st in enumerate(self.unit_states) if st.layout.shard_optimized_numel(self.rank) > 0
        ]
        """Units with something to optimize in this rank's shard, in order (fixed by the layout).
        A unit whose shard here is all frozen parameters or padding is never read, updated or
        written back on this rank: nothing in it changes (before, its state was rewritten each
        step, bytes on the drive for nothing)."""
        self._work_set = frozenset(self._work)
        self._device_fn: Optional[UpdateFn] = (  # the units on the compute device: torch's kernels
            self.record.device_update(decoupled=self.decoupled_weight_decay, moments=moments)
            if any(st.on_device for st in self.unit_states) else None)
        self._fill_initial_state()

    @property
    def work_units(self) -> frozenset[int]:
        """The units with something to optimize on this rank."""
        return self._work_set

    def _adam(self) -> UpdateFn:
        """The update one run calls (`OptimizerKind.update`, offload/optim/kind.py)."""
        return self.record.update(decoupled=self.decoupled_weight_decay, threads=self.threads,
                                  adam_fn=self._adam_fn, moments=self.moments)

    @torch.no_grad()
    def _fill_initial_state(self) -> None:
        """State tensors that do not start at their zero (Adagrad's sum at a group's
        initial_accumulator_value): filled over each group's elements once, at build."""
        starts = [[self.record.initial_value(spec, g) for spec in self.specs] for g in self.param_groups]
        if all(v == spec.zero for row in starts for v, spec in zip(row, self.specs)):
            return
        for i in self._work:
            st = self.unit_states[i]
            slots = st.layout.slots
            runs = update_runs(st.layout, self.rank, [True] * len(slots), [1] * len(slots))
            with self.store.open(st.unit.index, write=True) as t:
                for run in runs:
                    for spec, value in zip(self.specs, starts[run.group]):
                        spec.part(t.moments[spec.name], run.start, run.end).fill_(value)

    # Not torch's signature: no closure (engine.step() drives it), and grad_scale / skip.
    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Optional[Callable[[], float]] = None, *, grad_scale: Optional[float] = 1.0,
        skip: Collection[int] = (),
    ) -> None:
        """Update every unit (but those in `skip`: already updated during backward by
        `update_unit`) through the store's pipeline."""
        if closure is not None:
            raise TypeError("engine.optimizer.step takes no closure; call engine.step()")
        if grad_scale is None:
            self.store.cancel_prefetch()
            return
        adam = self._adam()
        work = [i for i in self._work if i not in skip]
        for i, t in self.store.stream(work, self._scratch_bytes):
            self._update(self.unit_states[i], t, adam, grad_scale)
        for st in self.unit_states:
            if st.unit.index not in self._work_set and st.unit.index not in skip:
                st.slot_steps = _counted_steps(st)

    @torch.no_grad()
    def update_unit(self, index: int, grad_scale: float) -> bool:
        """Update one unit now (its gradient shard is final): the optimizer-in-backward path.
        Its state comes from a read started by `prefetch_units` when there is one. Returns
        False when the unit has nothing to optimize."""
        if index not in self._work_set:
            st = self.unit_states[index]
            st.slot_steps = _counted_steps(st)
            return False
        t = self.store.checkout(index, self._scratch_bytes(index))
        try:
            self._update(self.unit_states[index], t, self._adam(), grad_scale)
        except BaseException:
            self.store.abandon(index, t)
            raise
        self.store.checkin(index, t)
        return True

    def prefetch_units(self, indices: Collection[int]) -> None:
        """Start reading these units' state (NVMe) where buffers are free without waiting;
        nothing (and at no cost) when the state is in host memory."""
        if self.store.resident:
            return
        self.store.prefetch([i for i in indices if i in self._work_set], self._scratch_bytes,
                            limit=len(indices))

    def _update(self, st: UnitOptimizerState, t: UnitTensors, adam: UpdateFn, grad_scale: float) -> None:
        active = _active_slots(st)
        new_steps = _counted_steps(st)
        runs = update_runs(st.layout, self.rank, active, new_steps)
        if st.on_device and self._device_fn is not None:
            adam = self._device_fn
        lowp = self._lowp_target(st, t)
        if lowp is not None and runs and not _is_shard(self.param_tier, st, lowp):
            # A staging buffer is stored whole: what the runs do not write (frozen or
            # gradient-less parameters, gaps, padding) must hold the shard's current
            # values, which are always the master rounded to the compute dtype.
            _fill_outside_runs(lowp, t.master, runs)
        for run in runs:
            sl = slice(run.start, run.end)
            adam(
                t.master[sl], st.grad[sl],
                [spec.part(t.moments[spec.name], run.start, run.end) for spec in self.specs],
                step=run.step, group=self.param_groups[run.group], grad_scale=grad_scale,
                out_lowp=None if lowp is None else lowp[sl],
            )
        st.slot_steps = new_steps
        self._publish(st, t, lowp, bool(runs))

    def prefetch(self, skip: Collection[int] = ()) -> None:
        """Start reading the first units' state for the coming `step` (NVMe; a no-op in
        memory). The engine calls it before the overflow check and gradient norm."""
        self.store.prefetch([i for i in self._work if i not in skip], self._scratch_bytes)

    def _scratch_bytes(self, index: int) -> int:
        """Pooled bytes the step needs beside unit `index`'s state: its new low-precision
        shard, when the parameter tier is not addressable (NVMe: the shard is written from
        there without a copy)."""
        unit = self.unit_states[index].unit
        if unit.tier.addressable or unit.dtype == torch.float32:
            return 0
        return align_up(unit.master_numel * unit.full.element_size())

    def _lowp_target(self, st: UnitOptimizerState, t: UnitTensors) -> Optional[torch.Tensor]:
        """Where the updated low-precision parameters go: the tier's shard itself when it is
        host memory, the step's pooled scratch when the tier is NVMe, else a host staging
        buffer copied to the tier after the update (these two only as long as the master:
        the frozen suffix is never written); None when the parameter shard is the fp32
        master itself (or fp32 is stored by copy)."""
        unit = st.unit
        if unit.dtype == torch.float32:
            return None
        shard = self.param_tier.view(unit.key)
        if shard is not None and (st.on_device or not _uploads_to(unit, shard)):
            return shard  # host memory, or a device unit's shard beside its state: in place
        n = unit.master_numel
        if t.scratch is not None:
            return t.scratch[: n * unit.full.element_size()].view(unit.dtype)
        b = self._staging_next
        self._staging_next ^= 1
        done = self._staging_done[b]
        if done is not None:  # its upload two units ago has read it
            self._staging_done[b] = None
            runtime().synchronize(done)
        buf = self._staging[b]
        if buf is None or buf.numel() < n or buf.dtype != unit.dtype:
            # As large as the largest shard at once, so both buffers hold the same bytes
            # whatever the update order (the planner counts 2 x the largest shard).
            size = max(n, max((st.unit.master_numel for st in self.unit_states
                               if st.layout.has_optimized and not st.on_device), default=0))
            buf = self._staging[b] = (pinned_empty(size * unit.dtype.itemsize, unit.dtype)
                                      if torch.cuda.is_available() else torch.empty(size, dtype=unit.dtype))
        self._staging_in_use = b
        return buf[:n]

    def _publish(
        self, st: UnitOptimizerState, t: UnitTensors, lowp: Optional[torch.Tensor], updated: bool
    ) -> None:
        unit = st.unit
        if not updated:
            return
        shard = self.param_tier.view(unit.key)
        if unit.dtype == torch.float32:
            if shard is None or shard.data_ptr() != t.master.data_ptr():
                self._store(t, unit, t.master)
            return
        assert lowp is not None, "a low-precision unit has a target (_lowp_target)"
        if shard is not None and not st.on_device and _uploads_to(unit, shard) and runtime().is_pinned(lowp):
            self._upload(t, unit, lowp, shard.device, st.grad_shard.arrived)
        elif shard is None or lowp.data_ptr() != shard.data_ptr():
            self._store(t, unit, lowp)
        # A unit that stays gathered (world size 1, aliased) already sees the new values;
        # any other is re-gathered from the updated shard before its next use.

    def _upload(self, t: UnitTensors, unit: FlatUnit, src: torch.Tensor, device: torch.device,
                after: Optional[Any]) -> None:
        """Copy a staged shard up on the upload stream once nothing reads the old values
        ([Note: streams and threads], UPLOAD); the compute stream waits for it at
        `settle_uploads`, and the staging buffer is reused once its event has passed: no
        host wait here (a compute-stream sync per unit would serialise the step)."""
        rt = runtime()
        stream = self._upload_stream = side_stream(device, StreamPurpose.UPLOAD)
        self._upload_device = device
        if after is not None:
            rt.wait_event(stream, after)
        else:
            rt.wait_stream(stream, rt.current_stream(device))
        with rt.stream(stream):
            self._store(t, unit, src)
            done = rt.record(stream, f"upload {unit.index}")
        self._staging_done[self._staging_in_use] = done

    def settle_uploads(self) -> None:
        """Order the compute stream after every upload issued so far (before the next use of
        a device-tier shard: the next forward, a checkpoint, a state dict)."""
        if self._upload_stream is not None:
            rt = runtime()
            rt.wait_stream(rt.current_stream(self._upload_device), self._upload_stream)

    def _store(self, t: UnitTensors, unit: FlatUnit, src: torch.Tensor) -> None:
        handle = self.param_tier.store_prefix(unit.key, src)  # the master's part of the shard
        if t.owns(src):
            t.hold(handle)  # written from the pipeline's buffer: it outlives the write
        else:
            wait(handle)  # `src` is reused (staging) or changes next step (host master)

    @contextlib.contextmanager
    def unit_state(self, index: int) -> Iterator[dict[str, Any]]:
        """This rank's optimizer state of unit `index`, as host tensors, for reading.

        Yields {"master" and each of `state_names` (Adam: "exp_avg", "exp_avg_sq"): 1-D host
        tensors, "slot_steps": list}
        (frozen values are in the parameter shard: `FlatUnit.read_frozen`).
        The tensors are valid only inside the context: a tier that keeps the state off-host
        (NVMe) reads it into pooled buffers and takes them back on exit. This is the one
        way checkpoints and consolidation read optimizer state, unit by unit, so a model
        larger than host memory streams through a bounded amount of it.
        """
        st = self._state_of(index)
        with self.store.open(st.unit.index) as t:
            yield {"master": t.master, **t.moments, "slot_steps": list(st.slot_steps)}

    def load_unit_state(self, index: int, state: Mapping[str, Any]) -> None:
        """Overwrite unit `index`'s state (same keys as `unit_state`) and republish its
        parameter shard from the new master, and its frozen suffix from `state["frozen"]`
        when given (`FlatUnit.publish`). Shapes must match this engine's layout. With the
        state on NVMe it is written through to the swap file."""
        st = self._state_of(index)
        want = {"master": (st.unit.master_numel,)}
        want.update({spec.name: (spec.numel(st.optimized_numel),) for spec in self.specs})
        for name, shape in want.items():
            if name not in state:
                raise KeyError(
                    f"unit {st.unit.name or '<root>'}: the state has no {name!r} "
                    f"({self.kind} keeps {', '.join(self.state_names)}; it holds "
                    f"{', '.join(k for k in state if k not in ('master', 'slot_steps'))})"
                )
            src = state[name]
            if tuple(src.shape) != shape:
                raise ValueError(
                    f"unit {st.unit.name or '<root>'} {name}: saved shape {tuple(src.shape)} "
                    f"!= this engine's {shape} (different model or world size)"
                )
        with self.store.open(st.unit.index, write=True, overwrite=True) as t:
            for name in want:
                t.get(name).copy_(state[name])
            st.slot_steps = [int(s) for s in state["slot_steps"]]
            st.unit.publish(t.master, state.get("frozen"))

    def begin_overwrite(self, index: int) -> Optional[UnitTensors]:
        """For a loader that fills unit `index`'s whole state itself: the tensors to fill
        (pooled, laid out as the NVMe slot, so reads land there and one write stores them),
        or None when the store keeps the state in host memory (use `unit_state`)."""
        if self.store.resident_at(index):
            return None
        return self.store.checkout_overwrite(self._state_of(index).unit.index)

    def end_overwrite(
        self, index: int, t: UnitTensors, slot_steps: Sequence[int],
        adopt_from: Optional[tuple[str, dict[str, int]]] = None,
        frozen: Optional[torch.Tensor] = None,
    ) -> None:
        """Finish `begin_overwrite`: step counts, the parameter shard republished from the
        new master (and `frozen`, its frozen suffix, when given), the state written to the swap file (asynchronously) — or, with
        `adopt_from` (a file and where each tensor starts in it: the bytes `t` was read
        from), left there and read from it until the unit's next write
        ([Note: adopted state] in offload/storage/optim_state.py)."""
        st = self._state_of(index)
        if len(slot_steps) != len(st.slot_steps):
            self.store.abandon(st.unit.index, t)
            raise ValueError(f"unit {st.unit.name or '<root>'}: {len(slot_steps)} step counts for {len(st.slot_steps)} slots")
        st.slot_steps = [int(v) for v in slot_steps]
        try:
            st.unit.publish(t.master, frozen)
        except BaseException:
            self.store.abandon(st.unit.index, t)
            raise
        if adopt_from is not None:
            self.store.adopt(st.unit.index, t, *adopt_from)
        else:
            self.store.checkin(st.unit.index, t)

    def abandon_overwrite(self, index: int, t: UnitTensors) -> None:
        self.store.abandon(self._state_of(index).unit.index, t)

    def _state_of(self, index: int) -> UnitOptimizerState:
        for st in self.unit_states:
            if st.unit.index == index:
                return st
        raise KeyError(f"no unit with index {index} (this engine has {len(self.unit_states)} units)")

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """The host buffers new low-precision shards are staged in before they go to a
        device tier (none until first needed): counted by the engine's accounting."""
        return [b for b in self._staging if b is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """For loops written for a plain optimizer: gradients live in the engine's shards and
        `engine.step()` clears them at every optimizer step, so there is nothing to do.

        Called while micro-batches since the last step hold gradients (a loop that calls it
        at the start of every micro-batch, inside an accumulation window), it keeps them and
        warns once: discarding them would silently train on part of the window. That is
        what Hugging Face Accelerate does with DeepSpeed (its optimizer wrapper's
        `zero_grad` is a no-op) and with accumulation (it zeroes only at a step). To discard
        gradients on purpose call `engine.zero_grad()`."""
        if self._warned_zero_grad or not any(st.grad_shard.has_gradient for st in self.unit_states):
            return
        self._warned_zero_grad = True
        warnings.warn(
            "engine.optimizer.zero_grad() was called while the gradients of the micro-batches "
            "since the last engine.step() are held in the engine's shards: they were kept, not "
            "discarded. The engine clears gradients itself at every optimizer step, so the "
            "loop need not call zero_grad; call engine.zero_grad() to discard them on purpose",
            RuntimeWarning, stacklevel=2,
        )

    def clear_grads(self) -> None:
        """Forget every unit's gradients (the next micro-batch overwrites its shard): the
        engine's own clearing at a step, `engine.zero_grad()`, a checkpoint load."""
        for st in self.unit_states:
            st.grad_shard.clear()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once the engine is built: every parameter's place in its unit's shard,
        and whether it has optimizer state, was fixed by its group at `initialize`, so a
        group added later would silently never be trained."""
        if not self._groups_fixed:
            super().add_param_group(param_group)
            return
        raise ValueError(
            "engine.optimizer.add_param_group(...): the engine lays out every parameter by its "
            "optimizer group at offload.initialize, so a group added afterwards would never be "
            "trained. Pass every group to offload.initialize(model, config, optimizer=[{'params': "
            "[...]}, {'params': [...], 'lr': ...}]); a group meant to start later can start with "
            "lr 0 and be raised by a scheduler or by setting param_groups[i]['lr']"
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (shards), with torch's param_groups layout. Engine checkpoints
        add the manifest needed to re-shard it. With the state in host memory the tensors
        are the live ones; on NVMe they are copies read from the swap file (the whole state
        in host memory at once: stream with `unit_state` instead for large models)."""
        groups = []
        for g in self.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params"})
        state: dict[int, dict[str, Union[torch.Tensor, list[int]]]] = {}
        copy = not self.store.resident
        for st in self.unit_states:
            with self.store.open(st.unit.index) as t:
                state[st.unit.index] = {
                    name: (t.get(name).clone() if copy else t.get(name))
                    for name in ("master", *self.state_names)
                }
                state[st.unit.index]["slot_steps"] = list(st.slot_steps)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, this engine has "
                f"{len(self.param_groups)}"
            )
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for idx, s in state_dict["state"].items():
            self.load_unit_state(int(idx), s)


def _is_shard(tier: Tier, st: UnitOptimizerState, t: torch.Tensor) -> bool:
    shard = tier.view(st.unit.key)
    return shard is not None and shard.data_ptr() == t.data_ptr()


def _fill_outside_runs(lowp: torch.Tensor, master: torch.Tensor, runs: Sequence[UpdateRun]) -> None:
    pos = 0
    for run in [*runs, None]:
        end = lowp.numel() if run is None else run.start
        if end > pos:
            lowp[pos:end].copy_(master[pos:end])
        if run is not None:
            pos = run.end


ShardedAdam = ShardedOptimizer
"""The name of `ShardedOptimizer` from when it ran Adam only (kept for imports)."""

__all__ = ["ShardedOptimizer", "ShardedAdam", "UnitOptimizerState", "resolve_param_groups",
           "host_state_zeros", "host_state_bytes", "transient_grad_shards"]


def _active_slots(st: UnitOptimizerState) -> list[bool]:
    """The unit's parameters this step updates: trained ones with a gradient on some rank."""
    return [has and slot.group != FROZEN_GROUP for has, slot in zip(st.grad_shard.slot_has, st.layout.slots)]


def _counted_steps(st: UnitOptimizerState) -> list[int]:
    """The unit's step counts after this step: one more for each updated parameter, on every
    rank, whether or not this rank's shard holds any of it (a rank whose shard of the unit is
    all padding or frozen values still counts: a checkpoint re-sharded to another world size
    may give that rank elements of the parameter, and Adam's bias correction reads the count)."""
    return [s + 1 if a else s for s, a in zip(st.slot_steps, _active_slots(st))]


def _uploads_to(unit: FlatUnit, shard: torch.Tensor) -> bool:
    """Whether `unit`'s parameter shard lives on a device with streams (the device tier on a
    GPU), so its update is staged in host memory and uploaded."""
    return unit.tier.kind == "device" and runtime().has_streams(shard.device)
