"""Bytes per tier for one placement: the model laid out as the engine lays it out, and the
engine's allocation rules applied to it unit by unit.

[Note: the figures are the engine's]
Nothing here is a separate guess of "bytes per parameter". The units come from the engine's
wrap policy (`offload.units.partition.plan_units`), the groups from
`offload.optim.sharded.resolve_param_groups`, the flat layout (alignment, padding to the world
size) from `offload.units.shard.layout_unit`, the dtypes from the config, and `rank_bytes`
applies the engine's allocation rules unit by unit (which buffers exist, which are aliased,
which tier each lands in). tests/test_plan.py pins the result to `Engine.memory_bytes()` after
a training step. A bare parameter count is laid out as equal units through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import torch
from torch import nn

from offload.config import Config
from offload.dtypes import DTYPES
from offload.optim.kinds import OptimizerArg, state_specs
from offload.optim.sharded import host_state_bytes, resolve_param_groups
from offload.sizes import align_up
from offload.storage.state_layout import ADAM_STATE, StateSpec, param_align, uniform_specs
from offload.storage.tier_kind import TierKind
from offload.units.partition import plan_units
from offload.units.shard import FROZEN_GROUP, PARAM_ALIGN_ELEMS, UnitLayout, layout_unit

__all__ = ["UnitSpec", "ModelSpec", "spec_from_model", "spec_from_count", "spec_from_counts", "default_units",
           "TierBytes", "rank_bytes", "working_bytes", "disk_bytes_per_step"]


# --------------------------------------------------------------------------------------
# The model's layout, as the engine builds it
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitSpec:
    layout: UnitLayout
    trainable: bool
    """Some parameter requires grad: autograd computes gradients for the unit (its fp32
    gradient shard covers only what an optimizer group updates: `rank_bytes`)."""
    name: str = ""
    """The unit's name ("" for the root), as `offload.optimizer_device_units` names it."""


@dataclass(frozen=True)
class ModelSpec:
    units: tuple[UnitSpec, ...]
    """Index 0 is the root unit, as in the engine."""
    buffer_bytes: int
    """Module buffers, whole on every rank's compute device, in the dtype
    `precision.buffer_dtype` gives them (their own by default)."""
    params: int
    trainable_params: int
    states: tuple[StateSpec, ...] = uniform_specs(ADAM_STATE, torch.float32)
    """The optimizer's state tensors beside the master (Adam 2, Lion and Adagrad 1, 8-bit
    Adam codes and scales: offload/optim/kinds.py `state_specs`)."""

    @property
    def state_tensors(self) -> int:
        return len(self.states)

    @property
    def state_bytes_per_element(self) -> float:
        """Bytes of optimizer state per optimized element beside the master (Adam fp32: 8)."""
        return sum(s.dtype.itemsize / s.per for s in self.states)


def spec_from_model(model: nn.Module, config: Config, optimizer: OptimizerArg, world_size: int,
                    p_bytes: int, moments: Optional[str] = None) -> ModelSpec:
    # Exactly Engine._build_units' grouping and layout (see [Note: the figures are the engine's]).
    plans = plan_units(model, config.unit_modules, config.leaf_modules)
    _groups, group_of, kind = resolve_param_groups(model, config.optimizer, optimizer)
    states = state_specs(kind, moments or config.optimizer.moments_dtype)
    align = param_align(states, PARAM_ALIGN_ELEMS)
    units = []
    params = trainable = 0
    for plan_ in plans:
        entries = []
        for rec in plan_.params:
            p = rec.param
            g = group_of.get(id(p), FROZEN_GROUP) if p.requires_grad else FROZEN_GROUP
            entries.append((rec.name, tuple(p.shape), g))
            params += p.numel()
            trainable += p.numel() if g != FROZEN_GROUP else 0
        layout = layout_unit(entries, world_size, param_align=align)
        units.append(UnitSpec(layout, any(rec.param.requires_grad for rec in plan_.params), plan_.name))
    rule = config.precision.buffer_dtype  # as offload.runtime.buffers places them
    buffer_bytes = 0
    for b in model.buffers():  # each once: torch's iterator removes duplicates
        if not b.is_floating_point() or rule == "keep":
            size = b.element_size()
        else:
            size = p_bytes if rule == "compute" else DTYPES[rule].itemsize
        buffer_bytes += b.numel() * size
    return ModelSpec(tuple(units), buffer_bytes, params, trainable, states)


def default_units(params: int) -> int:
    """Units for a bare parameter count: one per ~200M parameters (a 7B model: 35), at least
    one; a transformer's blocks are typically of that order."""
    return max(1, round(params / 2e8))


def spec_from_count(params: int, world_size: int, units: Optional[int],
                    states: tuple[StateSpec, ...] = uniform_specs(ADAM_STATE, torch.float32)) -> ModelSpec:
    """A bare count laid out as `units` equal trainable units under an empty root (the
    engine always has a root), through the engine's own layout function."""
    n = units or default_units(params)
    per, extra = divmod(params, n)
    specs = [UnitSpec(layout_unit([], world_size), False)]
    for i in range(n):
        numel = per + (1 if i < extra else 0)
        specs.append(UnitSpec(layout_unit([(f"unit{i}", (numel,), 0)], world_size), True))
    return ModelSpec(tuple(specs), 0, params, params, states)


def spec_from_counts(counts: "list[int]", world_size: int,
                     states: tuple[StateSpec, ...] = uniform_specs(ADAM_STATE, torch.float32)) -> ModelSpec:
    """Units of the given parameter counts (index 0 the root: a model shape's units,
    offload/plan/shapes.py), every one trainable, through the engine's layout function."""
    specs = [UnitSpec(layout_unit([(f"unit{i}", (n,), 0)] if n else [], world_size), n > 0)
             for i, n in enumerate(counts)]
    total = sum(counts)
    return ModelSpec(tuple(specs), 0, total, total, states)


# --------------------------------------------------------------------------------------
# Bytes per tier
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierBytes:
    device: int = 0
    """Compute-device memory (GPU; host memory on a CPU run)."""
    host: int = 0
    """Host memory: shards, master, moments, gradients (pinned where a GPU copies them)."""
    pinned: int = 0
    """The NVMe tier's pinned staging pool (host memory too): its budget, an upper bound."""
    nvme: int = 0
    """Swap-file bytes."""

    def __add__(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(self.device + other.device, self.host + other.host,
                         self.pinned + other.pinned, self.nvme + other.nvme)

    def max(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(max(self.device, other.device), max(self.host, other.host),
                         max(self.pinned, other.pinned), max(self.nvme, other.nvme))

    @property
    def host_total(self) -> int:
        return self.host + self.pinned

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "pinned": self.pinned, "nvme": self.nvme}


def rank_bytes(spec: ModelSpec, rank: int, param_tier: str, optimizer_tier: str, *,
               p_bytes: int, on_gpu: bool, pinned_budget_bytes: int,
               transient_grads: bool = False, stage: int = 3, world_size: int = 1,
               device_units: Collection[int] = ()) -> TierBytes:
    """What `Engine.memory_bytes()` reports on `rank` between steps (after the first step).

    The engine's rules, unit by unit (offload/runtime/build.py `_build_units`,
    offload/optim/sharded.py, [Note: frozen parameters cost their shard only] in
    offload/units/layout.py):
    - fp32 master and fp32 gradient shard: the shard up to its frozen parameters
      (`UnitLayout.shard_master_numel`: the whole shard when none is frozen, nothing when
      none is optimized); the optimizer's state tensors (`spec.state_tensors`: Adam's
      exp_avg and exp_avg_sq, Lion's exp_avg, Adagrad's sum): the shard's optimized prefix, in the
      moments dtype. A frozen parameter costs its parameter shard only. Host memory, or (optimizer on NVMe) master and moments in the
      swap file, each rounded up to `offload.sizes.ALIGNMENT` (swap-file offsets and sizes
      are O_DIRECT-aligned), while the gradient shard stays in host memory (it is the
      reduce-scatter's target, accumulated over micro-batches) — except when the shards
      are transient (`offload.optim.sharded.transient_grad_shards`: every update runs during
      backward on a CPU run): then none is held between steps (one unit's during
      backward, counted in the working set).
    - the parameter shard (compute dtype) in its tier; with fp32 compute and the shard in
      host memory (a CPU run, or param_tier cpu) the master is its prefix: one buffer.
    - gathered full buffers are freed between steps at stage 3; at stages 1 and 2
      (`stage`) every unit's stays resident on the compute device, in the compute dtype
      (at world size 1 with the shard on the compute device the full buffer is the shard:
      nothing more, at any stage).
    - buffers: on the compute device.
    - the optimizer's two low-precision staging buffers (each one largest shard, host:
      double-buffered uploads) exist when the parameter shard is GPU memory and the
      optimizer state is in host memory; with an NVMe tier the new shard is written into
      the staging pool's scratch instead.
    - with any NVMe tier, the pinned staging pool ('pinned'): at most `pinned_budget_bytes`.
    - a unit of `device_units` ([Note: the update split] in offload/storage/device_states.py):
      its fp32 master, state tensors, gradient shard and parameter shard in compute-device
      memory at their exact sizes ('device', on a CPU run too), never aliased, no staging.
    """
    dev = host = nvme = 0
    pk, ok = TierKind.of(param_tier).spec, TierKind.of(optimizer_tier, "offload.optimizer_tier").spec
    shard_in_host = pk.bucket == "host" or (pk.bucket == "device" and not on_gpu)
    alias_master = p_bytes == 4 and shard_in_host and not ok.on_disk
    staging = 0
    on_device = frozenset(device_units)
    for index, u in enumerate(spec.units):
        layout = u.layout
        if index in on_device:
            master_b = layout.shard_master_numel(rank) * 4
            opt = layout.shard_optimized_numel(rank)
            dev += (0 if transient_grads else master_b) + master_b + layout.shard_numel * p_bytes
            dev += sum(s.numel(opt) * s.dtype.itemsize for s in spec.states)
            continue
        shard = layout.shard_numel
        opt = layout.shard_optimized_numel(rank)
        master_b = layout.shard_master_numel(rank) * 4
        moments_b = [s.numel(opt) * s.dtype.itemsize for s in spec.states]
        grad_b = master_b if not transient_grads else 0
        host += grad_b
        if alias_master:  # one buffer: the fp32 shard, the master its prefix
            host += host_state_bytes(shard * 4) + sum(host_state_bytes(b) for b in moments_b)
        elif not ok.on_disk:
            host += host_state_bytes(master_b) + sum(host_state_bytes(b) for b in moments_b)
        else:
            nvme += align_up(master_b) + sum(align_up(b) for b in moments_b)
        if not alias_master:
            shard_b = shard * p_bytes
            if pk.on_disk:
                nvme += align_up(shard_b)
            elif pk.bucket == "device":  # (a CPU run: the compute device is host memory, counted apart)
                dev += shard_b
            else:
                host += shard_b
        if (p_bytes != 4 and pk.bucket == "device" and on_gpu and not ok.on_disk
                and layout.has_optimized):
            staging = max(staging, layout.shard_master_numel(rank) * p_bytes)
    shard_on_compute = pk.bucket == "device" or (pk.bucket == "host" and not on_gpu)
    if stage < 3:  # resident full buffers, but where the shard on the compute device is one
        dev += sum(u.layout.padded_numel * p_bytes for i, u in enumerate(spec.units)
                   if not (world_size == 1 and (shard_on_compute or i in on_device)))
    dev += spec.buffer_bytes
    host += 2 * staging
    pinned = pinned_budget_bytes if pk.on_disk or ok.on_disk else 0
    return TierBytes(dev, host, pinned, nvme)


def working_bytes(spec: ModelSpec, param_tier: str, *, p_bytes: int, on_gpu: bool,
                  world_size: int, prefetch_bytes: int = 0, keep_bytes: int = 0,
                  stage: int = 3) -> int:
    """Compute-device bytes the engine adds during forward/backward, an upper bound (not
    counting activations), from the schedule's rules (offload/runtime/schedule.py):
    - the root's full buffer and gradients (held from its forward to the end of backward);
    - the unit in use: its full buffer, its gradients and the fp32 flat buffer its
      reduce-scatter uses (the largest unit's);
    - what is gathered ahead: at world size > 1 the next unit's all-gather is issued under
      this one's compute whatever the budget (one full buffer, the largest); where a fetch
      ahead lands in the unit's full buffer (a host shard copied to the GPU, an NVMe shard
      read straight into it at world size 1 on the CPU) the units within `prefetch_bytes`,
      and always the next one (issue #30, F8);
    - what is kept gathered from forward to backward: at most `keep_bytes`;
    all of it at most every unit's full buffer at once (issue #30, F6). An NVMe read ahead
    lands in the pinned staging pool, counted in `rank_bytes`' 'pinned'. At stages 1 and 2
    every full buffer is resident, counted in `rank_bytes`: none is added here."""
    kind = TierKind.of(param_tier).spec
    shard_on_device = kind.bucket == "device" or (kind.bucket == "host" and not on_gpu)
    aliased = (world_size == 1 and shard_on_device) or stage < 3
    fast_reduce = world_size == 1 and not on_gpu  # straight into the host grad shard

    def full(u: UnitSpec) -> int:
        return 0 if aliased else u.layout.padded_numel * p_bytes

    def unit_bytes(u: UnitSpec) -> int:
        grads = u.layout.numel * p_bytes if u.trainable else 0
        reduce = 0 if fast_reduce or not u.trainable else u.layout.padded_numel * 4
        return full(u) + grads + reduce

    root, rest = spec.units[0], spec.units[1:]
    if not rest:
        return unit_bytes(root)
    fulls = [full(u) for u in rest]
    lands_in_full = (kind.bucket == "host" and on_gpu) or (kind.on_disk and world_size == 1 and not on_gpu)
    ahead = 0
    if prefetch_bytes > 0:
        if lands_in_full:
            ahead = max(prefetch_bytes, max(fulls))
        elif world_size > 1:
            ahead = max(fulls)
    keep = max(0, keep_bytes)
    in_use = max(unit_bytes(u) for u in rest)
    at_once = max(unit_bytes(u) - full(u) for u in rest) + sum(fulls)  # every full buffer
    return unit_bytes(root) + min(in_use + ahead + keep, at_once)


def disk_bytes_per_step(spec: ModelSpec, param_tier: str, optimizer_tier: str, *, p_bytes: int,
                        world_size: int) -> int:
    """Per rank: bytes read + written on NVMe per optimizer step, [Note: placement order]'s
    figures (`offload.plan.planner.PLACEMENTS`): optimizer states on NVMe move the 4 B master
    plus the state (`ModelSpec.state_bytes_per_element`: fp32 Adam 8 B, bf16 4 B, 8-bit 2.03 B;
    Lion and Adagrad half) read, and as much written, per trainable parameter; parameter shards on NVMe 2 B per gather (forward
    and backward) + 2 B written per trainable parameter, 2 B per gather for a frozen one,
    at a 2-byte compute dtype (scaled for others)."""
    params_on_disk = TierKind.of(param_tier).spec.on_disk
    state_on_disk = TierKind.of(optimizer_tier, "offload.optimizer_tier").spec.on_disk
    if not (params_on_disk or state_on_disk):
        return 0
    scale = p_bytes / 2
    params_bytes = 6 * scale if params_on_disk else 0
    opt_bytes = 2 * (4 + spec.state_bytes_per_element) if state_on_disk else 0
    disk = int(spec.trainable_params / world_size * (opt_bytes + params_bytes))
    if params_on_disk and spec.trainable_params < spec.params:
        disk += int((spec.params - spec.trainable_params) / world_size * 4 * scale)
    return disk
