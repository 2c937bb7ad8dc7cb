"""The user's object: `offload.initialize(model, config)` and the `Engine` it returns.

    engine = offload.initialize(model, config)
    loss = engine(batch)        # the model's forward, same arguments and outputs
    engine.backward(loss)
    engine.step()               # optimizer step at accumulation boundaries

What happens underneath (see docs/engine.md for the full story):
- The model is split into units (`offload.units.partition`); each unit's parameters are flattened
  into one buffer and sharded over ranks (`offload.units.shard`); the module's parameters are
  replaced by views into the unit's full buffer, which exists only while gathered.
- Module hooks drive everything, as FSDP2's `fully_shard` does: a unit's pre-forward hook
  gathers it, its post-forward hook frees it and hooks its outputs so that backward
  gathers it again; when backward has passed through the unit (an autograd function on
  its inputs fires), its gradients are reduce-scattered into the rank's fp32 gradient
  shard on the host and the full buffer is freed. A callback at the end of backward
  catches every unit the in-backward trigger could not (inputs without grad, the root).
- `step()` computes the fp16 overflow flag and the global gradient norm across ranks,
  folds loss-scale, accumulation and clipping into one `grad_scale`, and runs the CPU
  Adam over every unit's shard (`offload.optim.sharded.ShardedAdam`).
- With `offload.param_tier='nvme'` and/or `offload.optimizer_tier='nvme'` (docs/nvme.md),
  shards and optimizer states live in per-rank swap files under `offload.nvme_path`, moved
  by one AIO handle through one pinned staging pool (`offload.storage.nvme.NVMeContext`). What the
  machine must offer (the directory, free space, a budget that holds one unit) is checked
  here, at `initialize`, and the files are deleted by `close()` (also on `with` exit and by
  a finalizer at garbage collection or interpreter exit).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

import offload.units.collectives as _dist
from offload.config import Config, load_config
from offload.runtime.lifecycle import (
    LIVE_ENGINES,
    EngineState,
    bind,
    bind0,
    check_weights_present,
    forward_of_a_closed_model,
    released_parameters,
    remove_hooks,
)
from offload.runtime.loss_scaler import LossScaler
from offload.runtime.prefetch import Prefetcher
from offload.runtime.schedule import Schedule
from offload.units.shard import FROZEN_GROUP, FlatUnit, UnitState, layout_unit
from offload.storage.io import align_up
from offload.optim.sharded import (
    ShardedAdam, UnitOptimizerState, host_state_zeros, moments_dtype, resolve_param_groups,
    transient_grad_shards,
)
from offload.storage.tiers import make_param_tier, wait
from offload.runtime.timeline import Timeline, now
from offload.units.partition import ROOT, ParamRecord, UnitPlan, plan_units

logger = logging.getLogger(__name__)

__all__ = ["Engine", "initialize"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ConfigLike = Union[Config, Mapping[str, Any], str, "os.PathLike[str]", None]


def initialize(
    model: nn.Module,
    config: ConfigLike = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
) -> "Engine":
    """Wrap `model` for partitioned training; see `Engine`.

    config: an `offload.Config`, a dict or JSON/YAML path (ours or DeepSpeed's), or None
        for the defaults.
    optimizer: None (one group from `config.optimizer`); a dict of hyperparameters that
        override it; a list of torch-style param groups (`[{"params": [...], "weight_decay":
        0.0}, ...]` over the model's parameters); or a `torch.optim.Adam`/`AdamW` built on
        the model, whose groups and hyperparameters are taken over (its state is not).
    lr_scheduler: a `torch.optim.lr_scheduler` object over `engine.optimizer` cannot exist
        yet, so pass a callable `optimizer -> scheduler`; it is built on `engine.optimizer`
        and stepped by `engine.step()` at every applied optimizer step (as DeepSpeed does).
        None with `config.scheduler` set builds that schedule.
    """
    return Engine(model, load_config(config), optimizer=optimizer, lr_scheduler=lr_scheduler)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("compute_device='cuda' but no CUDA GPU is available; use 'cpu' or 'auto'")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"compute_device={name!r}; allowed: 'auto', 'cpu', 'cuda'")


@dataclass
class _Track:
    """Per-unit bookkeeping for one backward pass (reset when the unit is reduced)."""

    n_forward: int = 0
    """Grad-enabled forwards whose inputs carry our post-backward trigger."""
    n_post_backward: int = 0
    pending: bool = False
    """A grad-enabled forward ran: gradients will need reducing."""
    in_backward: bool = False
    """The unit's pre-backward hook fired (it is gathered for backward)."""


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward says "backward has left this unit".

    Autograd runs a leaf's AccumulateGrad before other ready nodes, so when the gradient
    of a unit's input is produced, every parameter gradient of that forward call is
    already accumulated (FSDP2 relies on the same ordering)."""

    @staticmethod
    def forward(ctx, callback, *tensors):  # type: ignore[override]
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.callback()
        return (None,) + grads


class Engine:
    """ZeRO-3 partitioned training of one model; built by `offload.initialize`.

    Attributes users rely on: `module` (the wrapped model), `optimizer` (a
    `torch.optim.Optimizer` whose `param_groups` drive the learning rate), `lr_scheduler`,
    `global_steps` (applied optimizer steps), `micro_steps`, `skipped_steps`,
    `loss_scale`, `last_grad_norm`, `rank`, `world_size`, `device`.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        *,
        optimizer: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config
        self.module = model
        device_type = _resolve_device(config.compute_device).type
        self.dtype = _DTYPES[config.precision.dtype]
        # The group first: starting it from torchrun's env selects this rank's GPU
        # (LOCAL_RANK), which the compute device must then be.
        self.pg = _dist.setup_process_group(device_type, float(config.collective_timeout_s))
        self.device = _resolve_device(config.compute_device)
        self.rank, self.world_size = self.pg.rank, self.pg.world_size
        self.placement_plan = None
        if config.offload.placement == "auto":  # the planner picks the tiers (offload/plan/planner.py)
            from offload.plan import resolve_placement

            config, self.placement_plan = resolve_placement(model, config, optimizer, self.pg, self.device)
            self.config = config
        self.nvme = None
        self._finalizer = None
        self.scaler = LossScaler.from_precision(config.precision)
        self.gradient_accumulation_steps = int(config.gradient_accumulation_steps)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self._in_backward = False
        self._hooks: list[Any] = []
        LIVE_ENGINES.add(self)
        self.state = EngineState.READY
        self._failure: Optional[BaseException] = None
        """What put the engine in EngineState.FAILED (the step's own error)."""
        self._nonfinite_loss: Optional[float] = None
        """A non-finite loss seen in this accumulation step (config.nonfinite_loss='skip'):
        the step is skipped at its boundary."""

        check_weights_present(model)
        plans = plan_units(model, config.unit_modules)
        groups, group_of, decoupled = resolve_param_groups(model, config.optimizer, optimizer)
        planned = self._plan_layouts(plans, group_of)
        self._setup_tiers(planned)
        try:
            self._build_units(planned)
        except BaseException:
            if self._finalizer is not None:
                self._finalizer()  # no swap files left behind by a failed initialize
            raise
        self._swap_buffers()
        self._index_state_dict()
        opt_groups = []
        for gi, g in enumerate(groups):
            params = [
                u.params[i]
                for u in self.units
                for i, s in enumerate(u.layout.slots)
                if s.group == gi
            ]
            opt_groups.append({**g, "params": params})
        self.optimizer = ShardedAdam(
            opt_groups,
            self.states,
            decoupled_weight_decay=decoupled,
            rank=self.rank,
            param_tier=self.param_tier,
            threads=config.cpu_adam_threads,
            store=self.optimizer_states,
        )
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self._tracks = [_Track() for _ in self.units]
        self._setup_schedule()
        self._register_hooks()

    # -- construction ----------------------------------------------------------------------

    def _setup_schedule(self) -> None:
        """Prefetch schedule, timeline and the optimizer-in-backward state (docs/prefetch.md)."""
        tl, pf = self.config.timeline, self.config.prefetch
        self.timeline = Timeline(tl.enabled, tl.path)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.schedule = Schedule(
            [0 if u.aliased else u.layout.padded_numel * itemsize for u in self.units],
            pf.prefetch_bytes, pf.keep_bytes, pinned=[ROOT],
        )
        self.prefetcher = Prefetcher(self.units, self.param_tier, self.timeline)
        if self.nvme is not None:
            stats = self.nvme.stats
            self.timeline.io_wait_clock = lambda: stats.wait_s
            # A prefetch holds pooled buffers; a buffer needed now takes precedence.
            self.nvme.staging.reclaimers.append(self.prefetcher.reclaim)
            self.nvme.staging.reclaimers.append(self.optimizer_states.reclaim)
        self._compute_t0 = [0.0] * len(self.units)
        self._reduces: list[tuple[FlatUnit, Any, float]] = []
        self._gather_issued: dict[int, float] = {}
        """Gradient reduce-scatters issued, not yet completed (`_complete_reduces`)."""
        self._opt_in_backward = False
        self._pass_updates = 0
        self._updated: set[int] = set()
        """Units whose update already ran during this step's backward."""
        self._hyper_at_backward: Optional[list[tuple]] = None
        self._warned_hyper = False

    def _plan_layouts(
        self, plans: list[UnitPlan], group_of: dict[int, int]
    ) -> list[tuple[UnitPlan, Any, list[ParamRecord]]]:
        """Each unit's flat layout (pure arithmetic): the swap files are sized from these
        before anything is allocated."""
        out = []
        for plan in plans:
            entries = []
            for rec in plan.params:
                g = group_of.get(id(rec.param), FROZEN_GROUP) if rec.param.requires_grad else FROZEN_GROUP
                entries.append((rec.name, tuple(rec.param.shape), g))
            layout = layout_unit(entries, self.world_size)
            by_name = {rec.name: rec for rec in plan.params}
            out.append((plan, layout, [by_name[s.name] for s in layout.slots]))
        return out

    def _setup_tiers(self, planned: list[tuple[UnitPlan, Any, list[ParamRecord]]]) -> None:
        """The parameter tier and the optimizer-state store; for NVMe, the rank's swap
        directory, AIO handle and staging pool, after checking at the door that the machine
        can hold them (directory, free space, pinned budget). Every rank learns whether any
        rank failed, so all raise together instead of some waiting in a collective."""
        from offload.storage.optim_state import NVMeOptimizerStates, state_layout

        off = self.config.offload
        mdtype = moments_dtype(self.config.optimizer.moments_dtype)
        uses_nvme = "nvme" in (off.param_tier, off.optimizer_tier)
        self.optimizer_states: Any = None
        error: Optional[BaseException] = None
        try:
            if uses_nvme:
                from offload.storage.nvme import NVMeContext

                self._check_nvme(planned, mdtype, state_layout)
                self.nvme = NVMeContext(
                    off.nvme_path, self.rank,
                    budget_bytes=int(off.pinned_budget_bytes),
                    block_size=self.config.aio.block_size,
                    queue_depth=self.config.aio.queue_depth,
                    threads=self.config.aio.threads,
                    pin=off.pin_memory and self.device.type == "cuda",
                )
                # A bound method of the context, not of self: the finalizer must not keep
                # the engine alive. It runs at garbage collection or interpreter exit.
                self._finalizer = weakref.finalize(self, self.nvme.close)
            extra: dict[str, Any] = {}
            if off.param_tier == "nvme":
                keys = [((i, "param"), lay.shard_numel, self.dtype) for i, (_, lay, _) in enumerate(planned)]
                extra = {"nvme": self.nvme, "shards": keys}
            self.param_tier = make_param_tier(off.param_tier, self.device, off.pin_memory, **extra)
            if off.optimizer_tier == "nvme":
                sizes = [
                    (layout.shard_numel, layout.shard_optimized_numel(self.rank))
                    for _, layout, _ in planned
                ]
                self.optimizer_states = NVMeOptimizerStates(self.nvme, sizes, mdtype)
        except (OSError, ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
            error = exc
        if error is not None and self._finalizer is not None:
            self._finalizer()  # delete what this rank created
        if uses_nvme:
            self._agree_on(error)
        elif error is not None:
            raise error

    def _check_nvme(self, planned: list, mdtype: torch.dtype, state_layout: Any) -> None:
        """What NVMe tiers need of the machine, checked before anything is created."""
        from offload.storage.swap import check_free_space, check_swap_dir, stale_swap_bytes, swap_bytes_needed

        off = self.config.offload
        check_swap_dir(off.nvme_path)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        m_itemsize = torch.empty((), dtype=mdtype).element_size()
        param_sizes, optim_sizes, worst = [], [], (0, "", 0, 0)
        for plan, layout, _ in planned:
            shard = align_up(layout.shard_numel * itemsize) if off.param_tier == "nvme" else 0
            state = 0
            if shard:
                param_sizes.append(shard)
            if off.optimizer_tier == "nvme":
                state = state_layout(
                    layout.shard_numel, layout.shard_optimized_numel(self.rank), m_itemsize
                ).nbytes
                optim_sizes.append(state)
            # One unit's pinned working set (docs/nvme.md): during the step its state and
            # its new parameter shard share one buffer; a fetch, or a store by copy, needs
            # the shard alone.
            need = state + shard
            if need > worst[0]:
                worst = (need, plan.name or "<root>", state, shard)
        budget = int(off.pinned_budget_bytes)
        if worst[0] > budget:
            need, name, state, lowp = worst
            raise ValueError(
                f"offload.pinned_budget_bytes={budget} is too small for one unit: unit {name!r} "
                f"needs {need} bytes of pinned staging ({state} bytes of optimizer state + "
                f"{lowp} bytes of parameter shard); raise offload.pinned_budget_bytes to at "
                f"least {need} ({3 * need} lets the optimizer pipeline overlap read, update "
                "and write), or use smaller units (config.unit_modules)"
            )
        total = swap_bytes_needed([param_sizes, optim_sizes])
        # Every rank of this node puts its files on the same disk: check for all of them
        # (shards are equal-sized across ranks), before any rank preallocates. Ranks on
        # other nodes use their own disks. Stale files of a crashed run count as free:
        # opening the swap directory deletes them.
        local = self.pg.local_world_size
        check_free_space(
            off.nvme_path, total * local,
            f"the swap files of {local} rank(s) on this node ({total} bytes each: parameters "
            f"{sum(param_sizes)}, optimizer states {sum(optim_sizes)})",
            reclaimable_bytes=stale_swap_bytes(off.nvme_path),
        )

    def _agree_on(self, error: Optional[BaseException]) -> None:
        """Raise `error` on this rank, and an error naming the failure on every other rank."""
        if self.world_size > 1:
            flag = torch.tensor([0.0 if error is None else float(self.rank + 1)])
            failed = int(self._all_reduce(flag, "max").item())
            if error is None and failed:
                raise RuntimeError(
                    f"rank {failed - 1} could not set up its NVMe tier (see its error); "
                    "this rank stops with it"
                )
        if error is not None:
            raise error

    def _build_units(self, planned: list[tuple[UnitPlan, Any, list[ParamRecord]]]) -> None:
        from offload.units.materialize import materialize_values  # meta-built models (offload.init)
        from offload.storage.optim_state import HostOptimizerStates

        self.units: list[FlatUnit] = []
        self.states: list[UnitOptimizerState] = []
        self._records: list[list[ParamRecord]] = []
        cpu = torch.device("cpu")
        on_nvme = self.optimizer_states is not None
        # fp32 compute on the CPU: the parameter shard and the fp32 master are the same
        # bytes, so the optimizer updates the parameters in place and nothing is copied.
        alias_master = (
            self.dtype == torch.float32
            and self.param_tier.kind != "nvme"
            and self.param_tier.device == cpu
            and not on_nvme
        )
        mdtype = moments_dtype(self.config.optimizer.moments_dtype)
        self._transient_grads = transient_grad_shards(self.config, self.device.type == "cuda")
        for index, (plan, layout, records) in enumerate(planned):
            shard_numel = layout.shard_numel
            # On NVMe the master exists in host memory only while the unit is initialized
            # (allocated on its first value, written out and dropped when complete).
            master = None if on_nvme else host_state_zeros(shard_numel, torch.float32)
            key = (index, "param")
            if alias_master:
                self.param_tier.adopt(key, master)
            unit = FlatUnit(
                index,
                plan.name,
                layout,
                self.param_tier,
                self.dtype,
                self.device,
                self.pg,
                [r.param.requires_grad for r in records],
            )
            trainable = any(r.param.requires_grad for r in records)
            n_opt = layout.shard_optimized_numel(self.rank)
            grad_numel = shard_numel if trainable else 0
            if self._transient_grads:
                # Sized but holding no memory until its unit's reduce-scatter (and again none
                # after the unit's update during backward): see transient_grad_shards.
                grad = torch.empty(grad_numel, dtype=torch.float32)
                _release(grad)
            else:
                # pinned on a GPU run: the reduce-scattered shard comes down by DMA
                grad = torch.zeros(grad_numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")
            state = UnitOptimizerState(
                unit=unit,
                master=master,
                grad=grad,
                exp_avg=None if on_nvme else host_state_zeros(n_opt, mdtype),
                exp_avg_sq=None if on_nvme else host_state_zeros(n_opt, mdtype),
                slot_steps=[0] * len(layout.slots),
                slot_has_grad=[False] * len(layout.slots),
                n_optimized=n_opt,
            )
            self.units.append(unit)
            self.states.append(state)
            self._records.append(records)
        if self.optimizer_states is None:
            self.optimizer_states = HostOptimizerStates(
                self.states, staging=None if self.nvme is None else self.nvme.staging
            )
        # Fill the masters from the model's values (or replay the init of a meta-built
        # model, one module at a time); as soon as a unit has all its values, write its
        # low-precision shard (and, on NVMe, its state; then drop the host master).
        slot_of = {
            id(rec.param): (ui, si)
            for ui, recs in enumerate(self._records)
            for si, rec in enumerate(recs)
        }
        missing = [len(recs) for recs in self._records]
        finished: set[int] = set()
        for pid, value in materialize_values(self.module, self._records, slot_of):
            ui, si = slot_of[pid]
            self._write_master_slot(ui, si, value)
            missing[ui] -= 1
            if missing[ui] == 0:
                self._finish_unit(ui)
                finished.add(ui)
        for ui in range(len(self.units)):
            if ui not in finished:
                self._finish_unit(ui)  # a unit without parameters
        for ui, unit in enumerate(self.units):
            for rec, p in zip(self._records[ui], unit.params):
                for owner, attr in rec.owners:
                    owner._parameters[attr] = p
            if not unit.aliased:
                unit.free()
        # The model's original parameters are now referenced by nothing of ours: their
        # memory goes back as soon as the caller drops its own references.
        del self._records

    def _finish_unit(self, ui: int) -> None:
        st = self.states[ui]
        if st.master is None:
            st.master = torch.zeros(st.unit.layout.shard_numel, dtype=torch.float32)
        self._publish_shard(ui, st.master)
        if self.optimizer_states.kind == "nvme":
            self.optimizer_states.initialize(ui, st.master)
            st.master = None

    def _write_master_slot(
        self, ui: int, si: int, value: torch.Tensor, master: Optional[torch.Tensor] = None
    ) -> None:
        layout = self.units[ui].layout
        slot = layout.slots[si]
        if tuple(value.shape) != slot.shape:
            raise ValueError(
                f"parameter {slot.name!r}: got shape {tuple(value.shape)}, expected {slot.shape}"
            )
        part = layout.slot_in_shard(slot, self.rank)
        if part is None:
            return
        p_off, s_off, n = part
        if master is None:
            st = self.states[ui]
            if st.master is None:  # NVMe: this unit's first value during initialize
                st.master = torch.zeros(layout.shard_numel, dtype=torch.float32)
            master = st.master
        src = value.detach().reshape(-1)[p_off : p_off + n]
        master[s_off : s_off + n].copy_(src)

    def _publish_shard(self, ui: int, master: torch.Tensor) -> None:
        """Write unit ui's parameter shard (compute dtype, its tier) from its fp32 master."""
        unit = self.units[ui]
        shard = self.param_tier.view(unit.key)
        if shard is not None and shard.data_ptr() == master.data_ptr():
            return
        wait(self.param_tier.store(unit.key, master.to(self.dtype)))
        if unit.aliased:
            return
        if unit.state is UnitState.GATHERED:
            unit.free()  # re-gathered from the new shard on next use

    def _swap_buffers(self) -> None:
        """Buffers are not sharded: each rank keeps them whole on the compute device, cast
        to the compute dtype when floating (as `model.to(dtype)` would)."""
        self._buffer_dtypes: dict[int, torch.dtype] = {}
        new_of: dict[int, torch.Tensor] = {}
        for m in self.module.modules():
            for name, b in list(m._buffers.items()):
                if b is None:
                    continue
                if id(b) not in new_of:
                    if b.is_meta:
                        raise ValueError(
                            f"buffer {name!r} of {type(m).__name__} is still on the meta device; "
                            "give the module a reset_parameters() that re-creates it, or build "
                            "the model outside offload.init"
                        )
                    dtype = self.dtype if b.is_floating_point() else b.dtype
                    nb = b.detach().to(device=self.device, dtype=dtype)
                    new_of[id(b)] = nb
                    self._buffer_dtypes[id(nb)] = b.dtype
                m._buffers[name] = new_of[id(b)]

    def _index_state_dict(self) -> None:
        """For each key of `model.state_dict()`: which slot or buffer holds its value."""
        where: dict[int, tuple[int, int]] = {}
        for ui, unit in enumerate(self.units):
            for si, p in enumerate(unit.params):
                where[id(p)] = (ui, si)
        self._sd_index: list[tuple[str, Any]] = []
        self._first_key: dict[tuple[int, int], str] = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) in where:
                loc = where[id(value)]
                self._first_key.setdefault(loc, key)
                self._sd_index.append((key, ("param", loc)))
            elif isinstance(value, torch.Tensor):
                self._sd_index.append((key, ("buffer", value)))
            else:
                self._sd_index.append((key, ("other", value)))

    def _build_scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.optimizer)
            if getattr(lr_scheduler, "optimizer", None) is not self.optimizer:
                raise TypeError(
                    "lr_scheduler must be a callable taking engine.optimizer (e.g. "
                    "lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)); a scheduler built "
                    "on another optimizer would not drive the engine's learning rate"
                )
            return lr_scheduler
        if self.config.scheduler is None:
            return None
        try:
            from offload.optim.lr_schedules import build_scheduler
        except ImportError as exc:
            raise NotImplementedError(
                f"config.scheduler={self.config.scheduler.type!r} needs offload.optim.lr_schedules, "
                "which this build lacks; pass lr_scheduler= instead"
            ) from exc
        return build_scheduler(self.optimizer, self.config.scheduler)

    # -- hooks -----------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        for unit in self.units:
            module = self.module if unit.index == ROOT else _module_by_name(self.module, unit.name)
            self._hooks.append(
                module.register_forward_pre_hook(
                    bind(self._pre_forward, unit), with_kwargs=True, prepend=True
                )
            )
            self._hooks.append(
                module.register_forward_hook(bind(self._post_forward, unit), always_call=False)
            )
        weakref.finalize(self, remove_hooks, self._hooks)  # [Note: weak hooks]

    def _pre_forward(self, unit: FlatUnit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if unit.index == ROOT and not self._in_backward:
            self._check_ready("the model's forward")
            args, kwargs = self._cast_inputs(args, kwargs)
            self._begin_iteration()
        self._use(unit, "r" if self._in_backward else "f")
        track = self._tracks[unit.index]
        if self._in_backward and (track.in_backward or track.n_forward > 0):
            # Activation-checkpoint recomputation (non-reentrant): the original forward's
            # trigger still stands and will fire; the recomputed graph is never
            # back-propagated, so a trigger on it would never fire. (Re-entrant
            # recomputation finds n_forward == 0: its original forward ran without grad.)
            return args, kwargs
        if torch.is_grad_enabled() and unit.index != ROOT:
            track.pending = True
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                outs = _PostBackward.apply(bind0(self._post_backward, unit), *[flat[i] for i in idx])
                for i, t in zip(idx, outs):
                    flat[i] = t
                track.n_forward += 1
                args, kwargs = tree_unflatten(flat, spec)
        elif torch.is_grad_enabled():
            track.pending = True
        return args, kwargs

    def _post_forward(self, unit: FlatUnit, module: nn.Module, args: Any, output: Any) -> Any:
        if self._in_backward:
            return None  # recomputation: stays gathered until the unit's post-backward
        if self.timeline.enabled:
            self.timeline.add(f"fwd {unit.name or '<root>'}", "compute", "compute",
                              self._compute_t0[unit.index], now(), unit.index)
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, bind(self._pre_backward, unit), mode="any"
            )
        if unit.index != ROOT:
            if not (tensors and self.schedule.keep_after_forward(unit.index)):
                unit.free()  # else kept: the trace says its backward comes soon
                if self.schedule.following:
                    self._prefetch_ahead()  # it may be the next one needed
                    self._gather_next()
        elif not tensors:
            # A forward that backward will never visit (eval, no_grad): release everything.
            self._tracks[ROOT].pending = False
            unit.free()
        return None

    def _pre_backward(self, unit: FlatUnit, grad: Any) -> None:
        if not self._in_backward:
            self._in_backward = True
            # Runs when this backward pass finishes, inside the autograd engine.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._start_backward()
        self._use(unit, "b")
        self._tracks[unit.index].in_backward = True
        if self._opt_in_backward and self.optimizer_states.kind == "nvme":
            # This unit's state, and the next two's, are read while its backward computes
            # (as far as the pinned pool has room without waiting).
            self.optimizer.prefetch_units([unit.index] + self.schedule.next_uses("b", 2))

    def _post_backward(self, unit: FlatUnit) -> None:
        track = self._tracks[unit.index]
        track.n_post_backward += 1
        if track.n_post_backward >= track.n_forward:
            self._reduce(unit)

    def _reduce(self, unit: FlatUnit) -> None:
        """Reduce-scatter the unit's gradients into its host shard and free it. With more
        than one rank the collective is only issued here and completed at the next unit's
        reduce (or at the end of backward), so it runs under the backward of the unit
        before; then, with the optimizer in backward, the unit is updated."""
        st = self.states[unit.index]
        t0 = now()
        if st.grad.numel():
            if unit.index in self._updated:
                raise RuntimeError(
                    f"unit {unit.name or '<root>'} received gradients after its optimizer update "
                    "ran during backward (two backward passes before engine.step() at an "
                    "accumulation boundary?); set prefetch.optimizer_in_backward=false for such "
                    "loops, or call engine.step() after each engine.backward()"
                )
            if st.grad.untyped_storage().nbytes() == 0:  # a transient shard: bytes now
                _acquire(st.grad, unit.layout, self.rank, whole=self.world_size > 1 or st.grad_valid)
            red = unit.start_reduce_scatter(st.grad, accumulate=st.grad_valid)
            st.grad_valid = True
            st.slot_has_grad = [a or b for a, b in zip(st.slot_has_grad, red.have)]
            self._reduces.append((unit, red, t0))
        t1 = now()
        tl = self.timeline
        tl.count("collective", t1 - t0)
        if tl.enabled:
            name = unit.name or "<root>"
            if self._tracks[unit.index].in_backward:
                tl.add(f"bwd {name}", "compute", "compute", self._compute_t0[unit.index], t0, unit.index)
            tl.add(f"reduce-issue {name}", "reduce", "compute", t0, t1, unit.index)
        self._tracks[unit.index] = _Track()
        if unit.index != ROOT:
            unit.free()
        self._complete_reduces(keep=1 if self.world_size > 1 else 0)

    def _complete_reduces(self, keep: int) -> None:
        """Complete the reduce-scatters in flight but the newest `keep`, oldest first (every
        rank completes them at the same points), updating each unit when the optimizer runs
        in backward."""
        while len(self._reduces) > keep:
            unit, red, issued = self._reduces.pop(0)
            t0 = now()
            red.wait()
            t1 = now()
            self.timeline.count("collective", t1 - t0)
            self.timeline.add(f"reduce {unit.name or '<root>'}", "reduce", "comm", issued, t1, unit.index)
            if self._opt_in_backward:
                self.prefetcher.drop(unit.index)
                self._update_in_backward(unit)

    # -- prefetch, optimizer in backward (offload/runtime/schedule.py, docs/prefetch.md) ----------------

    def _begin_iteration(self) -> None:
        """A forward of the root outside backward: a new iteration of the schedule."""
        if torch.is_grad_enabled():
            self.timeline.begin_step(self.global_steps + self.skipped_steps)
        self.schedule.begin((torch.is_grad_enabled(), self.module.training))

    def _use(self, unit: FlatUnit, phase: str) -> None:
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

    def _prefetch_next_iteration(self) -> None:
        """Between iterations (after a step, or between micro-batches): start fetching the
        first units the next forward will need, the root first."""
        self.prefetcher.start_in_order(self.schedule.next_iteration())

    def _prefetch_ahead(self) -> None:
        """Start fetching the units the trace needs next, within the prefetch budget."""
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
                entry.drop()  # copied into the unit's slot of `full` before the gather
        self.timeline.count("collective", t1 - t0)
        if issued:
            self._gather_issued[u] = t0

    def _gather(self, unit: FlatUnit) -> None:
        if unit.is_gathered:
            return
        tl = self.timeline
        if unit.gathering:  # issued ahead by _gather_next: wait for it
            t0 = now()
            unit.gather()
            t1 = now()
            tl.count("collective", t1 - t0)
            issued = self._gather_issued.pop(unit.index, t0)
            tl.add(f"gather {unit.name or '<root>'}", "gather", "comm", issued, t1, unit.index, ahead=True)
            return
        entry, local, filled = self._local_shard(unit)
        try:
            t1 = now()
            unit.gather(local=local, filled=filled)
            t2 = now()
        finally:
            if local is not None:
                entry.drop()  # the staging buffer goes back once copied into `full`
        tl.count("collective", t2 - t1)
        tl.add(f"gather {unit.name or '<root>'}", "gather", "compute", t1, t2, unit.index)

    def _local_shard(self, unit: FlatUnit) -> tuple[Any, Optional[torch.Tensor], bool]:
        """This rank's shard of `unit`, for its gather: the prefetcher's entry (or one
        fetched now), waited for. Returns (entry, local, filled): `local` is the shard in a
        pooled host buffer (the caller drops the entry once it is copied), `filled` says a
        CUDA copy already put it in the unit's slot; (None, None, False) when the tier's
        shard is gathered from where it lives. Counts the wait and records the spans."""
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
        if filled:
            tl.count("copy_wait", t1 - t0)  # NVMe waits are in io_wait already
        if tl.enabled:
            kind = entry.label
            name = unit.name or "<root>"
            tl.add(f"{kind} {name}", kind, "io", entry.started, entry.done_at or t1, unit.index, ahead=ahead)
            if t1 - t0 > 1e-5:
                tl.add(f"wait {name}", "wait", "compute", t0, t1, unit.index)
        return entry, local, filled

    def _start_backward(self) -> None:
        """Decide, once per backward pass, whether units update as their gradients finish."""
        self._pass_updates = 0
        if self._updated:
            raise RuntimeError(
                "a second backward pass before engine.step(), after the first one already ran "
                "optimizer updates (prefetch.optimizer_in_backward); call engine.step() after "
                "each engine.backward(), or set prefetch.optimizer_in_backward=false"
            )
        self._opt_in_backward = (
            self.config.prefetch.optimizer_in_backward
            and self._nonfinite_loss is None  # this step will be skipped
            and float(self.config.gradient_clipping) <= 0.0
            and self.dtype != torch.float16
            and self.scaler.scale == 1.0
            and self.is_gradient_accumulation_boundary()
        )
        if self._opt_in_backward:
            # The last units updated are the next forward's first: keep their new shards.
            self.prefetcher.write_through = frozenset(self.schedule.next_iteration())

    def _hyperparameters(self) -> list[tuple]:
        return [
            (float(g["lr"]), tuple(g["betas"]), float(g["eps"]), float(g["weight_decay"]))
            for g in self.optimizer.param_groups
        ]

    def _update_in_backward(self, unit: FlatUnit) -> None:
        st = self.states[unit.index]
        tl = self.timeline
        if self.world_size > 1:
            # Which parameters got a gradient on any rank (the step's _sync_has_grad, for
            # this unit now): every rank reduces units in the same order, so this matches.
            t0 = now()
            flags = torch.tensor([float(h) for h in st.slot_has_grad], dtype=torch.float32)
            flags = self._all_reduce(flags, "max")
            st.slot_has_grad = [bool(v) for v in flags.tolist()]
            tl.count("collective", now() - t0)
        if self._hyper_at_backward is None:
            self._hyper_at_backward = self._hyperparameters()
        io0 = self.nvme.stats.wait_s if self.nvme is not None else 0.0
        t0 = now()
        updated = self.optimizer.update_unit(
            unit.index, grad_scale=1.0 / (self.scaler.scale * self.gradient_accumulation_steps)
        )
        t1 = now()
        self._updated.add(unit.index)
        self._pass_updates += 1
        if self._transient_grads:
            _release(st.grad)  # consumed; re-acquired by the next step's reduce-scatter
        tl.count("optimizer", t1 - t0)
        tl.count("optimizer_in_backward", t1 - t0)
        if self.nvme is not None:
            tl.count("optimizer_io", self.nvme.stats.wait_s - io0)
        if tl.current is not None:
            tl.current.optimizer_in_backward_units += int(updated)
        tl.add(f"adam {unit.name or '<root>'}", "optimizer", "optimizer", t0, t1, unit.index)

    def step_stats(self) -> Optional[dict[str, Any]]:
        """The last completed optimizer step as the engine measured it (offload.runtime.timeline:
        step time, stall time split into fetch waits / collectives / optimizer I/O,
        optimizer time, how many units updated during backward, prefetched vs on-demand
        fetches, whether the step left its trace), or None before the first step."""
        last = self.timeline.last
        return None if last is None else last.as_dict()

    def _finish_backward(self) -> None:
        """End of a backward pass: reduce every unit still pending, in one fixed order on
        every rank (collectives must match), then free the root. Idempotent."""
        if not self._in_backward and not any(t.pending for t in self._tracks):
            return
        self.schedule.end()
        self.prefetcher.drop(keep_fresh=True)
        for unit in reversed(self.units):
            if self._tracks[unit.index].pending:
                self._reduce(unit)
            elif unit.index != ROOT:
                unit.free()
            self._tracks[unit.index] = _Track()
        self._complete_reduces(keep=0)
        self.units[ROOT].free()
        self._in_backward = False
        if not self.is_gradient_accumulation_boundary():
            self._prefetch_next_iteration()  # the next micro-batch sees the same shards

    def _abort_backward(self) -> None:
        self.schedule.end()
        self.prefetcher.drop()
        for _, red, _ in self._reduces:  # issued collectives complete on every rank
            try:
                red.wait()
            except Exception:  # noqa: BLE001 - the backward's own error is what is raised
                pass
        self._reduces = []
        self._opt_in_backward = False
        for unit in self.units:
            for p in unit.params:
                p.grad = None
            unit.free()
        self._tracks = [_Track() for _ in self.units]
        self._in_backward = False

    def _cast_inputs(self, args: Any, kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        changed = False
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                dtype = self.dtype if t.is_floating_point() else t.dtype
                if t.device != self.device or t.dtype != dtype:
                    flat[i] = t.to(device=self.device, dtype=dtype)
                    changed = True
        return tree_unflatten(flat, spec) if changed else (args, kwargs)

    # -- the user's loop -------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`loss.backward()`, with the fp16 loss scale applied. Gradients accumulate into the
        shards until `step()` reaches an accumulation boundary; the engine divides them by
        gradient_accumulation_steps there (DeepSpeed's default), so pass the plain loss."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        self._check_ready("engine.backward")
        if self._loss_is_nonfinite(loss):
            return
        if self.scaler.scale != 1.0:
            loss = loss.float() * self.scaler.scale
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException as exc:
            # A backward that died half-way must not leave units looking "in backward" (the
            # next forward would keep them gathered): drop its partial state, keep the
            # gradients of earlier micro-batches. If it had already updated units
            # (optimizer in backward), the step is part-applied: the engine fails.
            partial = self._in_backward and self._pass_updates > 0
            self._abort_backward()
            if partial:
                self._fail(exc)
            raise
        self._finish_backward()

    def _loss_is_nonfinite(self, loss: torch.Tensor) -> bool:
        """config.nonfinite_loss (bf16/fp32): True when any rank's loss is NaN/inf and this
        micro-batch must run no backward (every rank agrees, so collectives stay matched)."""
        mode = self.config.nonfinite_loss
        if mode == "off" or self.dtype == torch.float16:
            return False
        value = float(loss.detach().float())
        flag = torch.tensor([0.0 if math.isfinite(value) else 1.0])
        if self.world_size > 1:
            flag = self._all_reduce(flag, "max")
        if not flag.item():
            return False
        where = f"loss {value}" if not math.isfinite(value) else "a non-finite loss on another rank"
        self._abort_backward()  # the forward's gathered units and pending reduces go
        if mode == "raise":
            raise FloatingPointError(
                f"{where} at optimizer step {self.global_steps + self.skipped_steps}, micro-batch "
                f"{self.micro_steps}: nothing was applied; skip this batch and go on, lower the "
                "learning rate, or set nonfinite_loss='skip' to skip such steps"
            )
        self._nonfinite_loss = value
        return True

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Advance one micro-batch; at an accumulation boundary apply the optimizer step.
        If the optimizer step fails (an I/O error, say), its error is raised here and the
        engine enters EngineState.FAILED: load a checkpoint to go on."""
        self._check_ready("engine.step")
        self._finish_backward()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        try:
            nonfinite = self._optimizer_step()
        except BaseException as exc:
            self._fail(exc)
            raise
        if nonfinite is not None:
            raise nonfinite  # the step was skipped whole: the engine stays consistent

    def _fail(self, exc: BaseException) -> None:
        """Enter EngineState.FAILED after `exc` interrupted an update part-way."""
        self.state = EngineState.FAILED
        self._failure = exc
        self._updated = set()
        self._opt_in_backward = False
        self.prefetcher.drop()

    def _check_ready(self, what: str) -> None:
        if self.state is EngineState.READY:
            # A write that failed after its step returned (it surfaced in a later forward's
            # read, say) lost a shard just the same.
            lost = self._lost_write()
            if lost is not None:
                self._fail(lost)
        if self.state is EngineState.FAILED:
            exc = self._failure
            raise RuntimeError(
                f"{what}: an earlier optimizer step failed part-way ({type(exc).__name__}: {exc}), "
                "so the parameters and optimizer state are inconsistent (some units were "
                "updated, others not). Fix the cause, then engine.load_checkpoint(...) restores "
                "a consistent state and training goes on; or engine.close()"
            ) from exc

    def _lost_write(self) -> Optional[BaseException]:
        """The error of a write whose failure has been seen (its slot is lost), or None."""
        return self.param_tier.write_failure() or self.optimizer_states.write_failure()

    def _recover(self) -> None:
        """Before a load restores the state of a failed engine: let every write still in
        flight finish and drop the failures it already reported."""
        for owner in (self.param_tier, self.optimizer_states):
            owner.settle()
        if self.nvme is not None:
            try:
                self.nvme.staging.drain()
            except OSError:
                pass  # already raised by the step that failed
        for unit in self.units:
            unit.free()
        self._tracks = [_Track() for _ in self.units]
        self._in_backward = False

    @torch.no_grad()
    def _optimizer_step(self) -> Optional[FloatingPointError]:
        """Apply (or skip) the optimizer step; returns the error to raise once the step's
        bookkeeping is done (nonfinite_loss='raise' and a non-finite gradient norm)."""
        # The CPU Adam rewrites host shards that asynchronous host-to-device copies of this
        # step's gathers read from: those copies must have landed first.
        self._sync_device()
        self.prefetcher.drop(keep_fresh=True)  # shards are about to change (fresh: already did)
        self.prefetcher.write_through = frozenset(self.schedule.next_iteration())
        for unit in self.units:
            unit.free()  # anything still gathered (kept by a forward without backward) goes stale
        skip = self._updated
        # NVMe: the first units' state reads run under the overflow check and the norm.
        self.optimizer.prefetch(skip)
        self._sync_has_grad()
        unscale = 1.0 / (self.scaler.scale * self.gradient_accumulation_steps)
        overflow = False
        if self.dtype == torch.float16:
            flag = torch.zeros(1, dtype=torch.float32)
            for st in self.states:
                g = st.grad[: st.optimized_numel] if st.grad_valid else st.grad[:0]
                if g.numel() and not torch.isfinite(g).all():
                    flag.fill_(1.0)
                    break
            overflow = bool(self._all_reduce(flag, "max").item())
        if self._nonfinite_loss is not None:
            logger.warning(
                "optimizer step %d skipped: a micro-batch's loss was %s (nonfinite_loss='skip'); "
                "%d step(s) skipped so far", self.global_steps + self.skipped_steps,
                self._nonfinite_loss, self.skipped_steps + 1,
            )
            overflow = True
            self._nonfinite_loss = None
        clip = float(self.config.gradient_clipping)
        grad_scale: Optional[float] = unscale
        nonfinite: Optional[FloatingPointError] = None
        if not overflow and clip > 0.0:
            sq = torch.zeros(1, dtype=torch.float64)
            for st in self.states:
                # A unit no micro-batch reached holds an earlier step's gradient: not this one's.
                g = st.grad[: st.optimized_numel] if st.grad_valid else st.grad[:0]
                if g.numel():
                    sq += torch.dot(g, g).double()
            total = math.sqrt(self._all_reduce(sq, "sum").item()) * unscale
            self.last_grad_norm = total
            if not math.isfinite(total) and self.config.nonfinite_loss != "off":
                # a finite loss with non-finite gradients (bf16/fp32): the same guard
                if self.config.nonfinite_loss == "raise":
                    nonfinite = FloatingPointError(
                        f"the gradient norm of optimizer step {self.global_steps + self.skipped_steps} "
                        f"is {total}: the step was skipped, nothing was applied; set "
                        "nonfinite_loss='skip' to skip such steps without raising"
                    )
                else:
                    logger.warning("optimizer step %d skipped: the gradient norm is %s (nonfinite_loss='skip')",
                                   self.global_steps + self.skipped_steps, total)
                overflow = True
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
            grad_scale = unscale * min(1.0, clip / (total + 1e-6))
        if overflow:
            grad_scale = None
            self.last_grad_norm = float("inf")
        tl = self.timeline
        io0 = self.nvme.stats.wait_s if self.nvme is not None else 0.0
        t0 = now()
        with tl.span("adam (step)", "optimizer", "optimizer"):
            self.optimizer.step(grad_scale=grad_scale, skip=skip)
        tl.count("optimizer", now() - t0)
        if self.nvme is not None:
            tl.count("optimizer_io", self.nvme.stats.wait_s - io0)
        self._check_hyperparameters()
        self._updated = set()
        self._opt_in_backward = False
        self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
        else:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self._prefetch_next_iteration()
        self.timeline.end_step()
        return nonfinite

    def _check_hyperparameters(self) -> None:
        """Units updated during backward used the hyperparameters of that moment: say so
        (once) if the user changed them between backward and step."""
        before, self._hyper_at_backward = self._hyper_at_backward, None
        if before is None or self._warned_hyper or before == self._hyperparameters():
            return
        self._warned_hyper = True
        import warnings

        warnings.warn(
            "optimizer hyperparameters (lr, betas, eps, weight_decay) changed between "
            "engine.backward() and engine.step(); with prefetch.optimizer_in_backward the units "
            "updated during backward used the earlier values. Set them before the forward "
            "(or before engine.backward()), or set prefetch.optimizer_in_backward=false",
            RuntimeWarning, stacklevel=3,
        )

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _sync_has_grad(self) -> None:
        """Agree across ranks on which parameters got a gradient this step (a parameter
        skipped on one rank but not another is updated everywhere with the average)."""
        if self.world_size == 1:
            return
        flags = torch.tensor(
            [float(h) for st in self.states for h in st.slot_has_grad], dtype=torch.float32
        )
        if flags.numel() == 0:
            return
        self._all_reduce(flags, "max")
        i = 0
        for st in self.states:
            n = len(st.slot_has_grad)
            st.slot_has_grad = [bool(v) for v in flags[i : i + n].tolist()]
            i += n

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size == 1:
            return t
        dev = _dist.collective_device(self.pg, self.device)
        x = t.to(dev)
        (_dist.all_reduce_max_ if op == "max" else _dist.all_reduce_sum_)(x, self.pg)
        return x.cpu()

    # -- conveniences torch users expect ----------------------------------------------------

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterable[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # -- weights in and out ------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """The consolidated fp32 weights, with exactly `model.state_dict()`'s keys (tied
        parameters under each of their names; buffers in their original dtype), on CPU.

        Every rank must call it (it gathers); with `rank0_only` the other ranks get {}.
        Units are gathered one at a time, so at most one unit's full fp32 copy exists
        beside the result: the same unit-by-unit path as checkpoint consolidation
        (`offload.checkpoint.full_weights`)."""
        from offload.checkpoint.full_weights import full_state_dict

        return full_state_dict(self, rank0_only)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load consolidated weights (as `full_state_dict` returns) into the shards. Every
        rank passes the full dict (e.g. each `torch.load`s it); each keeps its own slice.
        Optimizer moments are left as they are."""
        self._sync_device()  # see _optimizer_step: host shards are about to be rewritten
        keys = [k for k, _ in self._sd_index]
        if strict:
            missing = [k for k in keys if k not in state_dict]
            unexpected = [k for k in state_dict if k not in set(keys)]
            if missing or unexpected:
                raise KeyError(
                    f"state dict does not match the model: missing keys {missing[:10]}"
                    f"{'...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
                    f"{'...' if len(unexpected) > 10 else ''}"
                )
        per_unit: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for key, (kind, what) in self._sd_index:
            if key not in state_dict:
                continue
            value = state_dict[key]
            if kind == "param":
                ui, si = what
                if any(s == si for s, _ in per_unit.get(ui, ())):
                    continue
                per_unit.setdefault(ui, []).append((si, torch.as_tensor(value)))
            elif kind == "buffer":
                what.copy_(torch.as_tensor(value).to(what.dtype))
        for ui in range(len(self.units)):
            # One unit at a time: on NVMe its state is read, changed and written back.
            with self.optimizer_states.open(ui, write=ui in per_unit) as t:
                for si, value in per_unit.get(ui, ()):
                    self._write_master_slot(ui, si, value, master=t.master)
                self._publish_shard(ui, t.master)

    # -- checkpoints (offload/checkpoint, docs/checkpoint.md) ---------------------------------

    def save_checkpoint(
        self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None
    ) -> str:
        """Write a checkpoint to `save_dir/<tag>` (default tag `global_step<N>`) and point
        `save_dir/latest` at it once complete. Every rank calls it; each writes its own
        shards. `client_state` (e.g. the data-loader position) comes back from
        `load_checkpoint`. Returns the checkpoint's path."""
        from offload.checkpoint import save_checkpoint

        self._check_ready("engine.save_checkpoint")
        return save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(
        self, load_dir: str, tag: Optional[str] = None, *, copy_to_swap: Optional[bool] = None
    ) -> tuple[str, Any]:
        """Resume from `load_dir/<tag>` (default: the one `latest` names), also from a run
        with another world size. Every rank calls it. Returns (path, client_state).

        `copy_to_swap` (optimizer state on NVMe only): False reads each unit's state from
        the checkpoint's files until the unit's first update rewrites it to the swap file
        (the files are held open, so deleting the checkpoint afterwards is safe); True
        copies it all into the swap file during the load; None (default) reads in place when
        the checkpoint is on the swap directory's filesystem and copies otherwise (a
        checkpoint on slower shared storage should not be read during training). Either way
        every chunk's checksum is verified during the load. See docs/checkpoint.md."""
        from offload.checkpoint import load_checkpoint

        if self.state is EngineState.FAILED or self._lost_write() is not None:
            self._recover()
        out = load_checkpoint(self, load_dir, tag, copy_to_swap=copy_to_swap)
        # Every unit's parameters and state now come from the checkpoint: consistent again.
        self.state, self._failure = EngineState.READY, None
        self._updated = set()
        return out

    # -- accounting ---------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the engine holds right now, per tier: 'device' (compute-device memory:
        parameter shards on the device tier, gathered full buffers, buffers), 'host' (CPU
        memory: parameter shards on the host tier, fp32 master, gradient shards, Adam
        moments — with the optimizer on NVMe only the gradient shards), 'pinned' (the NVMe
        staging pool: every byte it holds, in use or idle; host memory too, page-locked on a
        GPU run), 'nvme' (swap files: parameter shards and optimizer states, page-rounded).
        On a CPU run 'device' and 'host' are both main memory, kept apart so the split is
        visible."""
        out = {"device": 0, "host": 0, "pinned": 0, "nvme": 0}
        counted: set[int] = set()

        def add(kind: str, t: torch.Tensor) -> None:
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in counted:
                return
            counted.add(s.data_ptr())
            out[kind] += s.nbytes()

        for st in self.states:
            add("host", st.grad)
        for t in self.optimizer_states.host_tensors():
            add("host", t)
        out["nvme"] += self.optimizer_states.bytes_on_disk()
        if self.param_tier.kind == "nvme":
            out["nvme"] += self.param_tier.bytes_allocated()
        for unit in self.units:
            shard = self.param_tier.view(unit.key)
            if shard is not None:
                add({"host": "host", "device": "device"}[self.param_tier.kind], shard)
            elif self.param_tier.kind != "nvme":  # not addressable, but in memory
                out[self.param_tier.kind] += unit.layout.shard_numel * unit.full.element_size()
            add("device", unit.full)
        for b in self.module.buffers():
            add("device", b)
        staging = self.optimizer._staging
        if staging is not None:
            add("host", staging)
        if self.nvme is not None:
            out["pinned"] = self.nvme.staging.pool.bytes_reserved
        return out

    def io_stats(self) -> dict[str, float]:
        """What the NVMe tiers moved since `initialize`: bytes read and written, and seconds
        the engine's thread waited for I/O (all zero without an NVMe tier)."""
        if self.nvme is None:
            return {"bytes_read": 0, "bytes_written": 0, "wait_s": 0.0}
        return self.nvme.stats.snapshot()

    def close(self) -> None:
        """Remove the hooks; finish every collective in flight; wait for NVMe writes, stop
        the I/O workers and delete this rank's swap files; destroy the process group if this
        engine started it. Idempotent; also what `with initialize(...) as engine:` does on
        exit."""
        LIVE_ENGINES.discard(self)
        remove_hooks(self._hooks)
        if released_parameters(self.module) and not getattr(self, "_closed_hook", None):
            # The parameter tier kept the weights (NVMe): the closed model has none. Say so
            # on its next forward instead of torch's setStorage error.
            self._closed_hook = self.module.register_forward_pre_hook(forward_of_a_closed_model)
        prefetcher = getattr(self, "prefetcher", None)  # absent when __init__ failed early
        if prefetcher is not None:
            prefetcher.drop()
            self._drain_collectives()
        if self._finalizer is not None:
            self._finalizer()  # NVMeContext.close, once
        if self.pg.started_here and dist.is_initialized():
            # Every rank leaves together: gloo aborts a process whose peer tears its
            # connections down while it is still tearing down its own. The barrier's work
            # holds the works before it: settle again before the group goes.
            barrier = torch.zeros(1)
            _dist.all_reduce_sum_(barrier, self.pg)
            _dist.settle_collectives()
            dist.destroy_process_group()

    def _drain_collectives(self) -> None:
        """Wait for every collective this engine issued asynchronously (the gathers issued
        ahead, e.g. for the next iteration's first units, and gradient reduce-scatters), then
        until gloo's threads let their tensors go ([Note: collective tensors at exit] in
        offload/units/collectives.py). Every rank issued the same collectives, so each wait
        completes."""
        for _, red, _ in self._reduces:
            red.wait()
        self._reduces = []
        for unit in self.units:
            unit.free()  # waits for a gather in flight
        _dist.settle_collectives()  # [Note: collective tensors at exit]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _release(t: torch.Tensor) -> None:
    """Give a tensor's memory back, keeping its size (a transient gradient shard)."""
    storage = t.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def _acquire(t: torch.Tensor, layout: Any, rank: int, whole: bool) -> None:
    """Memory for a released gradient shard again. At world size 1 the reduce writes every
    slot (a copy, or zeros for a parameter without gradient) but never the alignment gaps
    between slots, which must read as zeros: only those are zeroed. `whole`: zero it all."""
    t.untyped_storage().resize_(t.numel() * t.element_size())
    if whole:
        t.zero_()
        return
    lo, hi = layout.shard_range(rank)
    pos = lo
    for slot in sorted(layout.slots, key=lambda s: s.offset):
        if slot.offset > pos:
            t[pos - lo : min(slot.offset, hi) - lo].zero_()
        pos = max(pos, slot.end)
    if pos < hi:
        t[pos - lo :].zero_()


def _module_by_name(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)

