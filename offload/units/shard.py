"""A unit on one rank: its shard, its full buffer, and the gather / reduce-scatter that move
it (`FlatUnit`). The layout arithmetic it runs on is `offload.units.layout` (re-exported
here): the shard in its tier, the full flat buffer on the compute device, and the
parameters as views into that buffer. What a unit with frozen parameters keeps where:
[Note: frozen parameters cost their shard only] in offload/units/layout.py.

[Note: freeing by storage resize]
The parameters the module holds are `nn.Parameter` views into `full`. To free the unit we
resize `full`'s untyped storage to 0 bytes, and to gather we resize it back and all-gather
into it. The tensor objects never change, so parameters the module holds and tensors that
autograd saved for backward stay valid: after a re-gather they see the same bytes again.
(FSDP2 frees its all-gather output the same way.)
"""

from __future__ import annotations

import enum
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from offload.device_runtime import runtime
from offload.devices import same_device
import offload.units.collectives as _dist
from offload.storage.nvme import wait_quietly
from offload.storage.tiers import Handle, Tier, wait
from offload.units.layout import (
    FROZEN_GROUP,
    PARAM_ALIGN_ELEMS,
    SHARD_ALIGN_ELEMS,
    ParamSlot,
    Segment,
    UnitLayout,
    UpdateRun,
    intersect,
    layout_unit,
    update_runs,
)
from offload.units.full_buffers import CAN_POINT, FullBuffers
from offload.units.grad_reduce import AcrossReplicas, GradReduce, IntoShard
from offload.units.hybrid import (ReplicaMean, all_gather_unit, all_reduce_unit, reduce_scatter_unit,
                                  secondary_for)
from offload.units.parameter import UnitParameter
from offload.units.storage_bytes import alloc_storage as _alloc_storage, free_storage as _free_storage

__all__ = ["FlatUnit", "GradReduce", "UnitState", "FROZEN_GROUP", "PARAM_ALIGN_ELEMS",
           "SHARD_ALIGN_ELEMS", "ParamSlot", "Segment", "UnitLayout", "UpdateRun", "intersect",
           "layout_unit", "update_runs"]

# torch's stubs declare `grad` a plain attribute; at run time it is the C getset descriptor.
_GRAD_OF = torch._C.TensorBase.grad.__get__  # type: ignore[union-attr]
"""torch's `.grad` getter, without a subclass's property in between."""


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
        resident: bool = False,
        all_reduce_grads: bool = False,
        full_buffers: Optional[FullBuffers] = None,
    ) -> None:
        self.index = index
        self.resident = resident
        """ZeRO stages 1 and 2 ([Note: resident parameters]): the full buffer stays gathered
        between uses; `free()` leaves it, `invalidate()` marks it stale when the shard
        changes (the next use gathers it again, into the same memory)."""
        self.all_reduce_grads = all_reduce_grads
        """ZeRO stage 1: gradients are all-reduced (every rank gets the whole average) and
        the rank keeps its partition, instead of reduce-scattered."""
        self.name = name
        self.layout = layout
        self.tier = tier
        self.dtype = dtype
        self.device = device
        self.pg = pg
        self.key = (index, "param")
        self.master_numel = layout.shard_master_numel(pg.rank)
        """Shard-local elements [0, master_numel) have an fp32 master (and gradient shard);
        the rest, the frozen suffix, lives in the tier only ([Note: frozen parameters cost
        their shard only])."""
        self.state = UnitState.SHARDED
        self.secondary = secondary_for(pg, layout.padded_numel)
        """hpZ's node-local copy ([Note: hpZ's secondary copy] in offload/units/hybrid.py)."""
        self._gather_work: Optional[dist.Work] = None
        self.holds = 0
        """Holds taken outside training (`engine.gathered`, a submodule called alone, a state
        dict: offload/runtime/gathered.py). While > 0, `free()` leaves the unit as it is: the
        holder frees it when the last hold goes."""
        if self.key not in tier:
            tier.allocate(self.key, layout.shard_numel, dtype)
        shard = tier.view(self.key)
        # World size 1 with the shard already on the compute device: the shard *is* the
        # full buffer, so gather and free are no-ops and nothing is ever copied.
        if pg.world_size != 1 or shard is None or not same_device(shard.device, device):
            shard = None
        self.aliased = shard is not None
        self._coll_device = _dist.collective_device(pg, device)
        self.full: torch.Tensor
        if shard is not None:
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
        self._buffers = (full_buffers if full_buffers is not None and not self.aliased
                         and pg.world_size == 1 and device.type == "cpu" and CAN_POINT else None)
        """Where the full buffer's bytes come from and go back to ([Note: reused full
        buffers] in offload/units/full_buffers.py); None: the CPU allocator."""
        self._full_buf: Optional[torch.Tensor] = None
        self._reading: Handle = None
        """A read of the shard straight into `full` in flight (`start_read`), or None."""

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
        if self._buffers is None:
            _alloc_storage(self.full)
        elif self._full_buf is None:
            self._full_buf = self._buffers.point(self.full)

    @property
    def reads_into_full(self) -> bool:
        """Whether the shard can be read from its tier straight into `full` ahead of the
        gather (world size 1 on the CPU: `full` is page-aligned memory from `FullBuffers`,
        and the shard is all of it)."""
        return self._buffers is not None and not self.tier.addressable

    def start_read(self) -> Handle:
        """Start reading the shard into `full` (its bytes given first); returns the read's
        handle. Until `finish_read`, freeing `full` waits for the read (it lands in these
        bytes), and a change of the shard (`invalidate`) drops it."""
        self.alloc_full()
        self._reading = self.tier.fetch(self.key, self.full[: self.layout.shard_numel])
        return self._reading

    def reading(self, handle: Handle) -> bool:
        """Whether `handle` (from `start_read`) still fills `full` (not dropped with it)."""
        return handle is not None and self._reading is handle

    def finish_read(self, handle: Handle) -> None:
        """Wait for the read `handle`: the shard is in `full` (the gather finds it filled)."""
        try:
            wait(handle)
        finally:
            if self._reading is handle:
                self._reading = None

    def _drop_full(self) -> None:
        """Give the full buffer's bytes back (to `FullBuffers`, or the allocator), after a
        read into them in flight has landed."""
        reading, self._reading = self._reading, None
        if reading is not None:
            wait_quietly([reading])
        if self._full_buf is not None:
            assert self._buffers is not None, "a pointed full buffer came from FullBuffers"
            self._buffers.unpoint(self.full, self._full_buf)
            self._full_buf = None
        else:
            _free_storage(self.full)

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
        self.alloc_full()
        if same_device(self._coll_device, self.device):
            all_gather_unit(self.full, self._own_shard(local, filled), self.pg, self.secondary)
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
            all_gather_unit(full_host, slot, self.pg, self.secondary)
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
            # From pinned memory the copy is queued, not waited for (F8): the caller gives
            # the buffer back only after an event recorded behind it.
            slot.copy_(local, non_blocking=local.is_pinned())
            return slot
        own = self.tier.view(self.key)
        if own is not None and same_device(own.device, self.device):
            return own
        wait(self.tier.fetch(self.key, slot))  # stage into its slot, then gather in place
        return slot

    def start_gather(self, local: Optional[torch.Tensor] = None, filled: bool = False) -> bool:
        """Issue this unit's all-gather ahead of its use (the schedule's last stage; world
        size > 1, the collective on the compute device) and return; `gather()` then waits
        for it. Every rank must issue the same gathers in the same order, which the
        schedule guarantees by issuing them at the same trace positions. False when there
        is nothing to issue (gathered, in flight, or the gloo-with-GPU path). `local`
        (pinned) is read by stream work queued by this call: the caller keeps it until an
        event recorded after the call completes (`_own_shard`)."""
        if self.state is not UnitState.SHARDED or self.pg.world_size == 1:
            return False
        if not same_device(self._coll_device, self.device):
            return False
        self.alloc_full()
        n, r = self.layout.shard_numel, self.pg.rank
        slot = self.full[r * n : (r + 1) * n]
        src = self._own_shard(local, filled)
        if src.data_ptr() != slot.data_ptr():
            slot.copy_(src)  # the collective reads its input later: not the live shard
        self._gather_work = all_gather_unit(self.full, slot, self.pg, self.secondary, async_op=True)
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

    @property
    def is_sharded(self) -> bool:
        """Only the shard exists: nothing gathered, no gather in flight (the one state in
        which fetching the shard ahead makes sense)."""
        return self.state is UnitState.SHARDED

    def free(self) -> None:
        """Release the full buffer (idempotent; a no-op when aliased to the shard, and for a
        resident unit: stages 1 and 2). Also releases bytes a dropped prefetch allocated. A
        gather in flight completes first (the other ranks take part in it). A held unit
        stays (see `holds`)."""
        if self.aliased or self.holds or self.resident:
            return
        self.release()

    def invalidate(self) -> None:
        """The shard changed (or is about to): a gathered copy is stale. A resident unit
        keeps its memory and gathers into it at its next use; any other is freed."""
        if self.secondary is not None:  # hpZ's copy is stale too, held unit or not
            if self.state is UnitState.GATHERING:
                self._finish_gather()  # it would keep a copy of the old values
            self.secondary.drop()
        if self.aliased or self.holds:
            return
        if not self.resident:
            self.release()
            return
        if self.state is UnitState.GATHERING:
            self._finish_gather()
        self.state = UnitState.SHARDED

    def release(self) -> None:
        """Give the full buffer's memory back, resident or not (close, failure)."""
        if self.aliased or self.holds:
            return
        if self.state is UnitState.GATHERING:
            self._finish_gather()
        self._drop_full()
        self.state = UnitState.SHARDED

    # -- values in and out ------------------------------------------------------------------

    @property
    def frozen_numel(self) -> int:
        """Elements of this rank's shard past the master: frozen values and padding."""
        return self.layout.shard_numel - self.master_numel

    def read_frozen(self) -> torch.Tensor:
        """This rank's frozen suffix of the parameter shard, in the compute dtype, in host
        memory: the tier's own memory when it is host memory (a write into it changes the
        shard), else a copy (of a device shard, or read from NVMe)."""
        n = self.master_numel
        shard = self.tier.view(self.key)
        if shard is not None:
            return shard[n:] if shard.device.type == "cpu" else shard[n:].cpu()
        if not self.frozen_numel:
            return torch.empty(0, dtype=self.dtype)
        from offload.storage.io import aligned_empty

        # Page-aligned: the NVMe tier reads straight into it, without its staging pool.
        buf = aligned_empty(self.layout.shard_numel * self.dtype.itemsize, self.dtype, pin=False)
        wait(self.tier.fetch(self.key, buf))
        return buf[n:]

    def frozen_buffer(self) -> torch.Tensor:
        """Host memory for new values of the frozen suffix (compute dtype), then handed to
        `publish`: the shard's own memory when it is host memory, else a zeroed buffer
        (nothing is read)."""
        shard = self.tier.view(self.key)
        if shard is not None and shard.device.type == "cpu":
            return shard[self.master_numel :]
        return torch.zeros(self.frozen_numel, dtype=self.dtype)

    def shard_values(self, master: torch.Tensor) -> torch.Tensor:
        """This rank's whole shard in fp32: `master` (the optimized prefix) and the frozen
        suffix cast up (exact); `master` itself when it covers the whole shard."""
        n, total = self.master_numel, self.layout.shard_numel
        if n == total:
            return master
        out = torch.empty(total, dtype=torch.float32)
        out[:n].copy_(master[:n])
        out[n:].copy_(self.read_frozen())
        return out

    def set_slot(self, si: int, value: torch.Tensor, master: torch.Tensor,
                 frozen: Optional[torch.Tensor] = None, merge: bool = False) -> None:
        """Copy this rank's part of parameter `si` from its full `value`: an optimized
        parameter's into the fp32 `master`, a frozen one's into `frozen` (the shard's frozen
        suffix, compute dtype: `read_frozen()`, or a buffer later given to `publish`);
        nothing when the parameter lies on other ranks. `merge`: only the elements where
        `value` differs from the current one rounded to `value`'s dtype ([Note: writing a
        rank's edits back] in offload/runtime/gathered.py); an fp32 value is written whole."""
        slot = self.layout.slots[si]
        if tuple(value.shape) != slot.shape:
            raise ValueError(
                f"parameter {slot.name!r}: got shape {tuple(value.shape)}, expected {slot.shape}"
            )
        part = self.layout.slot_in_shard(slot, self.pg.rank)
        if part is None:
            return
        p_off, s_off, n = part
        if slot.group == FROZEN_GROUP:
            assert frozen is not None and s_off >= self.master_numel, (slot.name, s_off)
            dst = frozen[s_off - self.master_numel : s_off - self.master_numel + n]
        else:
            dst = master[s_off : s_off + n]
        src = value.detach().reshape(-1)[p_off : p_off + n]
        if not merge:
            dst.copy_(src)
            return
        src = src.cpu()
        changed = src != dst.to(src.dtype)
        dst[changed] = src[changed].to(dst.dtype)

    def write_slots(self, values: Iterable[tuple[int, torch.Tensor]], master: torch.Tensor,
                    merge: bool = False) -> None:
        """`set_slot` for each (slot index, full value), then `publish`: the shard's frozen
        suffix is read, changed and written back only when a frozen parameter this rank
        holds part of is among them."""
        frozen = None
        for si, value in values:
            slot = self.layout.slots[si]
            if (frozen is None and slot.group == FROZEN_GROUP
                    and self.layout.slot_in_shard(slot, self.pg.rank) is not None):
                frozen = self.read_frozen()
            self.set_slot(si, value, master, frozen, merge)
        self.publish(master, frozen)

    def publish(self, master: torch.Tensor, frozen: Optional[torch.Tensor] = None) -> None:
        """Write this unit's parameter shard (its dtype, its tier) from the fp32 `master`
        (the prefix [0, master_numel)) and, given `frozen` (the suffix's values; rounded
        once to the compute dtype), its frozen suffix too; without `frozen` the suffix keeps
        its bytes. A gathered copy is stale after it and is freed (re-gathered on next use).
        The one path from a master to the shard outside the optimizer's update (initialize,
        loads)."""
        n = self.master_numel
        shard = self.tier.view(self.key)
        wrote = False
        if frozen is not None and self.frozen_numel and shard is not None:
            dst = shard[n:]
            if dst.data_ptr() != frozen.data_ptr():
                dst.copy_(frozen)  # addressable: in place (nothing to do when it is that memory)
            frozen, wrote = None, True
        if shard is not None and shard.data_ptr() == master.data_ptr():
            if wrote:
                self.invalidate()
            return  # fp32 on the CPU: the master is the shard's prefix
        if frozen is not None and self.frozen_numel:
            whole, buf = self._publish_buffer(self.layout.shard_numel)
            try:
                whole[:n].copy_(master[:n])
                whole[n:].copy_(frozen)
                wait(self.tier.store(self.key, whole))
            finally:
                self._publish_done(buf)
        elif n and master.dtype == self.dtype:
            wait(self.tier.store_prefix(self.key, master[:n]))
        elif n:
            low, buf = self._publish_buffer(n)
            try:
                wait(self.tier.store_prefix(self.key, low.copy_(master[:n])))
            finally:
                self._publish_done(buf)
        self.invalidate()  # a gathered (or gathering) copy is stale; held or aliased units stay

    def _publish_buffer(self, numel: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the low-precision copy `publish` writes, the `FullBuffers` buffer it lies in to
        give back, or None: the CPU allocator's).

        [Note: publish copies from reused buffers]
        `initialize` publishes every unit once. Fresh copies come from glibc's heap (under its
        32 MiB mmap threshold) and stay there when freed: a 3.5 GB bf16 checkpoint (154 units,
        22.6 MB copies) peaked 340-455 MiB above its baseline, run to run, against the 310 MiB
        docs/hf.md bounds (OOM-killed under that limit: tools/load_under_limit.py); fresh
        mappings instead fault every page in again (1.5x the load time). So at world size 1
        on the CPU the copy goes into a reused full buffer, page-aligned (the NVMe tier writes
        it by O_DIRECT without a staging copy) and given back at once: 245 MiB, and a faster
        publish. Elsewhere (world size > 1, a GPU) the copy is the allocator's, as before."""
        if self._buffers is None:
            return torch.empty(numel, dtype=self.dtype), None
        nbytes = numel * self.dtype.itemsize
        buf = self._buffers.take(nbytes)
        return buf[:nbytes].view(self.dtype), buf

    def _publish_done(self, buf: Optional[torch.Tensor]) -> None:
        if buf is not None:
            assert self._buffers is not None, "a publish buffer came from FullBuffers"
            self._buffers.give(buf)

    # -- gradients ------------------------------------------------------------------------

    def start_reduce_scatter(self, grad_shard: torch.Tensor, accumulate: bool,
                             replicas: ReplicaMean = ReplicaMean.NOW) -> "GradReduce":
        """Average this unit's parameter gradients over ranks into `grad_shard` (fp32, host:
        the rank's shard up to `master_numel`), adding to it when `accumulate`; drop the full gradients, so
        the unit can be freed at once. With more than one rank the collective is only
        issued (it runs while backward goes on to earlier units) and `GradReduce.wait()`
        completes it; every rank must take part. `GradReduce.have[i]`: slot i had a local
        gradient. HSDP: `replicas` says whether the result is averaged across the replicas
        now ([Note: HSDP averages once per step] in units/hybrid.py)."""
        params = self.params
        # torch's own getter: per parameter per micro-batch, past UnitParameter's check.
        grads = [_GRAD_OF(p) for p in params]
        have = [g is not None for g in grads]
        on_host = not runtime().has_streams(self.device)  # else the shard is host memory beside a GPU
        if self.pg.world_size == 1 and on_host and same_device(grad_shard.device, self.device):
            # One pass per gradient straight into the shard (compute on the CPU): copy on a
            # step's first micro-batch, add on later ones. Alignment gaps are never written
            # and stay zero from allocation.
            for p, s, g in zip(params, self.layout.slots, grads):
                if s.group == FROZEN_GROUP:  # no gradient shard past the master's prefix
                    p.grad = None
                    continue
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
                if s.group != FROZEN_GROUP:  # not kept: zeros go through the collective
                    flat[s.offset : s.end].copy_(g.reshape(-1))
                p.grad = None
        # The collective's output is the whole shard; the gradient shard may be only its
        # prefix (a unit with frozen parameters): then it is copied out on completion.
        direct = (not accumulate and not runtime().has_streams(self._coll_device)
                  and same_device(grad_shard.device, self._coll_device)
                  and grad_shard.numel() == self.layout.shard_numel)
        if self.pg.world_size == 1 and not direct:
            # No collective: the flat buffer is the result, copied out from where it is (no
            # second buffer of its size on the device: issue #30, F6).
            return GradReduce(have, None, None, IntoShard(flat[: self.layout.shard_numel], grad_shard, accumulate))
        out = grad_shard if direct else torch.empty(
            self.layout.shard_numel, dtype=torch.float32, device=self._coll_device
        )
        if self.all_reduce_grads and self.pg.world_size > 1:
            # Stage 1: every rank gets the whole average; this rank keeps its partition.
            lo, hi = self.layout.shard_range(self.pg.rank)
            work = all_reduce_unit(flat, self.pg, async_op=True)
            return GradReduce(have, work, flat, IntoShard(flat[lo:hi], grad_shard, accumulate))
        work = reduce_scatter_unit(out, flat, self.pg, async_op=self.pg.world_size > 1)
        across = (AcrossReplicas(out, self.pg, replicas is ReplicaMean.FOLD)
                  if replicas in (ReplicaMean.NOW, ReplicaMean.FOLD) else None)
        return GradReduce(have, work, flat, None if direct else IntoShard(out, grad_shard, accumulate), across)

    def full_bytes(self) -> int:
        """Bytes the full buffer holds right now (0 when freed or aliased)."""
        if self.aliased:
            return 0
        return self.full.untyped_storage().nbytes()
