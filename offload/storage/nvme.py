"""What the two NVMe tiers share: the swap directory, one AIO handle, one pinned staging pool,
the writes in flight, and the buffers lent ahead of need.

The parameter tier (`offload.storage.nvme_tier.NVMeTier`) and the optimizer-state store
(`offload.storage.optim_state.NVMeOptimizerStates`) each own one swap file in the rank's
`SwapDirectory`; both move bytes with the same `AIOHandle` and stage them through the same
`Staging` pool, so `offload.pinned_budget_bytes` bounds their pinned memory together.

[Note: slot ordering]
Every slot (one parameter shard, or one unit's optimizer state) carries the handle of its
last write. A read of the slot waits on that handle before it is submitted, and so does the
next write (two writes of one range in flight are unordered). So nothing reads a slot before
its write completed, whatever the disk's timing (tests run with `inject_delay_s` to show
it). A write that failed marks the slot unwritten, so a later read raises instead of
returning half-written bytes; the failure itself is raised from every `wait()` of the write.

[Note: staging budget]
Buffers come from one `BufferPool` whose budget counts every byte it holds. The engine runs on
one thread, so a blocking `acquire` while that thread's own unwaited writes hold the budget
would never return. `Staging.acquire` therefore never blocks on the pool: when it is full it
waits for the oldest write in flight (whose buffer then goes back) and tries again; with no
write left to wait for, it takes back the buffers lent ahead of need ([Note: evictable
leases]); with none of those either, the budget is too small for what is held, and that is
an error that says so. `initialize` checks that one unit's working set fits the budget, so
the pipeline, which holds nothing else when it needs a unit's buffer, always gets one.

[Note: evictable leases]
Some buffers are taken ahead of need: a parameter shard read ahead of its gather, a copy of
a just-stored shard kept for the next forward, a unit's optimizer state read ahead of its
update. Each is only an optimisation, so the pool hands them out as leases (`Staging.lease`)
that it may take back: when `acquire` finds the pool full and no write in flight to wait
for, it revokes every lease it tracks (waiting first for the read into each to land) and
tries again. Nothing is called back: the holder finds its lease `REVOKED` when it next looks
and treats what it had as never fetched (fetched on demand instead). A holder that starts
using the bytes (a gather copying from them, an update reading them) `claim`s the lease
first: from then on it is an ordinary buffer the pool no longer takes back. It revokes
the newest lease first, one at a time, until the buffer fits: bytes are fetched ahead in the
order they are needed (the next units' shards, the next units' state, a copy of the shards the
next iteration starts with, taken at the end of the step), so the lease taken last holds
the bytes needed last, and the ones needed soonest are not read twice. (Revoking every lease
at once, as this did first, threw away the reads for the very next units too: on the 4.11B
run 131 GB were read per step for 124 GB of state.) `IOStats.bytes_dropped` counts what the
pool took back.

[Note: held files]
A checkpoint load may leave a unit's optimizer state where it is, in the checkpoint's shard
file, instead of copying it into the swap slot (see [Note: adopted state] in
offload/storage/optim_state.py). The store then reads that file until the unit's next write. The
file is held open (`HeldFiles`) from the load, and read through `/proc/self/fd/N`, which
opens the held inode again with the I/O engine's own flags (O_DIRECT): a checkpoint deleted,
rotated away or replaced by a new save of the same tag after the load still reads the bytes
the load verified. The last reference closes the descriptor, which gives a deleted file's
blocks back to the filesystem. That close is where the filesystem frees the file (0.4-0.7 s
for 0.76 GB on the development VM's ext4), so it runs on a helper thread: the step that
rewrote the unit does not wait for it.
"""

from __future__ import annotations

import collections
import enum
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from offload.device_runtime import runtime
from offload.storage.io import AIOHandle, BufferPool, Completion
from offload.storage.swap import SwapDirectory

__all__ = ["Pending", "Staging", "Lease", "LeaseState", "NVMeContext", "IOStats", "HeldFiles", "EventDone"]


class Pending:
    """Completion of one or more I/O requests (or other Pendings).

    `wait()` waits for all of them; the first time, it then runs `then` (on success only:
    e.g. copy a staged read into its destination) and `release` (always: the buffer goes
    back to the pool only once no request uses it). A failure is raised from this and every
    later `wait()`; holders of a write's handle drop it before waiting, so the failure is
    raised once, to the step that waited for it (a slot whose write failed is marked
    unreadable by `on_error`). Single-threaded: called from the engine's thread.
    """

    __slots__ = ("_parts", "_then", "_release", "_on_error", "_done", "_error", "_stats")

    def __init__(
        self,
        parts: Iterable[Optional[Completion]],
        *,
        then: Optional[Callable[[], object]] = None,
        release: Optional[Callable[[], None]] = None,
        on_error: Optional[Callable[[BaseException], None]] = None,
        stats: Optional["IOStats"] = None,
    ) -> None:
        self._parts = [p for p in parts if p is not None]
        self._then = then
        self._release = release
        self._on_error = on_error
        self._done = False
        self._error: Optional[BaseException] = None
        self._stats = stats

    def done(self) -> bool:
        """True once every part finished (never blocks)."""
        return self._done or all(p.done() for p in self._parts)

    def wait(self) -> None:
        if not self._done:
            t0 = time.perf_counter() if self._stats is not None else 0.0
            for p in self._parts:  # wait for all before raising: no buffer stays in use
                try:
                    p.wait()
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    if self._error is None:
                        self._error = exc
            if self._stats is not None:
                self._stats.wait_s += time.perf_counter() - t0
            self._done = True
            try:
                if self._error is None and self._then is not None:
                    self._then()
                elif self._error is not None and self._on_error is not None:
                    self._on_error(self._error)
            finally:
                if self._release is not None:
                    self._release()
                self._parts, self._then, self._release, self._on_error = [], None, None, None
        if self._error is not None:
            raise self._error


class EventDone:
    """A CUDA event as a `Completion`: done once the stream work before it has run (a copy to
    the GPU that reads a pooled buffer: the buffer goes back to the pool only then)."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return runtime().query(self.event)

    def wait(self) -> None:
        runtime().synchronize(self.event)


class IOStats:
    """Counters of what the NVMe tiers moved, for accounting and benchmarks."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_s = 0.0
        """Seconds the engine's thread spent blocked waiting for I/O to complete."""
        self.bytes_dropped = 0
        """Bytes fetched ahead (or kept at a store) that the pool took back before their use:
        read again on demand ([Note: evictable leases])."""

    def snapshot(self) -> dict[str, float]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "wait_s": self.wait_s,
                "bytes_dropped": self.bytes_dropped}


class LeaseState(enum.Enum):
    """Where a `Lease`'s buffer is ([Note: evictable leases])."""

    HELD = "held"
    """The holder's, for bytes taken ahead of need (a read in flight into it, or landed);
    the pool may revoke it while it is in this state."""
    REVOKED = "revoked"
    """Taken back by the pool for a buffer needed now (after any read into it landed): the
    holder has nothing; what it fetched ahead is fetched again on demand."""
    RELEASED = "released"
    """Given back by the holder (`release`), or handed over to it as an ordinary pool buffer
    (`claim`). The lease holds nothing."""


class Lease:
    """A pooled buffer taken ahead of need, which the pool may revoke ([Note: evictable
    leases]). Made by `Staging.lease`; used from the engine's thread."""

    __slots__ = ("buffer", "state", "_staging", "_pending")

    def __init__(self, staging: "Staging", buffer: torch.Tensor) -> None:
        self.buffer: Optional[torch.Tensor] = buffer
        """The bytes (uint8, 4 KiB-aligned) while `HELD`; None after."""
        self.state = LeaseState.HELD
        self._staging = staging
        self._pending: Optional[Completion] = None

    @property
    def held(self) -> bool:
        return self.state is LeaseState.HELD

    def attach(self, pending: Completion) -> None:
        """The read submitted into the buffer: revoking or releasing waits for it first (the
        buffer is its target until it lands)."""
        self._pending = pending

    def claim(self) -> Optional[torch.Tensor]:
        """Take the buffer over as an ordinary pool buffer (the caller gives it back with
        `Staging.release`, after any attached read): no longer revocable. None when the pool
        has revoked it."""
        if self.state is not LeaseState.HELD:
            return None
        buf = self.buffer
        self._forget(LeaseState.RELEASED)
        return buf

    def release(self) -> None:
        """Give the buffer back (after any attached read lands; its failure is dropped: a
        fetch ahead that is not used does not fail anyone). Idempotent."""
        if self.state is LeaseState.HELD:
            self._give_back(LeaseState.RELEASED)

    def revoke(self) -> None:
        """Take the buffer back: the pool needs room, or its owner knows the bytes are stale
        (a new store of the shard). No-op unless `HELD`."""
        if self.state is LeaseState.HELD:
            self._give_back(LeaseState.REVOKED)

    def _give_back(self, state: LeaseState) -> None:
        buf, pending = self.buffer, self._pending
        assert buf is not None, "a lease gives back only while HELD, when it has its buffer"
        self._forget(state)
        if pending is not None:
            wait_quietly([pending])
        self._staging.release(buf)

    def _forget(self, state: LeaseState) -> None:
        self._staging._leases.pop(id(self), None)
        self.state = state
        self.buffer = None
        self._pending = None


class Staging:
    """The pinned staging pool, the writes in flight that hold its buffers, and the leases
    on buffers taken ahead of need.

    See [Note: staging budget] and [Note: evictable leases]. Buffers are uint8, 4 KiB-aligned
    (O_DIRECT fast path).
    """

    def __init__(self, budget_bytes: int, pin: Optional[bool] = None,
                 stats: Optional[IOStats] = None) -> None:
        self.pool = BufferPool(int(budget_bytes), pin=pin)
        self.stats = stats if stats is not None else IOStats()
        self._inflight: collections.deque[Pending] = collections.deque()
        self._leases: dict[int, Lease] = {}
        """Leases still `HELD`, oldest first: what `acquire` revokes when the pool is full."""

    @property
    def budget_bytes(self) -> int:
        return self.pool.budget_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes` for use now; waits for writes in flight (oldest first) to
        make room, and when none is left revokes leases, newest first ([Note: evictable
        leases])."""
        while True:
            buf = self._try(nbytes)
            if buf is not None:
                return buf
            if not self._inflight:
                if self.revoke_newest():
                    continue
                raise RuntimeError(
                    f"the pinned staging budget offload.pinned_budget_bytes={self.pool.budget_bytes} "
                    f"cannot hold another {nbytes}-byte buffer: {self.pool.bytes_in_use} bytes are "
                    "held by buffers not in flight (an open unit_state() context?); close them or "
                    "raise offload.pinned_budget_bytes"
                )
            self._inflight.popleft().wait()

    def try_acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        """A buffer of `nbytes` if one is available without waiting on any I/O, else None."""
        self.reap()
        return self._try(nbytes)

    def lease(self, nbytes: int) -> Optional[Lease]:
        """A buffer of `nbytes` taken ahead of need, as a revocable `Lease`, if one is
        available without waiting on any I/O (and without revoking other leases), else None."""
        buf = self.try_acquire(nbytes)
        if buf is None:
            return None
        lease = Lease(self, buf)
        self._leases[id(lease)] = lease
        return lease

    def revoke_newest(self) -> bool:
        """Revoke the lease taken last (its bytes are needed last); whether there was one."""
        if not self._leases:
            return False
        lease = self._leases[next(reversed(self._leases))]
        assert lease.buffer is not None, "a lease in the pool's list is HELD: it has its buffer"
        self.stats.bytes_dropped += lease.buffer.numel()
        lease.revoke()
        return True

    def revoke_leases(self) -> bool:
        """Revoke every lease still held, oldest first; whether there was any."""
        leases = list(self._leases.values())
        for lease in leases:
            lease.revoke()
        return bool(leases)

    def _try(self, nbytes: int) -> Optional[torch.Tensor]:
        try:
            return self.pool.acquire(nbytes, timeout_s=0)
        except TimeoutError:
            return None

    def release(self, buf: torch.Tensor) -> None:
        self.pool.release(buf)

    def track(self, handle: Pending) -> None:
        """Hold a write, or a GPU copy reading a buffer (`EventDone`), whose `release` returns
        a pool buffer, until someone waits for it: a buffer needed now waits for these first."""
        self._inflight.append(handle)

    def reap(self) -> None:
        """Wait for the writes in flight that have already finished (never blocks)."""
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft().wait()

    def drain(self) -> None:
        """Wait for every write in flight; raise the first failure after all are done."""
        first: Optional[BaseException] = None
        while self._inflight:
            try:
                self._inflight.popleft().wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                first = first or exc
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._inflight)


class NVMeContext:
    """One rank's NVMe resources: swap directory (lock + files), AIO handle, staging pool.

    `close()` waits for every write, stops the I/O workers and deletes the swap files; it is
    idempotent and is what the engine's `close()`, context-manager exit and finalizer call.
    """

    def __init__(
        self,
        nvme_path: str,
        rank: int,
        *,
        budget_bytes: int,
        block_size: int,
        queue_depth: int,
        threads: int,
        pin: Optional[bool] = None,
    ) -> None:
        self.directory = SwapDirectory(nvme_path, rank)
        try:
            self.aio = AIOHandle(block_size, queue_depth, threads)
            self.stats = IOStats()
            self.staging = Staging(budget_bytes, pin=pin, stats=self.stats)
        except BaseException:
            self.directory.close()
            raise
        self.files = HeldFiles()
        """Checkpoint files the stores read in place of swap slots ([Note: held files])."""
        self._lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            try:
                self.staging.drain()
            except OSError:
                pass  # a failed write: the files are deleted below anyway
            self.aio.close()
        finally:
            self.staging.pool.trim()
            self.files.close()
            self.directory.close()


class HeldFiles:
    """Files held open by reference count, read through their descriptors ([Note: held
    files]). Used from the engine's thread; the I/O engine opens a request's file when the
    request is submitted, so a descriptor may be closed as soon as its last read is
    submitted."""

    _PROC_FD = "/proc/self/fd"

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._refs: collections.Counter[str] = collections.Counter()
        self._closer: Optional[ThreadPoolExecutor] = None
        """Closes released descriptors off the caller's thread (see the note)."""

    def hold(self, path: str) -> None:
        """Open `path` (once) and add a reference to it."""
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._refs[path] += 1

    def release(self, path: str) -> None:
        """Drop a reference; the last one closes the descriptor."""
        self._refs[path] -= 1
        if self._refs[path] <= 0:
            del self._refs[path]
            fd = self._fds.pop(path, None)
            if fd is not None:
                if self._closer is None:
                    self._closer = ThreadPoolExecutor(1, thread_name_prefix="offload-close")
                self._closer.submit(os.close, fd)

    def read_path(self, path: str) -> str:
        """The name to open `path`'s held inode by: `/proc/self/fd/N` on Linux (the held
        file even if `path` was since deleted or replaced), else `path` itself."""
        fd = self._fds[path]
        if os.path.isdir(self._PROC_FD):
            return f"{self._PROC_FD}/{fd}"
        return path

    def held(self) -> list[str]:
        """The paths held now (for tests and diagnostics)."""
        return sorted(self._fds)

    def settle(self) -> None:
        """Wait until every released descriptor is closed (its file freed if deleted)."""
        if self._closer is not None:
            self._closer.submit(lambda: None).result()

    def close(self) -> None:
        if self._closer is not None:
            self._closer.shutdown(wait=True)
            self._closer = None
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._refs.clear()


def settle_writes(last_write: list[Optional[Pending]]) -> None:
    """Wait for a store's last write per slot and forget them, dropping their errors: a
    failed write has marked its slot lost through `on_error` (`SwapFile.write_failure`
    reports it from there)."""
    for i, h in enumerate(last_write):
        if h is not None:
            last_write[i] = None
            wait_quietly([h])


def wait_quietly(handles: Sequence[Completion]) -> None:
    """Wait for every handle, ignoring failures (used when unwinding after an error)."""
    for h in handles:
        try:
            h.wait()
        except BaseException:  # noqa: BLE001
            pass
