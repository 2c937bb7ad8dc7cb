"""A unit's flat layout, its rank's shard, and the gather / reduce-scatter that move it.

Layout first, as pure functions on integers (tested without tensors in test_shard.py):
a unit's parameters are laid end to end in one flat buffer, each at an offset aligned to
`PARAM_ALIGN_ELEMS`, ordered by optimizer group (frozen parameters last), and the whole is
padded so that every rank's shard has the same length, a multiple of `SHARD_ALIGN_ELEMS`.
Rank r owns flat elements [r * shard_numel, (r + 1) * shard_numel).

Then `FlatUnit`, the runtime of one unit on one rank: the shard in its tier, the full flat
buffer on the compute device, and the parameters as views into that buffer.

[Note: freeing by storage resize]
The parameters the module holds are `nn.Parameter` views into `full`. To free the unit we
resize `full`'s untyped storage to 0 bytes, and to gather we resize it back and all-gather
into it. The tensor objects never change, so parameters the module holds and tensors that
autograd saved for backward stay valid: after a re-gather they see the same bytes again.
(FSDP2 frees its all-gather output the same way.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

import offload.units.collectives as _dist
from offload.sizes import align_up
from offload.storage.tiers import Tier, wait
from offload.units.parameter import UnitParameter

_GRAD_OF = torch._C.TensorBase.grad.__get__
"""torch's `.grad` getter, without a subclass's property in between."""

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
    order within a group kept; offsets aligned; padded to world_size equal aligned shards."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(
        range(len(params)),
        key=lambda i: (params[i][2] == FROZEN_GROUP, params[i][2], i),
    )
    slots = []
    offset = 0
    for i in order:
        name, shape, group = params[i]
        numel = 1
        for d in shape:
            numel *= int(d)
        offset = align_up(offset, param_align)
        slots.append(ParamSlot(name, tuple(int(d) for d in shape), int(group), offset, numel))
        offset += numel
    shard_numel = max(align_up(-(-offset // world_size), shard_align), shard_align)
    return UnitLayout(tuple(slots), world_size, shard_numel * world_size)


class UnitState(enum.Enum):
    SHARDED = "only the rank's shard exists, in its tier; `full` has 0-byte storage"
    GATHERED = "`full` holds every rank's shard on the compute device; parameters are readable"
    GATHERING = "an all-gather into `full` was issued ahead of use and has not been waited for"


class FlatUnit:
    """One unit on one rank: its shard, its full buffer, its parameter views.

    Owns: the low-precision shard (in `tier` under key (index, 'param')), `full` (compute
    device, compute dtype, padded_numel elements, storage freed between uses — see
    [Note: freeing by storage resize]) and the `nn.Parameter` views the module holds.
    Called from the thread that runs forward/backward only.
    """

    def __init__(
        self,
        index: int,
        name: str,
        layout: UnitLayout,
        tier: Tier,
        dtype: torch.dtype,
        device: torch.device,
        pg: _dist.ProcessGroupInfo,
        requires_grad: Sequence[bool],
    ) -> None:
        self.index = index
        self.name = name
        self.layout = layout
        self.tier = tier
        self.dtype = dtype
        self.device = device
        self.pg = pg
        self.key = (index, "param")
        self.state = UnitState.SHARDED
        self._gather_work: Any = None
        self.holds = 0
        """Holds taken outside training (`engine.gathered`, a submodule called alone, a state
        dict: offload/runtime/gathered.py). While > 0, `free()` leaves the unit as it is: the
        holder frees it when the last hold goes."""
        if self.key not in tier:
            tier.allocate(self.key, layout.shard_numel, dtype)
        shard = tier.view(self.key)
        # World size 1 with the shard already on the compute device: the shard *is* the
        # full buffer, so gather and free are no-ops and nothing is ever copied.
        self.aliased = (
            pg.world_size == 1 and shard is not None and shard.device == device
        )
        self._coll_device = _dist.collective_device(pg, device)
        if self.aliased:
            self.full = shard
            self.state = UnitState.GATHERED
        else:
            self.full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
        # Views are made while `full` has its bytes (set_ would otherwise grow the storage).
        self.params: list[nn.Parameter] = [
            UnitParameter(self._slot_view(s), requires_grad=rg)  # [Note: clipping refused]
            for s, rg in zip(layout.slots, requires_grad)
        ]
        if not self.aliased:
            _free_storage(self.full)

    def _slot_view(self, slot: ParamSlot) -> torch.Tensor:
        # A tensor on `full`'s storage with its *own* version counter (set_, not slicing):
        # gathering into `full` during backward must not look like an in-place change of
        # the parameters that autograd saved in forward — the bytes it restores are the
        # same ones. (A slice would share `full`'s counter and trip autograd's check.)
        view = torch.empty(0, dtype=self.dtype, device=self.device)
        stride = torch.empty(slot.shape, device="meta").stride()
        view.set_(self.full.untyped_storage(), self.full.storage_offset() + slot.offset, slot.shape, stride)
        return view

    # -- gather / free --------------------------------------------------------------------

    @property
    def shard(self) -> Optional[torch.Tensor]:
        return self.tier.view(self.key)

    @property
    def is_gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    def alloc_full(self) -> None:
        """Give the full buffer its bytes (a prefetch fills this rank's slot before the
        gather; see offload/runtime/schedule.py)."""
        _alloc_storage(self.full)

    def gather(self, local: Optional[torch.Tensor] = None, filled: bool = False) -> None:
        """Make every parameter readable on the compute device (idempotent).

        local: this rank's shard already fetched (a prefetched NVMe read, host memory), used
            instead of fetching from the tier. filled: this rank's slot of `full` already
            holds the shard (a prefetched copy, ordered before this call's stream work).
        """
        if self.state is UnitState.GATHERED:
            return
        if self.state is UnitState.GATHERING:
            self._finish_gather()
            return
        _alloc_storage(self.full)
        if self._coll_device == self.device:
            _dist.all_gather_into(self.full, self._own_shard(local, filled), self.pg)
        else:
            # gloo with a GPU compute device: gather in host memory, then one copy up.
            n, r = self.layout.shard_numel, self.pg.rank
            full_host = torch.empty(self.layout.padded_numel, dtype=self.dtype)
            slot = full_host[r * n : (r + 1) * n]
            if filled:
                slot.copy_(self.full[r * n : (r + 1) * n])
            elif local is not None:
                slot.copy_(local)
            else:
                wait(self.tier.fetch(self.key, slot))
            _dist.all_gather_into(full_host, slot, self.pg)
            self.full.copy_(full_host)
        self.state = UnitState.GATHERED

    def _own_shard(self, local: Optional[torch.Tensor], filled: bool) -> torch.Tensor:
        """This rank's shard on the compute device, for the all-gather: its slot of `full`
        (already filled, or filled now from `local` or from the tier), or the tier's own
        tensor when that is already on the compute device. `full` must have its bytes."""
        n, r = self.layout.shard_numel, self.pg.rank
        slot = self.full[r * n : (r + 1) * n]
        if filled:
            return slot
        if local is not None:
            slot.copy_(local)
            return slot
        own = self.tier.view(self.key)
        if own is not None and own.device == self.device:
            return own
        wait(self.tier.fetch(self.key, slot))  # stage into its slot, then gather in place
        return slot

    def start_gather(self, local: Optional[torch.Tensor] = None, filled: bool = False) -> bool:
        """Issue this unit's all-gather ahead of its use (the schedule's last stage; world
        size > 1, the collective on the compute device) and return; `gather()` then waits
        for it. Every rank must issue the same gathers in the same order, which the
        schedule guarantees by issuing them at the same trace positions. False when there
        is nothing to issue (gathered, in flight, or the gloo-with-GPU path). `local` is
        copied before this returns (the caller may reuse its buffer)."""
        if self.state is not UnitState.SHARDED or self.pg.world_size == 1:
            return False
        if self._coll_device != self.device:
            return False
        _alloc_storage(self.full)
        n, r = self.layout.shard_numel, self.pg.rank
        slot = self.full[r * n : (r + 1) * n]
        src = self._own_shard(local, filled)
        if src.data_ptr() != slot.data_ptr():
            slot.copy_(src)  # the collective reads its input later: not the live shard
        self._gather_work = _dist.all_gather_into(self.full, slot, self.pg, async_op=True)
        self.state = UnitState.GATHERING
        return True

    def _finish_gather(self) -> None:
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()
        self.state = UnitState.GATHERED

    @property
    def gathering(self) -> bool:
        return self.state is UnitState.GATHERING

    def free(self) -> None:
        """Release the full buffer (idempotent; a no-op when aliased to the shard). Also
        releases bytes a dropped prefetch allocated. A gather in flight completes first
        (the other ranks take part in it). A held unit stays (see `holds`)."""
        if self.aliased or self.holds:
            return
        if self.state is UnitState.GATHERING:
            self._finish_gather()
        _free_storage(self.full)
        self.state = UnitState.SHARDED

    def set_master_slot(self, si: int, value: torch.Tensor, master: torch.Tensor) -> None:
        """Copy this rank's part of parameter `si` from its full `value` into the fp32
        `master` shard (nothing when the parameter lies on other ranks)."""
        slot = self.layout.slots[si]
        if tuple(value.shape) != slot.shape:
            raise ValueError(
                f"parameter {slot.name!r}: got shape {tuple(value.shape)}, expected {slot.shape}"
            )
        part = self.layout.slot_in_shard(slot, self.pg.rank)
        if part is None:
            return
        p_off, s_off, n = part
        master[s_off : s_off + n].copy_(value.detach().reshape(-1)[p_off : p_off + n])

    def publish(self, master: torch.Tensor) -> None:
        """Write this unit's parameter shard (its dtype, its tier) from the fp32 `master`;
        a gathered copy is stale after it and is freed (re-gathered on next use). The one
        path from a master to the shard outside the optimizer's update (initialize, loads)."""
        shard = self.tier.view(self.key)
        if shard is not None and shard.data_ptr() == master.data_ptr():
            return  # fp32 on the CPU: the shard is the master
        wait(self.tier.store(self.key, master.to(self.dtype)))
        self.free()  # a gathered (or gathering) copy is stale; held or aliased units stay

    # -- gradients ------------------------------------------------------------------------

    def start_reduce_scatter(self, grad_shard: torch.Tensor, accumulate: bool) -> "GradReduce":
        """Average this unit's parameter gradients over ranks into `grad_shard` (fp32, the
        rank's shard, host), adding to it when `accumulate`; drop the full gradients, so
        the unit can be freed at once. With more than one rank the collective is only
        issued (it runs while backward goes on to earlier units) and `GradReduce.wait()`
        completes it; every rank must take part. `GradReduce.have[i]`: slot i had a local
        gradient."""
        params = self.params
        # torch's own getter: per parameter per micro-batch, past UnitParameter's check.
        grads = [_GRAD_OF(p) for p in params]
        have = [g is not None for g in grads]
        if self.pg.world_size == 1 and grad_shard.device == self.device:
            # One pass per gradient straight into the shard (compute on the CPU): copy on a
            # step's first micro-batch, add on later ones. Alignment gaps are never written
            # and stay zero from allocation.
            for p, s, g in zip(params, self.layout.slots, grads):
                dst = grad_shard[s.offset : s.end]
                if g is not None:
                    src = g.reshape(-1)
                    dst.add_(src) if accumulate else dst.copy_(src)
                    p.grad = None
                elif not accumulate:
                    dst.zero_()
            return GradReduce(have)
        # Gradients are reduced in fp32 whatever the compute dtype: averaging bf16 partial
        # sums across ranks would round each one to 8 bits of mantissa.
        flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self._coll_device)
        for p, s, g in zip(params, self.layout.slots, grads):
            if g is not None:
                flat[s.offset : s.end].copy_(g.reshape(-1))
                p.grad = None
        direct = not accumulate and grad_shard.device == self._coll_device
        out = grad_shard if direct else torch.empty(
            self.layout.shard_numel, dtype=torch.float32, device=self._coll_device
        )
        work = _dist.reduce_scatter_mean(out, flat, self.pg, async_op=self.pg.world_size > 1)
        return GradReduce(have, work, flat, None if direct else (out, grad_shard, accumulate))

    def full_bytes(self) -> int:
        """Bytes the full buffer holds right now (0 when freed or aliased)."""
        if self.aliased:
            return 0
        return self.full.untyped_storage().nbytes()


class GradReduce:
    """A unit's gradient reduce-scatter in flight (see `FlatUnit.start_reduce_scatter`).
    `have[i]`: slot i had a local gradient. `wait()` is idempotent."""

    __slots__ = ("have", "_work", "_flat", "_finish")

    def __init__(self, have: list[bool], work: Any = None, flat: Any = None, finish: Any = None) -> None:
        self.have = have
        self._work = work
        self._flat = flat  # the collective's input: alive until it completes
        self._finish = finish

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        self._flat = None
        if self._finish is not None:
            (out, grad_shard, accumulate), self._finish = self._finish, None
            if accumulate:
                grad_shard.add_(out.to(grad_shard.device))
            else:
                grad_shard.copy_(out)


def _free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    need = t.numel() * t.element_size()
    if storage.nbytes() != need:
        storage.resize_(need)


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
