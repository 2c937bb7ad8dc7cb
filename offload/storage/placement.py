"""Which units' bytes stay in host memory when a tier is NVMe: per-unit placement.

`offload.param_tier='nvme'` and `offload.optimizer_tier='nvme'` put every unit's parameter
shard, or optimizer state, in the swap files. Host memory left over is better spent
keeping some of them: a byte kept in RAM is a byte the step does not move through the disk.
`Placement` says, per unit, which kind of tier (`TierKind`) holds its parameter shard and
which its optimizer state; `choose_placement` fills a host-memory budget (`offload.ram_budget_bytes`, or
`offload.ram_fraction` of the NVMe bytes) with the bytes that save the most disk traffic
per step:

- a parameter shard on NVMe is read in forward, read again in backward and written after
  its update: `PARAM_TRAFFIC` = 3 bytes moved per byte kept;
- an optimizer state on NVMe (fp32 master and moments) is read and written once per step:
  `STATE_TRAFFIC` = 2 bytes moved per byte kept.

So parameter shards come first; among equals, the units that run first (the lowest
indices): their forward reads start the step with no compute to hide behind, and their
updates close the backward (the optimizer in backward updates the last unit first), so their
I/O is the most exposed. The choice is a greedy fill by bytes saved per byte kept, which
skips an item that does not fit and goes on with smaller ones.

Pure arithmetic over sizes: the engine's builder and the planner (`python -m offload.plan`)
make the same choice from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from offload.sizes import align_up
from offload.storage.state_layout import StateSpec, state_layout
from offload.storage.tier_kind import TierKind

__all__ = ["PARAM_TRAFFIC", "STATE_TRAFFIC", "Placement", "choose_placement", "unit_bytes",
           "device_units_by_count", "device_units_by_bytes"]

PARAM_TRAFFIC = 3
"""Bytes of disk traffic per step per byte of parameter shard on NVMe (2 reads, 1 write)."""
STATE_TRAFFIC = 2
"""Bytes of disk traffic per step per byte of optimizer state on NVMe (1 read, 1 write)."""


@dataclass(frozen=True)
class Placement:
    """Per unit (by index): the kind of tier holding its parameter shard, and its optimizer
    state (a kind of the config's tier, or that kind's `ram_kind` where RAM keeps it)."""

    param: tuple[TierKind, ...]
    state: tuple[TierKind, ...]

    @classmethod
    def uniform(cls, n_units: int, param: TierKind, state: TierKind) -> "Placement":
        """Every unit in its tier: no RAM budget."""
        return cls((param,) * n_units, (state,) * n_units)

    @property
    def param_on_nvme(self) -> tuple[bool, ...]:
        """Per unit: whether its parameter shard is on disk."""
        return tuple(k.spec.on_disk for k in self.param)

    @property
    def state_on_nvme(self) -> tuple[bool, ...]:
        """Per unit: whether its optimizer state is on disk."""
        return tuple(k.spec.on_disk for k in self.state)

    @property
    def state_on_device(self) -> tuple[bool, ...]:
        """Per unit: whether its fp32 master and optimizer state live on the compute device
        (and its update runs there: [Note: the update split] in offload/storage/device_states.py)."""
        return tuple(k is TierKind.DEVICE for k in self.state)

    def with_device_states(self, indices: Sequence[int]) -> "Placement":
        """These units' optimizer state (and, so that neither crosses the bus for them, their
        parameter shard) on the compute device; the others as they are."""
        chosen = set(indices)
        return Placement(
            tuple(TierKind.DEVICE if i in chosen else k for i, k in enumerate(self.param)),
            tuple(TierKind.DEVICE if i in chosen else k for i, k in enumerate(self.state)))

    @property
    def any_nvme(self) -> bool:
        return any(self.param_on_nvme) or any(self.state_on_nvme)

    @property
    def mixed(self) -> bool:
        """Some units of one kind in RAM and others on NVMe."""
        return any(len(set(v)) > 1 for v in (self.param, self.state))

    def kept_bytes(self, param_bytes: Sequence[int], state_bytes: Sequence[int],
                   param_tier: TierKind, state_tier: TierKind) -> int:
        """Host bytes the placement keeps out of a tier on disk."""
        kept = 0
        if param_tier.spec.on_disk:
            kept += sum(b for b, on in zip(param_bytes, self.param_on_nvme) if not on)
        if state_tier.spec.on_disk:
            kept += sum(b for b, on in zip(state_bytes, self.state_on_nvme) if not on)
        return kept

    def nvme_traffic(self, param_bytes: Sequence[int], state_bytes: Sequence[int]) -> int:
        """Disk bytes per step this placement implies (the model above)."""
        return (PARAM_TRAFFIC * sum(b for b, on in zip(param_bytes, self.param_on_nvme) if on)
                + STATE_TRAFFIC * sum(b for b, on in zip(state_bytes, self.state_on_nvme) if on))

    def describe(self) -> str:
        """'params: 12/32 units in RAM; optimizer state: 0/32 units in RAM' (plus which)."""
        def part(flags: tuple[bool, ...]) -> str:
            ram = [i for i, on in enumerate(flags) if not on]
            text = f"{len(ram)}/{len(flags)} units in RAM"
            if ram and len(ram) < len(flags):
                text += f" (units {_ranges(ram)})"
            return text

        text = f"parameters: {part(self.param_on_nvme)}; optimizer state: {part(self.state_on_nvme)}"
        on_device = [i for i, on in enumerate(self.state_on_device) if on]
        if on_device:
            text += f"; optimizer state on the device: {len(on_device)}/{len(self.state)} units (units {_ranges(on_device)})"
        return text


class ShardSizes(Protocol):
    """What `unit_bytes` reads of a unit's layout (offload/units/layout.py `UnitLayout`,
    a layer above): its shard's elements, and per rank the master's and the optimized ones."""

    @property
    def shard_numel(self) -> int: ...

    def shard_master_numel(self, rank: int) -> int: ...

    def shard_optimized_numel(self, rank: int) -> int: ...


def unit_bytes(layouts: Sequence[ShardSizes], param_itemsize: int, specs: Sequence[StateSpec],
               world_size: int) -> tuple[list[int], list[int]]:
    """Per unit (`UnitLayout`s): the bytes its parameter shard and its optimizer state take
    on NVMe (swap-slot sizes: page-rounded), the largest rank's, so that every rank (and the
    planner) sees the same sizes and makes the same choice."""
    params = [align_up(lay.shard_numel * param_itemsize) for lay in layouts]
    states = [max(state_layout(lay.shard_master_numel(r), lay.shard_optimized_numel(r),
                               tuple(specs)).nbytes for r in range(world_size))
              for lay in layouts]
    return params, states


def choose_placement(
    param_bytes: Sequence[int],
    state_bytes: Sequence[int],
    param_tier: TierKind,
    state_tier: TierKind,
    budget_bytes: int,
) -> Placement:
    """Keep in host memory, within `budget_bytes`, the units' parameter shards (`param_bytes`,
    when `param_tier` is on disk) and optimizer states (`state_bytes`, when `state_tier` is)
    that save the most disk traffic per byte kept (see the module docstring); a unit kept
    goes to its tier's `ram_kind`. A tier in memory keeps all its units where they are."""
    if len(param_bytes) != len(state_bytes):
        raise ValueError(f"{len(param_bytes)} parameter sizes for {len(state_bytes)} state sizes")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} is negative")
    n = len(param_bytes)
    param, state = [param_tier] * n, [state_tier] * n
    # (traffic saved per byte, then the earliest unit, then parameters before state)
    items: list[tuple[int, int, int, list[TierKind], TierKind, int]] = []
    if param_tier.spec.on_disk:
        items += [(-PARAM_TRAFFIC, i, 0, param, param_tier.spec.ram_kind, int(b)) for i, b in enumerate(param_bytes)]
    if state_tier.spec.on_disk:
        items += [(-STATE_TRAFFIC, i, 1, state, state_tier.spec.ram_kind, int(b)) for i, b in enumerate(state_bytes)]
    left = int(budget_bytes)
    for _, i, _, kinds, ram, size in sorted(items, key=lambda t: t[:3]):
        if size <= left:
            kinds[i] = ram
            left -= size
    return Placement(tuple(param), tuple(state))


def device_units_by_count(n_units: int, count: int) -> list[int]:
    """The units a count puts on the device: the first `count` in index order, the root (0)
    and the first blocks. Backward reduces them last and the next forward needs them first,
    so their CPU updates are the ones nothing hides ([Note: the update split])."""
    return list(range(min(max(count, 0), n_units)))


def device_units_by_bytes(state_bytes: Sequence[int], budget_bytes: int) -> list[int]:
    """The units whose optimizer state fits in `budget_bytes` of device memory, taken in the
    same order as `device_units_by_count`; one that does not fit is skipped and the fill goes
    on with the next (a large root does not keep the first blocks off the device)."""
    left, out = int(budget_bytes), list[int]()
    if left <= 0:
        return out
    for i, b in enumerate(state_bytes):
        if int(b) <= left:
            out.append(i)
            left -= int(b)
    return out


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start, prev = [], indices[0], indices[0]
    rest: list[Optional[int]] = [*indices[1:], None]
    for i in rest:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
