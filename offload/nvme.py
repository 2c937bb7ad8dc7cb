"""What the two NVMe tiers share: the swap directory, one AIO handle, one pinned staging pool,
and the writes in flight.

The parameter tier (`offload.tiers.NVMeTier`) and the optimizer-state store
(`offload.optim_state.NVMeOptimizerStates`) each own one swap file in the rank's
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
write left to wait for, the budget is too small for what is held, and that is an error that
says so. `initialize` checks that one unit's working set fits the budget, so the pipeline,
which holds nothing else when it needs a unit's buffer, always gets one.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from offload.io import AIOHandle, BufferPool
from offload.swap import SwapDirectory

__all__ = ["Pending", "Staging", "NVMeContext", "IOStats"]


class Pending:
    """Completion of one or more I/O requests (or other Pendings).

    `wait()` waits for all of them; the first time, it then runs `then` (on success only:
    e.g. copy a staged read into its destination) and `release` (always: the buffer goes
    back to the pool only once no request uses it). A failure is raised from this and every
    later `wait()`. Single-threaded: called from the engine's thread.
    """

    __slots__ = ("_parts", "_then", "_release", "_on_error", "_done", "_error", "_stats")

    def __init__(
        self,
        parts: Iterable[Any],
        *,
        then: Optional[Callable[[], None]] = None,
        release: Optional[Callable[[], None]] = None,
        on_error: Optional[Callable[[], None]] = None,
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
                    self._on_error()
            finally:
                if self._release is not None:
                    self._release()
                self._parts, self._then, self._release, self._on_error = [], None, None, None
        if self._error is not None:
            raise self._error


class IOStats:
    """Counters of what the NVMe tiers moved, for accounting and benchmarks."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_s = 0.0
        """Seconds the engine's thread spent blocked waiting for I/O to complete."""

    def snapshot(self) -> dict[str, float]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "wait_s": self.wait_s}


class Staging:
    """The pinned staging pool plus the writes in flight that hold its buffers.

    See [Note: staging budget]. Buffers are uint8, 4 KiB-aligned (O_DIRECT fast path).
    """

    def __init__(self, budget_bytes: int, pin: Optional[bool] = None) -> None:
        self.pool = BufferPool(int(budget_bytes), pin=pin)
        self._inflight: collections.deque[Pending] = collections.deque()
        self.reclaimers: list[Callable[[], bool]] = []
        """Holders of buffers taken ahead of need (prefetched shards and states): called,
        in order, when `acquire` finds the pool full and no write in flight; each gives
        back what it holds and says whether it did. A prefetch is only ever an
        optimisation, so dropping one for a buffer that is needed now is always right."""

    @property
    def budget_bytes(self) -> int:
        return self.pool.budget_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer of `nbytes`; waits for writes in flight (oldest first) to make room."""
        while True:
            buf = self._try(nbytes)
            if buf is not None:
                return buf
            if not self._inflight:
                if any([reclaim() for reclaim in self.reclaimers]):
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

    def _try(self, nbytes: int) -> Optional[torch.Tensor]:
        try:
            return self.pool.acquire(nbytes, timeout_s=0)
        except TimeoutError:
            return None

    def release(self, buf: torch.Tensor) -> None:
        self.pool.release(buf)

    def track(self, handle: Pending) -> None:
        """Hold a write (whose `release` returns a pool buffer) until someone waits for it."""
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
            self.staging = Staging(budget_bytes, pin=pin)
        except BaseException:
            self.directory.close()
            raise
        self.stats = IOStats()
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
            self.directory.close()


def wait_quietly(handles: Sequence[Any]) -> None:
    """Wait for every handle, ignoring failures (used when unwinding after an error)."""
    for h in handles:
        try:
            h.wait()
        except BaseException:  # noqa: BLE001
            pass
