"""Building the sharded model: what `offload.initialize` does before training can start.

1. The model is cut into units (`offload.units.partition`) and each unit's flat layout is
   computed (pure arithmetic): the swap files are sized from these before anything is
   allocated.
2. The parameter tier and the optimizer-state store are made; for NVMe, the rank's swap
   directory, AIO handle and staging pool, after checking at the door that the machine can
   hold them (directory, free space, a pinned budget that holds one unit). Every rank
   learns whether any rank failed, so all raise together instead of some waiting in a
   collective.
3. Units, their gradient shards and optimizer state are allocated; the fp32 masters (and
   the frozen suffixes of the parameter shards: [Note: frozen parameters cost their shard
   only] in offload/units/layout.py) are filled from the model's values (or by replaying a
   meta-built model's init, one module at a time, `offload.units.materialize`), and each
   unit's low-precision shard is published as soon as it has all its values. The module's
   parameters become views into the units.
4. Buffers move to the compute device, keeping their dtype unless the config says
   otherwise (offload.runtime.buffers); every `state_dict()` key is indexed to the slot or
   buffer that holds its value.

`build` returns a `Built`; the Engine wires its collaborators from it.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

import offload.units.materialize as materialize
from offload.device_runtime import runtime
from offload.config.sections import Config
from offload.optim.grad_shard import GradShard
from offload.optim.kind import OptimizerKind
from offload.optim.kinds import OptimizerArg
from offload.optim.sharded import (
    UnitOptimizerState,
    host_state_zeros,
    resolve_param_groups,
    transient_grad_shards,
)
from offload.runtime.buffers import check_keep_in_fp32, place_buffers
from offload.runtime.schedule import bounded_by_model
from offload.runtime.view import Location, StateDictEntry
from offload.sizes import align_up
from offload.storage.nvme import NVMeContext
from offload.storage.pinned import pinned_empty
from offload.storage.optim_state import HostOptimizerStates, NVMeOptimizerStates, state_layout
from offload.storage.state_layout import StateSpec, param_align
from offload.storage.state_store import OptimizerStates
from offload.storage.tiers import Tier
from offload.storage.tier_kind import TierKind, make_param_tier
from offload.storage.placement import Placement, choose_placement, unit_bytes
from offload.storage.device_states import DeviceOptimizerStates
from offload.runtime.device_split import device_units
from offload.storage.split_states import SplitOptimizerStates
from offload.storage.split_tier import SplitTier
from offload.units.collectives import ProcessGroupInfo, all_reduce_host
from offload.units.full_buffers import FullBuffers
from offload.units.partition import ParamRecord, UnitPlan, describe_units, is_leaf_module, plan_units
from offload.units.shard import FROZEN_GROUP, PARAM_ALIGN_ELEMS, FlatUnit, UnitLayout, layout_unit

__all__ = ["Built", "build"]

Planned = list[tuple[UnitPlan, UnitLayout, list[ParamRecord]]]


@dataclass
class Built:
    """What `build` made; each piece is handed to the collaborator that owns it."""

    units: list[FlatUnit]
    states: list[UnitOptimizerState]
    param_tier: Tier
    optimizer_states: OptimizerStates
    nvme: Optional[NVMeContext]
    """The rank's `NVMeContext`, or None without an NVMe tier."""
    close_nvme: Optional[Callable[[], Any]]
    """Deletes the swap files and stops the I/O workers, once (a `weakref.finalize`: it also
    runs at garbage collection or interpreter exit); None without NVMe."""
    param_groups: list[dict[str, Any]]
    """torch-style groups over the units' parameters, for the optimizer."""
    decoupled_weight_decay: bool
    kind: OptimizerKind
    """The optimizer's kind (offload/optim/kind.py)."""
    transient_grads: bool
    """Gradient shards hold memory only between their reduce-scatter and their update."""
    state_dict_index: list[StateDictEntry]
    buffer_dtypes: dict[int, torch.dtype]
    placement: Placement
    """Per unit: whether its parameter shard and its optimizer state are on NVMe."""
    units_chosen: str
    """What the unit policy chose, in words (`describe_units`), for the initialize line."""


def build(
    owner: object,
    model: nn.Module,
    config: Config,
    pg: ProcessGroupInfo,
    device: torch.device,
    dtype: torch.dtype,
    optimizer: OptimizerArg,
) -> Built:
    """Shard `model` for training (see the module docstring). `owner` is the object whose
    garbage collection deletes the swap files (the Engine)."""
    materialize.materialize_buffers(model)  # a model built under offload.init: small, first
    # Before anything is allocated: a parameter the model wants in fp32 is refused here.
    keep_fp32 = check_keep_in_fp32(model, config.precision, dtype)
    plans = plan_units(model, config.unit_modules, config.leaf_modules)
    if pg.rank == 0:
        warn_one_big_unit(plans, config.unit_modules, config.leaf_modules)
    groups, group_of, kind = resolve_param_groups(model, config.optimizer, optimizer)
    specs = kind.specs(config.optimizer.moments_dtype)
    planned = _plan_layouts(plans, group_of, pg.world_size, param_align(specs, PARAM_ALIGN_ELEMS))
    tiers = _Tiers(owner, config, pg, device, dtype, planned, specs)
    try:
        units, states = _build_units(model, config, pg, device, dtype, planned, tiers, specs)
    except BaseException:
        if tiers.close_nvme is not None:
            tiers.close_nvme()  # no swap files left behind by a failed initialize
        raise
    buffer_dtypes = place_buffers(model, device, dtype, config.precision, keep_fp32)
    opt_groups = []
    for gi, g in enumerate(groups):
        params = [u.params[i] for u in units for i, s in enumerate(u.layout.slots) if s.group == gi]
        opt_groups.append({**g, "params": params})
    assert tiers.optimizer_states is not None, "_build_units sets the store"
    return Built(
        units=units, states=states, param_tier=tiers.param_tier,
        optimizer_states=tiers.optimizer_states, nvme=tiers.nvme, close_nvme=tiers.close_nvme,
        param_groups=opt_groups, decoupled_weight_decay=kind.decoupled, kind=kind,
        transient_grads=transient_grad_shards(config, runtime().has_streams(device)),
        state_dict_index=_index_state_dict(model, units), buffer_dtypes=buffer_dtypes,
        placement=tiers.placement, units_chosen=describe_units(plans),
    )


def warn_one_big_unit(plans: list[UnitPlan], unit_modules: Sequence[str], leaf_modules: Sequence[str] = ()) -> None:
    """Warn (logging and `warnings`) when one unit holds more than half of the parameters:
    a unit is gathered whole, so such a model pages little or nothing (a model without
    repeated blocks in an nn.ModuleList is one unit, the root). Not for a leaf module: the
    user asked for it whole."""
    sizes = [sum(r.param.numel() for r in plan.params) for plan in plans]
    total = sum(sizes)
    if not total:
        return
    big = max(range(len(plans)), key=sizes.__getitem__)
    if 2 * sizes[big] <= total or is_leaf_module(plans[big].module, leaf_modules):
        return
    name = plans[big].name or "the root (parameters outside every unit)"
    chosen = f"unit_modules {list(unit_modules)}" if unit_modules else "the default unit policy (the model's repeated blocks)"
    message = (
        f"one unit, {name}, holds {sizes[big]:,} of the model's {total:,} parameters "
        f"({100 * sizes[big] / total:.0f} %) under {chosen}: it is gathered whole on the "
        "compute device, so little of the model is paged. Set unit_modules to the class names "
        "of the model's repeated blocks (e.g. ['LlamaDecoderLayer']) to cut it finer")
    logging.getLogger("offload").warning(message)
    warnings.warn(message, UserWarning, stacklevel=5)  # the caller of offload.initialize


def _plan_layouts(plans: list[UnitPlan], group_of: dict[int, int], world_size: int,
                  align: int = PARAM_ALIGN_ELEMS) -> Planned:
    out = []
    for plan in plans:
        entries = []
        for rec in plan.params:
            g = group_of.get(id(rec.param), FROZEN_GROUP) if rec.param.requires_grad else FROZEN_GROUP
            entries.append((rec.name, tuple(rec.param.shape), g))
        layout = layout_unit(entries, world_size, param_align=align)
        by_name = {rec.name: rec for rec in plan.params}
        out.append((plan, layout, [by_name[s.name] for s in layout.slots]))
    return out


class _Tiers:
    """The parameter tier and the optimizer-state store, made together because on NVMe they
    share one context; every rank agrees on success before any goes on. With an NVMe tier
    and host memory to spare (`offload.ram_budget_bytes` / `ram_fraction`), some units stay
    in RAM (`placement`: offload/storage/placement.py)."""

    def __init__(self, owner: object, config: Config, pg: ProcessGroupInfo, device: torch.device,
                 dtype: torch.dtype, planned: Planned, specs: tuple[StateSpec, ...]) -> None:
        off = config.offload
        self.placement = unit_placement(config, pg, dtype, specs, [lay for _, lay, _ in planned],
                                        [plan.name for plan, _, _ in planned])
        uses_nvme = self.placement.any_nvme
        self.nvme: Optional[NVMeContext] = None
        self.close_nvme: Optional[Callable[[], Any]] = None
        self.nvme_states: Optional[NVMeOptimizerStates] = None
        """The NVMe store when any unit's state is on NVMe."""
        self.optimizer_states: Optional[OptimizerStates] = None
        """The store the optimizer uses: set by `_build_units` (host, NVMe or split)."""
        error: Optional[BaseException] = None
        try:
            if uses_nvme:
                _check_nvme(config, pg, dtype, specs, planned, self.placement)
                self.nvme = NVMeContext(
                    swap_path(config), pg.world.rank,  # HSDP: replicas share a shard rank
                    budget_bytes=int(off.pinned_budget_bytes),
                    block_size=config.aio.block_size,
                    queue_depth=config.aio.queue_depth,
                    threads=config.aio.threads,
                    pin=off.pin_memory and device.type == "cuda",
                )
                # A bound method of the context, not of the owner: the finalizer must not
                # keep the engine alive. It runs at garbage collection or interpreter exit.
                self.close_nvme = weakref.finalize(owner, self.nvme.close)
            self.param_tier = self._param_tier(off, device, dtype, planned)
            if any(self.placement.state_on_nvme):
                sizes = [(lay.shard_master_numel(pg.rank), lay.shard_optimized_numel(pg.rank))
                         if on else (0, 0)
                         for (_, lay, _), on in zip(planned, self.placement.state_on_nvme)]
                assert self.nvme is not None, "placement puts state on NVMe only with an NVMe tier"
                self.nvme_states = NVMeOptimizerStates(self.nvme, sizes, specs)
        except (OSError, ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
            error = exc
        if error is not None and self.close_nvme is not None:
            self.close_nvme()  # delete what this rank created
        if uses_nvme:
            _agree_on(error, pg, device)
        elif error is not None:
            raise error

    def _param_tier(self, off: Any, device: torch.device, dtype: torch.dtype, planned: Planned) -> Any:
        """One tier per kind the placement uses; a split tier over RAM and disk when it uses two."""
        kinds = self.placement.param
        in_memory = sorted({k for k in kinds if not k.spec.on_disk}, key=lambda k: k.value)
        ram: Optional[Tier] = None
        if len(in_memory) == 1:
            ram = make_param_tier(in_memory[0], device, off.pin_memory)
        elif in_memory:  # device units' shards beside their state, the others' in host memory
            on_device = [(i, "param") for i, k in enumerate(kinds) if k is TierKind.DEVICE]
            ram = SplitTier(make_param_tier(TierKind.CPU, device, off.pin_memory),
                            make_param_tier(TierKind.DEVICE, device, off.pin_memory), on_device)
        if not any(k.spec.on_disk for k in kinds):
            assert ram is not None, "a unit's shard is in memory or on disk"
            return ram
        keys = [((i, "param"), lay.shard_numel, dtype)
                for i, (_, lay, _) in enumerate(planned) if kinds[i].spec.on_disk]
        disk = make_param_tier(TierKind.of(off.param_tier), device, off.pin_memory, nvme=self.nvme, shards=keys)
        if ram is None:
            return disk
        return SplitTier(ram, disk, [k for k, _, _ in keys])

    def unit_tier(self, index: int) -> Any:
        """The tier unit `index`'s parameter shard lives in (a part of a split tier)."""
        tier = self.param_tier
        while isinstance(tier, SplitTier):  # a split of RAM and disk, whose RAM may be split too
            tier = tier.tier_of((index, "param"))
        return tier


def unit_placement(config: Config, pg: ProcessGroupInfo, dtype: torch.dtype,
                   specs: tuple[StateSpec, ...], layouts: Sequence[UnitLayout],
                   names: Sequence[str] = ()) -> Placement:
    """Which units' parameter shards and optimizer states are on NVMe: all of an NVMe tier's,
    less those `offload.ram_budget_bytes` (or `ram_fraction` of the tiers' bytes) keeps in RAM;
    and which units' optimizer state (and parameter shard) is on the compute device
    (`offload.optimizer_device_units` / `_fraction`, optimizer_tier 'device':
    offload/runtime/device_split.py). Sizes are the largest rank's (shards differ only by
    padding), so that every rank makes the same choice."""
    off = config.offload
    param_tier = TierKind.of(off.param_tier)
    state_tier = TierKind.of(off.optimizer_tier, "offload.optimizer_tier")
    param_nvme, state_nvme = param_tier.spec.on_disk, state_tier.spec.on_disk
    n = len(layouts)
    param_bytes, state_bytes = unit_bytes(layouts, dtype.itemsize, specs, pg.world_size)
    on_device = device_units(config, state_bytes, names)
    if state_tier is TierKind.DEVICE:
        state_tier = TierKind.CPU  # every unit goes to the device below
    if not (param_nvme or state_nvme) or not (off.ram_budget_bytes or off.ram_fraction):
        return Placement.uniform(n, param_tier, state_tier).with_device_states(on_device)
    chosen = set(on_device)  # on the device: no RAM budget spent keeping them off the disk
    param_bytes = [0 if i in chosen else b for i, b in enumerate(param_bytes)]
    state_bytes = [0 if i in chosen else b for i, b in enumerate(state_bytes)]
    budget = off.ram_budget_bytes
    if budget is None:
        on_disk = (sum(param_bytes) if param_nvme else 0) + (sum(state_bytes) if state_nvme else 0)
        budget = int(float(off.ram_fraction or 0.0) * on_disk)
    return choose_placement(param_bytes, state_bytes, param_tier, state_tier, budget).with_device_states(on_device)


def swap_path(config: Config) -> str:
    """`offload.nvme_path`, which the config requires whenever a tier is on NVMe."""
    path = config.offload.nvme_path
    if not path:
        raise ValueError("offload.nvme_path is not set; point it at a directory on a local NVMe disk")
    return path


def _check_nvme(config: Config, pg: ProcessGroupInfo, dtype: torch.dtype, specs: tuple[StateSpec, ...],
                planned: Planned, placement: Placement) -> None:
    """What NVMe tiers need of the machine, checked before anything is created."""
    from offload.storage.swap import check_free_space, make_swap_dir, stale_swap_bytes, swap_bytes_needed

    off = config.offload
    path = swap_path(config)
    make_swap_dir(path)  # created when missing, as DeepSpeed creates its swap folder
    param_sizes, optim_sizes, worst = [], [], (0, "", 0, 0)
    for (plan, layout, _), param_on, state_on in zip(planned, placement.param_on_nvme,
                                                     placement.state_on_nvme):
        shard = align_up(layout.shard_numel * dtype.itemsize) if param_on else 0
        state = 0
        if shard:
            param_sizes.append(shard)
        if state_on:
            state = state_layout(
                layout.shard_master_numel(pg.rank), layout.shard_optimized_numel(pg.rank), specs,
            ).nbytes
            optim_sizes.append(state)
        # One unit's pinned working set (docs/nvme.md): during the step its state and its
        # new parameter shard share one buffer; a fetch, or a store by copy, needs the shard.
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
    if 3 * worst[0] > budget:
        # [Note: optimizer pipeline] in offload/storage/optim_state.py: read, update and write
        # overlap with three units' working sets; with fewer they run one after another
        # (the 4.11B run: 70-77 s per step at 1.3 units, 25-28 s at 3).
        logging.getLogger("offload").warning(
            "offload.pinned_budget_bytes=%d holds %.1f of the largest unit's working set (%d bytes, "
            "unit %r): the optimizer's NVMe reads, updates and writes will not overlap; %d bytes "
            "(three units) let them, if host memory allows", budget, budget / worst[0], worst[0],
            worst[1], 3 * worst[0])
    total = swap_bytes_needed([param_sizes, optim_sizes])
    # Every rank of this node puts its files on the same disk: check for all of them (shards
    # are equal-sized across ranks), before any rank preallocates. Ranks on other nodes use
    # their own disks. Stale files of a crashed run count as free: opening the swap
    # directory deletes them.
    local = pg.local_world_size
    check_free_space(
        path, total * local,
        f"the swap files of {local} rank(s) on this node ({total} bytes each: parameters "
        f"{sum(param_sizes)}, optimizer states {sum(optim_sizes)})",
        reclaimable_bytes=stale_swap_bytes(path),
    )


def _agree_on(error: Optional[BaseException], pg: ProcessGroupInfo, device: torch.device) -> None:
    """Raise `error` on this rank, and an error naming the failure on every other rank."""
    if pg.world_size > 1:
        flag = torch.tensor([0.0 if error is None else float(pg.world.rank + 1)])
        failed = int(all_reduce_host(flag, "max", pg, device).item())
        if error is None and failed:
            raise RuntimeError(
                f"rank {failed - 1} could not set up its NVMe tier (see its error); "
                "this rank stops with it"
            )
    if error is not None:
        raise error


def _build_units(model: nn.Module, config: Config, pg: ProcessGroupInfo, device: torch.device,
                 dtype: torch.dtype, planned: Planned, tiers: _Tiers, specs: tuple[StateSpec, ...]
                 ) -> tuple[list[FlatUnit], list[UnitOptimizerState]]:
    units: list[FlatUnit] = []
    states: list[UnitOptimizerState] = []
    records: list[list[ParamRecord]] = []
    cpu = torch.device("cpu")
    transient = transient_grad_shards(config, runtime().has_streams(device))
    # [Note: reused full buffers] in offload/units/full_buffers.py: kept up to what can be
    # live at once anyway (two units, what prefetch reads ahead and what it keeps gathered)
    fulls = [lay.padded_numel * dtype.itemsize for _, lay, _ in planned]
    largest = max(fulls, default=0)
    budget = 2 * largest + config.prefetch.prefetch_bytes + bounded_by_model(config.prefetch.keep_bytes, fulls)
    full_buffers = FullBuffers(budget) if pg.world_size == 1 and device.type == "cpu" else None
    for index, (plan, layout, recs) in enumerate(planned):
        param_tier = tiers.unit_tier(index)
        on_nvme = tiers.placement.state[index].spec.on_disk
        on_device = tiers.placement.state[index] is TierKind.DEVICE  # [Note: the update split]
        # fp32 compute on the CPU: the parameter shard and the fp32 master are the same bytes,
        # so the optimizer updates the parameters in place and nothing is copied. (Not for a
        # device unit: on a CPU run it takes the path a GPU run takes.)
        alias_master = (
            dtype == torch.float32 and param_tier.addressable and param_tier.device == cpu and not on_nvme
            and not on_device
        )
        # [Note: frozen parameters cost their shard only]: master and gradient shard cover
        # the shard up to its frozen parameters, the moments its optimized prefix.
        n_master = layout.shard_master_numel(pg.rank)
        n_opt = layout.shard_optimized_numel(pg.rank)
        # On NVMe the master exists in host memory only while the unit is initialized
        # (allocated on its first value, written out and dropped when complete).
        master = (None if on_nvme else torch.zeros(n_master, dtype=torch.float32, device=device) if on_device
                  else host_state_zeros(n_master, torch.float32))
        if alias_master:
            shard = host_state_zeros(layout.shard_numel, torch.float32)
            param_tier.adopt((index, "param"), shard)
            master = shard[:n_master]  # the master is the shard's prefix: one buffer
        unit = FlatUnit(index, plan.name, layout, param_tier, dtype, device, pg,
                        [r.param.requires_grad for r in recs],
                        resident=config.zero_stage < 3, all_reduce_grads=config.zero_stage == 1,
                        full_buffers=full_buffers)
        grad_numel = n_master
        if on_device:  # the reduce-scatter's target on the device: no copy down
            grad = torch.empty(grad_numel, dtype=torch.float32, device=device)
            if not transient:
                grad.zero_()
        elif transient:
            # Sized but holding no memory until its unit's reduce-scatter (and again none
            # after the unit's update during backward): see transient_grad_shards.
            grad = torch.empty(grad_numel, dtype=torch.float32)
        else:
            # pinned on a GPU run: the reduce-scattered shard comes down by DMA
            grad = (pinned_empty(grad_numel * 4, torch.float32) if device.type == "cuda"
                    else torch.zeros(grad_numel, dtype=torch.float32))
        states.append(UnitOptimizerState(
            unit=unit, master=master, grad_shard=GradShard(grad, len(layout.slots), released=transient),
            moments=None if on_nvme else {s.name: _fresh_state(s, n_opt, device if on_device else None)
                                          for s in specs},
            slot_steps=[0] * len(layout.slots), n_optimized=n_opt, on_device=on_device,
        ))
        units.append(unit)
        records.append(recs)
    staging = None if tiers.nvme is None else tiers.nvme.staging
    host = (DeviceOptimizerStates(states, tiers.placement.state_on_device, staging)
            if any(tiers.placement.state_on_device) else HostOptimizerStates(states, staging=staging))
    if tiers.nvme_states is None:
        tiers.optimizer_states = host
    elif not all(tiers.placement.state_on_nvme):
        tiers.optimizer_states = SplitOptimizerStates(host, tiers.nvme_states, tiers.placement.state_on_nvme)
    else:
        tiers.optimizer_states = tiers.nvme_states
    _fill_masters(model, units, states, records, tiers.optimizer_states)
    for unit, recs in zip(units, records):
        for rec, p in zip(recs, unit.params):
            for owner, attr in rec.owners:
                owner._parameters[attr] = p
        if not unit.aliased:
            unit.free()
    # The model's original parameters are now referenced by nothing of ours: their memory
    # goes back as soon as the caller drops its own references.
    return units, states


def _fresh_state(spec: StateSpec, n_opt: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """A state tensor over `n_opt` optimized elements, at its zero (`StateSpec.zero`): in host
    memory, or on `device` (the compute device, for a device unit)."""
    t = (host_state_zeros(spec.numel(n_opt), spec.dtype) if device is None
         else torch.zeros(spec.numel(n_opt), dtype=spec.dtype, device=device))
    return t.fill_(spec.zero) if spec.zero else t


def _fill_masters(model: nn.Module, units: list[FlatUnit],
                  states: list[UnitOptimizerState], records: list[list[ParamRecord]],
                  optimizer_states: OptimizerStates) -> None:
    """Fill the masters from the model's values (or replay the init of a meta-built model,
    one module at a time), frozen values straight into the shard's frozen suffix (rounded
    once to the compute dtype); as soon as a unit has all its values, publish its
    low-precision shard (and, on NVMe, write its state and drop the host master)."""
    slot_of = {id(rec.param): (ui, si) for ui, recs in enumerate(records) for si, rec in enumerate(recs)}
    missing = [len(recs) for recs in records]
    frozen: dict[int, torch.Tensor] = {}
    """Per unit being filled, its frozen suffix: the host tier's own memory, else a buffer."""

    def values(ui: int) -> tuple[torch.Tensor, torch.Tensor]:
        st, unit = states[ui], units[ui]
        if st.master is None:  # NVMe: this unit's first value during initialize
            st.master = torch.zeros(unit.master_numel, dtype=torch.float32)
        if ui not in frozen:
            frozen[ui] = unit.frozen_buffer()
        return st.master, frozen[ui]

    def finish(ui: int) -> None:
        master, suffix = values(ui)
        units[ui].publish(master, suffix)
        del frozen[ui]
        optimizer_states.initialized(ui, states[ui])

    finished: set[int] = set()
    for pid, value in materialize.materialize_values(model, records, slot_of):
        ui, si = slot_of[pid]
        units[ui].set_slot(si, value, *values(ui))
        missing[ui] -= 1
        if missing[ui] == 0:
            finish(ui)
            finished.add(ui)
    for ui in range(len(units)):
        if ui not in finished:
            finish(ui)  # a unit without parameters


def _index_state_dict(model: nn.Module, units: list[FlatUnit]) -> list[StateDictEntry]:
    """For each key of `model.state_dict()`: which slot or buffer holds its value."""
    where = {id(p): (ui, si) for ui, unit in enumerate(units) for si, p in enumerate(unit.params)}
    out = []
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and id(value) in where:
            out.append(StateDictEntry(key, Location.PARAM, where[id(value)]))
        elif isinstance(value, torch.Tensor):
            out.append(StateDictEntry(key, Location.BUFFER, value))
        else:
            out.append(StateDictEntry(key, Location.OTHER, value))
    return out
