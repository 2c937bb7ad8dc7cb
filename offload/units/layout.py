"""A unit's flat layout and its cut into rank shards: pure functions on integers (tested
without tensors in test_shard.py; `offload.units.shard.FlatUnit` is the runtime over it).

A unit's parameters are laid end to end in one flat buffer, each at an offset aligned to
`PARAM_ALIGN_ELEMS`, ordered by optimizer group (frozen parameters last), and the whole is
padded so that every rank's shard has the same length, a multiple of `SHARD_ALIGN_ELEMS`.
Rank r owns flat elements [r * shard_numel, (r + 1) * shard_numel).

[Note: frozen parameters cost their shard only]
A parameter no optimizer group updates (requires_grad=False at `initialize`, or in no
group) has no fp32 master, no moments and no gradient shard: its value lives only in the
parameter shard, in the compute dtype (rounded once from the model's value, as
`model.to(dtype)` rounds), and the optimizer never writes it. Frozen parameters come last
in the flat layout, and when a unit also has optimized ones the first frozen parameter
starts at a multiple of `SHARD_ALIGN_ELEMS` (`UnitLayout.master_end`). So on every rank the
shard is an optimized prefix [0, master_numel), which the fp32 master and gradient shard
cover, and a frozen suffix [master_numel, shard_numel), which only the parameter shard
holds; the boundary is 4 KiB-aligned in bf16 (8 KiB in fp32), so the optimizer writes back
just the prefix, also to an NVMe slot by O_DIRECT (`Tier.store_prefix`). A unit without
frozen parameters keeps a master over its whole shard (padding included: the gradient
reduce-scatter lands in it directly); one without optimized parameters has no state at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from offload.sizes import align_up

__all__ = ["PARAM_ALIGN_ELEMS", "SHARD_ALIGN_ELEMS", "FROZEN_GROUP", "ParamSlot", "Segment",
           "UnitLayout", "intersect", "layout_unit", "UpdateRun", "update_runs"]

PARAM_ALIGN_ELEMS = 16
"""Each parameter starts at a multiple of 16 elements: 64-byte (cache line / AVX-512)
aligned views in fp32, 32-byte in bf16."""

SHARD_ALIGN_ELEMS = 2048
"""Every shard is a multiple of 2048 elements: 4 KiB in bf16/fp16, 8 KiB in fp32, so the
NVMe tier can move shards with O_DIRECT at 4 KiB-aligned offsets and sizes."""

FROZEN_GROUP = -1
"""The group index of parameters no optimizer group updates (requires_grad=False, or
not listed in any group). They are laid out after every optimized parameter."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in its unit's flat buffer (in elements)."""

    name: str
    shape: tuple[int, ...]
    group: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Segment:
    """A run of flat elements [start, end) updated with one optimizer group's settings."""

    group: int
    start: int
    end: int


@dataclass(frozen=True)
class UnitLayout:
    slots: tuple[ParamSlot, ...]
    world_size: int
    padded_numel: int
    """Flat elements including alignment gaps and tail padding; world_size * shard_numel."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no gaps, no padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def optimized_numel(self) -> int:
        """Flat elements [0, optimized_numel) hold every optimized parameter."""
        ends = [s.end for s in self.slots if s.group != FROZEN_GROUP]
        return max(ends, default=0)

    @property
    def has_optimized(self) -> bool:
        """Some parameter is updated by an optimizer group: the unit's gradients are
        reduce-scattered (on every rank, whatever part of the unit it holds)."""
        return any(s.group != FROZEN_GROUP for s in self.slots)

    @property
    def master_end(self) -> int:
        """Flat elements [0, master_end) are covered by fp32 masters and gradient shards:
        up to the first frozen parameter, the whole buffer when none is frozen, nothing
        when none is optimized ([Note: frozen parameters cost their shard only])."""
        if not self.has_optimized:
            return 0
        frozen = [s.offset for s in self.slots if s.group == FROZEN_GROUP]
        return min(frozen) if frozen else self.padded_numel

    def shard_master_numel(self, rank: int) -> int:
        """Shard-local elements [0, n) the fp32 master and gradient shard cover on this rank;
        the rest of the shard holds frozen values (and padding) in the parameter shard only."""
        lo, hi = self.shard_range(rank)
        return max(0, min(self.master_end, hi) - lo)

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def segments(self) -> tuple[Segment, ...]:
        """One flat run per optimizer group, covering the group's parameters and the gaps
        between them (gaps hold zeros, which Adam leaves at zero)."""
        out: list[Segment] = []
        for s in self.slots:
            if s.group == FROZEN_GROUP:
                continue
            if out and out[-1].group == s.group:
                out[-1] = Segment(s.group, out[-1].start, s.end)
            else:
                out.append(Segment(s.group, s.offset, s.end))
        return tuple(out)

    def shard_segments(self, rank: int) -> tuple[Segment, ...]:
        """`segments()` clipped to this rank's shard, in shard-local coordinates."""
        lo, hi = self.shard_range(rank)
        out = []
        for seg in self.segments():
            r = intersect((seg.start, seg.end), (lo, hi))
            if r is not None:
                out.append(Segment(seg.group, r[0] - lo, r[1] - lo))
        return tuple(out)

    def shard_optimized_numel(self, rank: int) -> int:
        """Shard-local elements [0, n) that optimizer state must cover on this rank."""
        lo, hi = self.shard_range(rank)
        return max(0, min(self.optimized_numel, hi) - lo)

    def slot_in_shard(self, slot: ParamSlot, rank: int) -> Optional[tuple[int, int, int]]:
        """The part of `slot` this rank owns: (offset in the parameter, offset in the shard,
        length), or None."""
        lo, hi = self.shard_range(rank)
        r = intersect((slot.offset, slot.end), (lo, hi))
        if r is None:
            return None
        return r[0] - slot.offset, r[0] - lo, r[1] - r[0]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> Optional[tuple[int, int]]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def layout_unit(
    params: Sequence[tuple[str, Sequence[int], int]],
    world_size: int,
    param_align: int = PARAM_ALIGN_ELEMS,
    shard_align: int = SHARD_ALIGN_ELEMS,
) -> UnitLayout:
    """Lay out (name, shape, group) parameters: groups ascending, FROZEN_GROUP last, the
    order within a group kept; offsets aligned; padded to world_size equal aligned shards.
    The first frozen parameter after an optimized one starts at a multiple of `shard_align`
    ([Note: frozen parameters cost their shard only])."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(
        range(len(params)),
        key=lambda i: (params[i][2] == FROZEN_GROUP, params[i][2], i),
    )
    slots: list[ParamSlot] = []
    offset = 0
    for i in order:
        name, shape, group = params[i]
        numel = 1
        for d in shape:
            numel *= int(d)
        offset = align_up(offset, param_align)
        if int(group) == FROZEN_GROUP and slots and slots[-1].group != FROZEN_GROUP:
            offset = align_up(offset, shard_align)
        slots.append(ParamSlot(name, tuple(int(d) for d in shape), int(group), offset, numel))
        offset += numel
    shard_numel = max(align_up(-(-offset // world_size), shard_align), shard_align)
    return UnitLayout(tuple(slots), world_size, shard_numel * world_size)


@dataclass(frozen=True)
class UpdateRun:
    """A shard-local run [start, end) updated by one adam call: one group, one step count."""

    group: int
    step: int
    start: int
    end: int


def update_runs(
    layout: UnitLayout, rank: int, active: Sequence[bool], steps: Sequence[int]
) -> tuple[UpdateRun, ...]:
    """The calls one optimizer step makes over this rank's shard.

    `active[i]`: slot i is optimized this step (it is in a group and received a gradient);
    `steps[i]`: slot i's step count after this update (torch keeps one per parameter, and a
    parameter without a gradient is skipped, so counts can differ). Consecutive active
    slots with equal (group, step) merge into one run, gaps between them included (zeros).
    """
    lo, hi = layout.shard_range(rank)
    runs: list[UpdateRun] = []
    prev_end = None
    for slot, on, step in zip(layout.slots, active, steps):
        if not on or slot.group == FROZEN_GROUP:
            prev_end = None
            continue
        r = intersect((slot.offset, slot.end), (lo, hi))
        if r is None:
            prev_end = None
            continue
        start, end = r[0] - lo, r[1] - lo
        last = runs[-1] if runs else None
        if (
            last is not None
            and prev_end is not None
            and last.end == prev_end
            and (last.group, last.step) == (slot.group, step)
        ):
            runs[-1] = UpdateRun(slot.group, step, last.start, end)
        else:
            runs.append(UpdateRun(slot.group, step, start, end))
        prev_end = end
    return tuple(runs)
