"""Where the optimizer state of each unit lives: host memory or a swap file on NVMe.

A unit's state on this rank is its fp32 master (the shard up to its frozen parameters:
[Note: frozen parameters cost their shard only] in offload/units/layout.py), and the
optimizer's named state tensors over the shard's optimized prefix (Adam's `exp_avg` and
`exp_avg_sq`, Lion's `exp_avg`, Adagrad's `sum`: offload/optim/kinds.py); a unit with no
optimized parameter has none (empty tensors, no I/O). Two stores keep it:

- `HostOptimizerStates`: tensors in CPU memory (the `UnitOptimizerState` fields).
- `NVMeOptimizerStates`: one slot per unit in the rank's `optim` swap file, laid out by
  `state_layout` so that one sequential read and one write move the whole state; the step
  streams units through pooled staging buffers (see [Note: optimizer pipeline]).

Both offer the same methods, the `OptimizerStates` interface (offload/storage/state_store.py),
so nothing above asks which store it holds (`resident` says
whether the tensors live in host memory, for callers that may then use them in place):
- `open(index, write=False)`: a context yielding the unit's tensors (for checkpoints,
  consolidation, loading); with `write=True` what the caller changed is written back on exit.
- `stream(indices, scratch_bytes)`: the step's pipeline over units, yielding each unit's
  tensors in order, plus `scratch` bytes beside them for the new low-precision shard;
  `checkout` / `checkin` the same for one unit (the optimizer in backward);
- `prefetch(...)` / `cancel_prefetch()`: reads of the next units' state started ahead (a
  no-op in host memory), in buffers the pinned pool may take back ([Note: evictable leases]
  in offload/storage/nvme.py): a read it took back is made again when the unit is needed;
- `initialized(index, unit_state)`: the unit's master is complete (`offload.initialize`);
- `memory_tensors()` / `bytes_on_disk()`: what it holds, for accounting.

Gradient shards are not here: they stay in host memory (fp32, 4 bytes per element of the
master), written by the reduce-scatter during backward and read by the update.

[Note: optimizer pipeline]
With the state on NVMe, the step reads unit i+1's state while the CPU Adam updates unit i,
while unit i-1's state (and its new parameter shard) is written back:

    iteration i: ensure read(i) submitted -> try to submit read(i+1) -> wait read(i)
                 -> caller updates unit i -> submit write(i) (tracked, buffer held)

Reads and writes are asynchronous AIO requests; their buffers come from the staging pool
(`offload.storage.nvme.Staging`). The read of i+1 is submitted only when a buffer is free without
waiting (else it is submitted next iteration, after the oldest writes have been waited for),
so the pipeline overlaps as deep as the budget allows: 3 units' working sets give the full
read / update / write overlap, 1 runs the stages one after another. Writes are not waited for
at the end of the step: they finish behind the next forward, and anything that reads a slot
first waits on its last write ([Note: slot ordering] in offload/storage/nvme.py).

[Note: adopted state]
A checkpoint load at the saving world size, with the same layout and dtypes, finds each
unit's state in the checkpoint exactly as the slot holds it: master and moments each a
page-aligned run of bytes in the rank's shard file. Copying them into the swap file would
make every byte cross the disk twice (read, write) for nothing: the unit's next update
reads its state and writes it back anyway. So the load verifies every chunk's checksum as
before and then `adopt`s the unit: the store records where its tensors lie in the
checkpoint file (`StateSource`), holds the file open ([Note: held files] in
offload/storage/nvme.py), and reads from there instead of the slot. The unit's next write (its
first update, a load, `initialize`) goes to the slot as always and drops the source, so
after one step nothing refers to the checkpoint any more. A load then costs one read of the
state instead of a read and a write.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Optional, Sequence

import torch

from offload.sizes import ALIGNMENT, align_up
from offload.storage.state_layout import (ADAM_STATE, StateLayout, StateSpec, UnitTensors, state_layout,
                                          uniform_specs)
from offload.storage.io import Completion, IORequest
from offload.storage.nvme import Lease, NVMeContext, Pending, Staging, settle_writes, wait_quietly
from offload.storage.state_store import OptimizerStates, UnitState

__all__ = ["ADAM_STATE", "HostOptimizerStates", "NVMeOptimizerStates", "StateLayout", "StateSource",
           "UnitTensors", "state_layout"]


@dataclass(frozen=True)
class StateSource:
    """Where an adopted unit's state lies outside the swap file: `parts` are
    (file offset, offset in the slot layout, bytes) runs of `path`, all 4 KiB-aligned."""

    path: str
    parts: tuple[tuple[int, int, int], ...]


class HostOptimizerStates(OptimizerStates):
    """Optimizer state in host memory: the tensors of each `UnitOptimizerState`."""

    resident = True
    """The state's tensors live in host memory: `open` hands out the live tensors."""

    def __init__(self, states: Sequence[UnitState], staging: Optional[Staging] = None) -> None:
        self._states = states
        self._staging = staging
        """The NVMe staging pool when the parameter tier is on NVMe (scratch comes from it)."""

    def _tensors(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        st = self._states[index]
        # Units whose state is on NVMe hold no host tensors; a split store sends them to the
        # NVMe store, so a host store is only ever asked for units it holds.
        assert st.master is not None and st.moments is not None, f"unit {index}: state not in host memory"
        return st.master, st.moments

    def resident_at(self, index: int) -> bool:
        """Whether unit `index`'s state lives in host memory: always, here."""
        return True

    def initialize(self, index: int, master: torch.Tensor) -> None:
        own, _ = self._tensors(index)
        if own is not master:
            own.copy_(master)

    def initialized(self, index: int, unit_state: UnitState) -> None:
        """Unit `index`'s master is complete: nothing to do, it already is the state."""

    @contextlib.contextmanager
    def open(self, index: int, write: bool = False, overwrite: bool = False) -> Iterator[UnitTensors]:
        yield UnitTensors(*self._tensors(index))

    def stream(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int]
    ) -> Iterator[tuple[int, UnitTensors]]:
        for i in indices:
            t = self.checkout(i, scratch_bytes(i))
            try:
                yield i, t
            except BaseException:
                self.abandon(i, t)
                raise
            self.checkin(i, t)

    def checkout(self, index: int, scratch_bytes: int) -> UnitTensors:
        """Unit `index`'s tensors for one update (the optimizer-in-backward path), with
        `scratch_bytes` of pooled scratch; give them back with `checkin` (or `abandon`)."""
        master, moments = self._tensors(index)
        buf = None
        if scratch_bytes:
            if self._staging is None:
                raise RuntimeError("scratch bytes asked of a host store without a staging pool")
            buf = self._staging.acquire(scratch_bytes)
        return UnitTensors(master, moments, scratch=buf,
                           _buffers=() if buf is None else (buf,))

    def checkin(self, index: int, t: UnitTensors) -> None:
        if t._buffers:
            staging, buf = self._staging, t._buffers[0]
            assert staging is not None, "pooled scratch comes from the staging pool (checkout)"
            staging.track(Pending(t.holds, release=lambda: staging.release(buf)))
        else:
            for h in t.holds:
                h.wait()

    def abandon(self, index: int, t: UnitTensors) -> None:
        wait_quietly(t.holds)
        if t._buffers:
            assert self._staging is not None, "pooled scratch comes from the staging pool (checkout)"
            self._staging.release(t._buffers[0])

    def checkout_overwrite(self, index: int) -> UnitTensors:
        raise ValueError(f"unit {index}'s optimizer state is in host memory: fill it in place")

    def adopt(self, index: int, t: UnitTensors, path: str, file_offsets: dict[str, int]) -> None:
        raise ValueError(f"unit {index}'s optimizer state is in host memory: nothing to adopt")

    def prefetch(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int], limit: int = 2
    ) -> None:
        """Nothing to read ahead: the state is in memory."""

    def cancel_prefetch(self, index: Optional[int] = None) -> None:
        pass

    def settle(self) -> None:
        """After a failed step: nothing in flight (the state is in memory)."""

    def write_failure(self) -> Optional[BaseException]:
        """None: state in memory is never lost to a failed write."""
        return None

    def bytes_on_disk(self) -> int:
        return 0

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each state tensor with its accounting bucket: all 'host'."""
        for st in self._states:
            for t in (st.master, *(st.moments or {}).values()):
                if t is not None:
                    yield "host", t


class _SourceRead:
    """A read of an adopted unit's state from its checkpoint file, whose failure names that
    file (the request itself only knows `/proc/self/fd/N`) and what to do."""

    __slots__ = ("req", "index", "path")

    def __init__(self, req: IORequest, index: int, path: str) -> None:
        self.req, self.index, self.path = req, index, path

    def done(self) -> bool:
        return self.req.done()

    def wait(self) -> None:
        try:
            self.req.wait()
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"reading unit {self.index}'s optimizer state from the checkpoint file it was "
                f"loaded from, {self.path!r} (read in place until the unit's first update), "
                f"failed: {exc.strerror or exc}. The file was changed or damaged after "
                "load_checkpoint; load the checkpoint again (copy_to_swap=True copies the "
                "state into the swap file during the load)",
                self.path,
            ) from exc


class NVMeOptimizerStates(OptimizerStates):
    """Optimizer state in the rank's `optim` swap file, one slot per unit (`state_layout`).

    Nothing of it stays in host memory between uses: `open` and `stream` read a unit into a
    staging buffer, and write it back from there. See [Note: optimizer pipeline].
    """

    resident = False
    """The state lives on disk: `open` hands out pooled copies, valid inside the context."""

    def __init__(
        self,
        context: NVMeContext,
        sizes: Sequence[tuple[int, int]],
        specs: Sequence[StateSpec] = uniform_specs(ADAM_STATE, torch.float32),
    ) -> None:
        self._ctx = context
        self.specs = tuple(specs)
        """The optimizer's state tensors per unit (offload/optim/kinds.py `state_specs`)."""
        self.names = tuple(s.name for s in self.specs)
        self.layouts = [state_layout(m, n, self.specs) for m, n in sizes]
        self._swap = context.directory.create("optim", [lay.nbytes for lay in self.layouts])
        self._last_write: list[Optional[Pending]] = [None] * len(self.layouts)
        self._prefetched: dict[int, tuple[Lease, Pending]] = {}
        """Reads submitted ahead of the step (`prefetch`) into leased buffers the pool may
        take back, consumed by `stream` / `checkout`."""
        self._sources: dict[int, StateSource] = {}
        """Adopted units: where their state is read from until their next write
        ([Note: adopted state])."""

    @property
    def path(self) -> str:
        return self._swap.path

    def resident_at(self, index: int) -> bool:
        """Whether unit `index`'s state lives in host memory: never, here."""
        return False

    def bytes_on_disk(self) -> int:
        return self._swap.total_bytes

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """None: the state is on disk (its staging buffers count as 'pinned')."""
        return iter(())

    # -- one unit --------------------------------------------------------------------------

    def initialize(self, index: int, master: torch.Tensor) -> None:
        """Write unit `index`'s first state: `master`, state tensors at their zero
        (`StateSpec.zero`; the write runs on; one that starts elsewhere, Adagrad's sum, is
        filled by the optimizer afterwards)."""
        lay = self.layouts[index]
        if not lay.nbytes:
            return  # no optimized parameter: no state
        buf = self._ctx.staging.acquire(lay.nbytes)
        try:
            t = self._views(index, buf)
            t.master.copy_(master)
            for spec in self.specs:
                t.moments[spec.name].fill_(spec.zero)
        except BaseException:
            self._ctx.staging.release(buf)
            raise
        self._write(index, buf, [])

    def initialized(self, index: int, unit_state: UnitState) -> None:
        """Unit `index`'s master is complete (`offload.initialize`): write its first state
        (`initialize`) and drop the host master, which the swap slot now holds."""
        assert unit_state.master is not None, f"unit {index}: no host master to write"
        self.initialize(index, unit_state.master)
        unit_state.master = None

    @contextlib.contextmanager
    def open(self, index: int, write: bool = False, overwrite: bool = False) -> Iterator[UnitTensors]:
        """`overwrite` (with `write`): the caller sets every tensor, so the slot is not read
        first (`checkout_overwrite`: a checkpoint load writes the state without reading the
        one it replaces). Otherwise the unit is read (`checkout`)."""
        if not self.layouts[index].nbytes:
            yield self._views(index, torch.empty(0, dtype=torch.uint8))  # no state, no I/O
            return
        t = self.checkout_overwrite(index) if overwrite and write else self.checkout(index, 0)
        try:
            yield t
        except BaseException:
            self.abandon(index, t)
            raise
        if write:
            self.checkin(index, t)
            return
        try:
            for h in t.holds:
                h.wait()
        finally:
            self._ctx.staging.release(t._buffers[0])

    def checkout(self, index: int, scratch_bytes: int) -> UnitTensors:
        """Unit `index`'s state for one update (the optimizer-in-backward path): from the
        read `prefetch` started, else read now. Give it back with `checkin` (write-back,
        not waited for) or `abandon` (after an error: nothing written)."""
        if not self.layouts[index].nbytes and not scratch_bytes:
            return self._views(index, torch.empty(0, dtype=torch.uint8))  # no state here
        entry = None
        ahead = self._prefetched.pop(index, None)
        if ahead is not None:
            lease, handle = ahead
            buf = lease.claim()  # None: the pool took it back, read again
            if buf is not None and buf.numel() < self.layouts[index].nbytes + align_up(scratch_bytes):
                wait_quietly([handle])  # prefetched without room for scratch: read again
                self._ctx.staging.release(buf)
            elif buf is not None:
                entry = (buf, handle)
        if entry is None:
            buf = self._ctx.staging.acquire(self.layouts[index].nbytes + align_up(scratch_bytes))
            try:
                entry = (buf, self._read(index, buf))
            except BaseException:
                self._ctx.staging.release(buf)
                raise
        buf, handle = entry
        try:
            handle.wait()
        except BaseException:
            self._ctx.staging.release(buf)
            raise
        return self._views(index, buf, scratch_bytes)

    def checkin(self, index: int, t: UnitTensors) -> None:
        if not t._buffers:  # a unit without state
            wait_quietly(t.holds)
            return
        self._write(index, t._buffers[0], t.holds)

    def checkout_overwrite(self, index: int) -> UnitTensors:
        """A pooled buffer laid out as unit `index`'s slot, not read (the caller fills every
        tensor: a checkpoint load reads its chunks straight into it); `checkin` writes it."""
        if not self.layouts[index].nbytes:
            return self._views(index, torch.empty(0, dtype=torch.uint8))
        self.cancel_prefetch(index)
        self._wait_write(index)  # the new write must land after the old one
        buf = self._ctx.staging.acquire(self.layouts[index].nbytes)
        return self._views(index, buf)

    def abandon(self, index: int, t: UnitTensors) -> None:
        wait_quietly(t.holds)
        if t._buffers:
            self._ctx.staging.release(t._buffers[0])

    def adopt(self, index: int, t: UnitTensors, path: str, file_offsets: dict[str, int]) -> None:
        """Finish a `checkout_overwrite` without writing: `t` holds the bytes that lie in
        `path` at `file_offsets` ("master" and each state name: where each tensor
        starts, padded to 4 KiB as in the slot; the caller read and verified them there), so
        the unit is read from that file until its next write ([Note: adopted state]). The
        buffer goes back once `t.holds` are done."""
        lay = self.layouts[index]
        if not lay.nbytes:
            self.checkin(index, t)  # nothing to read, ever
            return
        n_master = align_up(lay.master_numel * 4)
        places = [("master", 0, n_master)]
        places += [(s.name, at, align_up(lay.nbytes_of(s))) for s, at in zip(lay.specs, lay.offsets)]
        parts = tuple((int(file_offsets[name]), at, n) for name, at, n in places if n)
        if any(fo % ALIGNMENT for fo, _, _ in parts):
            self.abandon(index, t)
            raise ValueError(f"unit {index}: offsets {file_offsets} in {path!r} are not 4 KiB-aligned")
        self._drop_source(index)
        self._ctx.files.hold(path)
        self._sources[index] = StateSource(path, parts)
        self._swap.mark_written(index)  # readable: from its source
        staging = self._ctx.staging
        buf = t._buffers[0]
        staging.track(Pending(t.holds, release=lambda: staging.release(buf)))

    def adopted(self) -> list[int]:
        """Units read from a checkpoint file until their next write."""
        return sorted(self._sources)

    # -- the step's pipeline ------------------------------------------------------------------

    def prefetch(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int], limit: int = 2
    ) -> None:
        """Submit the reads of the first `limit` units of the coming `stream(indices, ...)`
        now, where buffers are free without waiting: the engine calls it before the overflow
        check and the gradient norm, which the reads then overlap. A write of one of these
        units before the step drops its read (`_write`); `cancel_prefetch` drops them all.
        The buffers are leases: the pool may take them back for a buffer needed now
        ([Note: evictable leases] in offload/storage/nvme.py); such a unit is read again when
        its update comes."""
        staging = self._ctx.staging
        for i in list(indices)[:limit]:
            if not self.layouts[i].nbytes:
                continue  # no state on this rank: nothing to read
            ahead = self._prefetched.get(i)
            if ahead is not None and ahead[0].held:
                continue
            lease = staging.lease(self.layouts[i].nbytes + align_up(scratch_bytes(i)))
            if lease is None:
                return
            assert lease.buffer is not None, "a new lease is HELD: it has its buffer"
            try:
                handle = self._read(i, lease.buffer)
            except BaseException:
                lease.release()
                raise
            lease.attach(handle)
            self._prefetched[i] = (lease, handle)

    def write_failure(self) -> Optional[BaseException]:
        """The error of a write that failed and lost a unit's state, or None."""
        return self._swap.write_failure()

    def settle(self) -> None:
        """After a failed step: drop the reads ahead, wait for every write in flight and drop
        their failures (slots whose write failed stay unreadable until rewritten)."""
        self.cancel_prefetch()
        settle_writes(self._last_write)

    def cancel_prefetch(self, index: Optional[int] = None) -> None:
        """Drop reads submitted ahead (all, or unit `index`'s): the step was skipped, or the
        unit is about to be rewritten."""
        for i in list(self._prefetched) if index is None else [index]:
            entry = self._prefetched.pop(i, None)
            if entry is not None:
                entry[0].release()  # waits for the read; nothing if the pool took it back

    def stream(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int]
    ) -> Generator[tuple[int, UnitTensors], None, None]:
        staging = self._ctx.staging
        order = list(indices)
        ahead, self._prefetched = self._prefetched, {}
        reads: dict[int, tuple[torch.Tensor, Pending]] = {}
        for i, (lease, handle) in ahead.items():
            if i not in order:  # not part of this step after all
                lease.release()
                continue
            buf = lease.claim()  # the pipeline's now; None: the pool took it back
            if buf is not None:
                reads[i] = (buf, handle)

        def submit(i: int, block: bool) -> None:
            n = self.layouts[i].nbytes + align_up(scratch_bytes(i))
            if not self.layouts[i].nbytes:
                return  # no state on this rank (its part of the unit is frozen)
            buf = staging.acquire(n) if block else staging.try_acquire(n)
            if buf is None:
                return  # no buffer free without waiting: read it next iteration
            try:
                reads[i] = (buf, self._read(i, buf))
            except BaseException:
                staging.release(buf)
                raise

        try:
            for k, i in enumerate(order):
                if not self.layouts[i].nbytes:
                    yield i, self._views(i, torch.empty(0, dtype=torch.uint8))
                    continue
                if i not in reads:
                    submit(i, block=True)
                if k + 1 < len(order) and order[k + 1] not in reads:
                    submit(order[k + 1], block=False)  # overlaps this unit's update
                buf, handle = reads.pop(i)
                try:
                    handle.wait()
                except BaseException:
                    staging.release(buf)
                    raise
                t = self._views(i, buf, scratch_bytes(i))
                try:
                    yield i, t
                except BaseException:
                    wait_quietly(t.holds)
                    staging.release(buf)
                    raise
                self._write(i, buf, t.holds)  # overlaps the next unit's update
        finally:
            for buf, handle in reads.values():  # prefetched but not consumed (an error)
                wait_quietly([handle])
                staging.release(buf)

    # -- internals ------------------------------------------------------------------------------

    def _views(self, index: int, buf: torch.Tensor, scratch_bytes: int = 0) -> UnitTensors:
        lay = self.layouts[index]
        master = buf[: lay.master_numel * 4].view(torch.float32)
        moments = {s.name: buf[at : at + lay.nbytes_of(s)].view(s.dtype)
                   for s, at in zip(lay.specs, lay.offsets)}
        scratch = buf[lay.nbytes : lay.nbytes + scratch_bytes] if scratch_bytes else None
        return UnitTensors(
            master, moments, scratch=scratch, _buffers=(buf,) if buf.numel() else (),
        )

    def _wait_write(self, index: int) -> None:
        h = self._last_write[index]
        if h is not None:
            self._last_write[index] = None  # a failed write is raised once (the slot is unreadable)
            h.wait()

    def _read(self, index: int, buf: torch.Tensor) -> Pending:
        self._wait_write(index)  # [Note: slot ordering]
        ctx = self._ctx
        source = self._sources.get(index)
        if source is not None:  # [Note: adopted state]
            name = ctx.files.read_path(source.path)
            reqs = []
            try:
                for file_offset, at, n in source.parts:
                    req = ctx.aio.pread(buf[at : at + n], name, file_offset)
                    reqs.append(_SourceRead(req, index, source.path))
            except BaseException:
                wait_quietly(reqs)
                raise
            ctx.stats.bytes_read += sum(n for _, _, n in source.parts)
            return Pending(reqs, stats=ctx.stats)
        slot = self._swap.check_readable(index)
        req = self._swap.read(ctx.aio, buf[: slot.nbytes], slot.offset)
        ctx.stats.bytes_read += slot.nbytes
        return Pending([req], stats=ctx.stats)

    def _drop_source(self, index: int) -> None:
        source = self._sources.pop(index, None)
        if source is not None:
            self._ctx.files.release(source.path)

    def _write(self, index: int, buf: torch.Tensor, holds: Sequence[Completion]) -> None:
        """Write the state from `buf` (and let `holds` finish); the buffer goes back to the
        pool when all are done. Tracked, not waited: see [Note: optimizer pipeline]."""
        ctx = self._ctx
        try:
            self.cancel_prefetch(index)  # a read submitted ahead would hold the old bytes
            self._wait_write(index)
            slot = self._swap.slots[index]
            req = self._swap.write(ctx.aio, buf[: slot.nbytes], slot.offset)
        except BaseException:
            wait_quietly(holds)
            ctx.staging.release(buf)
            raise
        ctx.stats.bytes_written += slot.nbytes
        self._drop_source(index)  # the slot holds the unit's state from now on
        written = Pending(
            [req], on_error=lambda exc: self._swap.mark_failed(index, exc), stats=ctx.stats
        )
        self._swap.mark_written(index)
        self._last_write[index] = written
        # The buffer goes back once the state write and every write reading from it are done.
        ctx.staging.track(Pending([written, *holds], release=lambda: ctx.staging.release(buf)))
