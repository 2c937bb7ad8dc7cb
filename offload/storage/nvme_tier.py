"""The NVMe tier: parameter shards in a swap file, reached only through fetch and store,
and the factory that picks a rank's parameter tier from the config.

See `offload.storage.tiers` for the interface every tier implements; this module is the
one tier that is not addressable (`view()` is None) and the only one with work to do for
the schedule (`fetch_ahead`, `keep_after_store`, `take_held`, `release_held`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import torch

from offload.sizes import ALIGNMENT
from offload.storage.nvme import EventDone, Lease, NVMeContext, Pending, settle_writes, wait_quietly
from offload.storage.tiers import Tier, check_prefix

__all__ = ["NVMeTier", "ReadAhead"]


class NVMeTier(Tier):
    """Shards in a swap file on NVMe: one 4 KiB-aligned slot per shard, reserved (and the
    file preallocated) at construction, so `allocate` only checks the key.

    `view()` is None: bytes are reached only through `fetch` (read into the caller's buffer,
    directly when it is page-aligned host memory, else through a staging buffer and a copy)
    and `store` (written from the caller's buffer when page-aligned host memory, else from a
    staging copy). Both return a `Pending`; see [Note: slot ordering] in offload/storage/nvme.py for
    why a fetch never sees a shard whose write is still in flight.

    A `store` written directly from the caller's buffer reads that buffer until the handle
    completes: the caller keeps it unchanged until then (waits, or holds the buffer). A
    staged `store` copies first, so the caller may reuse `src` at once; the staging buffer
    goes back to the pool when the write completes.

    Ahead of need, `fetch_ahead` reads a shard into a leased pooled buffer, and a `store` of a
    shard named in `keep_after_store` leaves a leased copy of the stored bytes behind
    (`take_held`). A `store` revokes every lease still on the shard's old bytes (read ahead
    or kept): they are stale.
    """

    kind = "nvme"
    addressable = False

    def __init__(
        self,
        context: NVMeContext,
        shards: Sequence[tuple[Hashable, int, torch.dtype]],
        name: str = "param",
    ) -> None:
        self._ctx = context
        self._index: dict[Hashable, int] = {}
        self._spec: list[tuple[int, torch.dtype]] = []
        sizes = []
        for i, (key, numel, dtype) in enumerate(shards):
            if key in self._index:
                raise KeyError(f"shard {key!r} is listed twice for the NVMe tier")
            self._index[key] = i
            self._spec.append((int(numel), dtype))
            sizes.append(int(numel) * dtype.itemsize)
        self._swap = context.directory.create(name, sizes)
        self._last_write: list[Optional[Pending]] = [None] * len(sizes)
        self._keep: frozenset[Hashable] = frozenset()
        """Shards whose next `store` leaves a pooled copy (`keep_after_store`)."""
        self._held: dict[Hashable, ReadAhead] = {}
        """Copies kept at a store, not yet handed out (`take_held`, `fetch_ahead`)."""
        self._lent: dict[Hashable, Lease] = {}
        """Per shard, the lease of the last buffer of its bytes handed out or kept ahead of
        need: revoked when the shard is stored again (its bytes are then stale)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def path(self) -> str:
        return self._swap.path

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype) -> None:
        i = self._slot(key)
        if self._spec[i] != (numel, dtype):
            raise ValueError(
                f"shard {key!r} was reserved as {self._spec[i][0]} x {self._spec[i][1]}, "
                f"not {numel} x {dtype}"
            )
        return None

    def adopt(self, key: Hashable, tensor: torch.Tensor) -> None:
        raise TypeError("the NVMe tier cannot adopt a tensor: its shards live in a swap file")

    def view(self, key: Hashable) -> Optional[torch.Tensor]:
        self._slot(key)
        return None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    def fetch(self, key: Hashable, out: torch.Tensor) -> Pending:
        i = self._slot(key)
        self._check_buffer(key, i, out)
        self._wait_write(i)  # [Note: slot ordering]
        slot = self._swap.check_readable(i)
        ctx = self._ctx
        ctx.stats.bytes_read += slot.nbytes
        if _direct_ok(out):
            req = self._swap.read(ctx.aio, out, slot.offset)
            return Pending([req], stats=ctx.stats)
        buf = ctx.staging.acquire(slot.nbytes)
        try:
            req = self._swap.read(ctx.aio, buf, slot.offset)
        except BaseException:
            ctx.staging.release(buf)
            raise
        dtype = self._spec[i][1]
        # A synchronous copy: the staging buffer is released right after it, so an
        # asynchronous host-to-device copy could still be reading it (issue 7 adds events).
        return Pending(
            [req],
            then=lambda: out.copy_(buf.view(dtype)),
            release=lambda: ctx.staging.release(buf),
            stats=ctx.stats,
        )

    def fetch_ahead(self, key: Hashable, block: bool = False) -> Optional["ReadAhead"]:
        """The copy kept at the shard's last store if there is one (`take_held`); else submit
        the shard's read into a pooled staging buffer and return at once. With `block=False`
        (ahead of need) it never waits: the buffer is a revocable lease ([Note: evictable
        leases]), and None means the pool has no free buffer now (the caller fetches on
        demand later). With `block=True` (needed now) the buffer is an ordinary one.
        The caller waits on the result, reads `.local`, then `.release()`s."""
        held = self.take_held(key)
        if held is not None:
            return held
        i = self._slot(key)
        self._wait_write(i)  # [Note: slot ordering]
        slot = self._swap.check_readable(i)
        ctx = self._ctx
        staging = ctx.staging
        lease = None
        if block:
            buf = staging.acquire(slot.nbytes)
        else:
            lease = staging.lease(slot.nbytes)
            if lease is None:
                return None
            assert lease.buffer is not None, "a new lease is HELD: it has its buffer"
            buf = lease.buffer
        try:
            req = self._swap.read(ctx.aio, buf, slot.offset)
        except BaseException:
            if lease is not None:
                lease.release()
            else:
                staging.release(buf)
            raise
        ctx.stats.bytes_read += slot.nbytes
        pending = Pending([req], stats=ctx.stats)
        if lease is not None:
            lease.attach(pending)
            self._lent[key] = lease
        return ReadAhead(pending, self._local(i, buf), lambda: staging.release(buf), lease=lease,
                         track=staging.track)

    def take_held(self, key: Hashable) -> Optional["ReadAhead"]:
        held = self._held.pop(key, None)
        if held is None or not held.live():
            return None  # taken back by the pool: as if never kept
        return held

    def keep_after_store(self, keys: Iterable[Hashable]) -> None:
        self._keep = frozenset(keys)

    def release_held(self, key: Optional[Hashable] = None) -> None:
        for k in list(self._held) if key is None else [key]:
            held = self._held.pop(k, None)
            if held is not None:
                held.release()

    def store(self, key: Hashable, src: torch.Tensor) -> Pending:
        i = self._slot(key)
        self._check_buffer(key, i, src)
        self._wait_write(i)  # two writes of one range in flight would be unordered
        slot = self._swap.slots[i]
        ctx = self._ctx
        on_error = lambda exc: self._swap.mark_failed(i, exc)  # noqa: E731
        if _direct_ok(src):
            req = self._swap.write(ctx.aio, src, slot.offset)
            handle = Pending([req], on_error=on_error, stats=ctx.stats)
        else:
            buf = ctx.staging.acquire(slot.nbytes)
            try:
                buf.view(src.dtype).copy_(src.reshape(-1))
                req = self._swap.write(ctx.aio, buf, slot.offset)
            except BaseException:
                ctx.staging.release(buf)
                raise
            handle = Pending(
                [req], on_error=on_error, release=lambda: ctx.staging.release(buf), stats=ctx.stats
            )
            ctx.staging.track(handle)
        ctx.stats.bytes_written += slot.nbytes
        self._swap.mark_written(i)
        self._last_write[i] = handle
        self._drop_ahead(key)  # the old bytes, read ahead or kept, are stale now
        if key in self._keep and src.device.type == "cpu":
            self._hold_copy(key, i, src)
        return handle

    def store_prefix(self, key: Hashable, src: torch.Tensor) -> Pending:
        """Write `src` over the slot's first bytes (a multiple of 4 KiB, O_DIRECT); the rest
        of the slot keeps what the last whole `store` wrote. No copy is kept for
        `take_held` (it would lack the rest), and copies of the old bytes are revoked."""
        i = self._slot(key)
        numel, dtype = self._spec[i]
        if src.numel() == numel:
            return self.store(key, src)
        check_prefix(key, (numel, dtype), src)
        nbytes = src.numel() * dtype.itemsize
        if nbytes % ALIGNMENT or not src.is_contiguous():
            raise ValueError(
                f"shard {key!r}: a prefix store of {nbytes} bytes is not a contiguous multiple "
                f"of {ALIGNMENT} bytes, which the NVMe tier writes by O_DIRECT"
            )
        self._wait_write(i)  # two writes of one range in flight would be unordered
        self._swap.check_readable(i)  # the rest of the slot must hold a whole store's bytes
        slot = self._swap.slots[i]
        ctx = self._ctx
        on_error = lambda exc: self._swap.mark_failed(i, exc)  # noqa: E731
        if _direct_ok(src):
            handle = Pending([self._swap.write(ctx.aio, src, slot.offset)], on_error=on_error,
                             stats=ctx.stats)
        else:
            buf = ctx.staging.acquire(nbytes)
            try:
                buf[:nbytes].view(dtype).copy_(src.reshape(-1))
                req = self._swap.write(ctx.aio, buf[:nbytes], slot.offset)
            except BaseException:
                ctx.staging.release(buf)
                raise
            handle = Pending([req], on_error=on_error, release=lambda: ctx.staging.release(buf),
                             stats=ctx.stats)
            ctx.staging.track(handle)
        ctx.stats.bytes_written += nbytes
        self._swap.mark_written(i)
        self._last_write[i] = handle
        self._drop_ahead(key)  # the old bytes, read ahead or kept, are stale now
        return handle

    def _hold_copy(self, key: Hashable, i: int, src: torch.Tensor) -> None:
        """Keep a leased copy of `src` (the bytes just stored under `key`) when the pool has
        a free buffer: the next iteration's first units are taken from it instead of
        waiting for their write and reading them back."""
        staging = self._ctx.staging
        lease = staging.lease(self._swap.slots[i].nbytes)
        if lease is None:
            return
        buf = lease.buffer
        assert buf is not None, "a new lease is HELD: it has its buffer"
        local = self._local(i, buf)
        local.copy_(src.reshape(-1))
        self._lent[key] = lease
        self._held[key] = ReadAhead(
            Pending([]), local, lambda: staging.release(buf), lease=lease, fresh=True,
            track=staging.track,
        )

    def _drop_ahead(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            held.release()
        lease = self._lent.pop(key, None)
        if lease is not None:
            lease.revoke()  # its holder finds it revoked and fetches again

    def _local(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        numel, dtype = self._spec[i]
        return buf[: numel * dtype.itemsize].view(dtype)

    def free(self, key: Hashable) -> None:
        i = self._slot(key)
        self._drop_ahead(key)
        self._wait_write(i)
        self._swap.mark_written(i, False)

    def write_failure(self) -> Optional[BaseException]:
        return self._swap.write_failure()

    def settle(self) -> None:
        settle_writes(self._last_write)

    def bytes_allocated(self) -> int:
        """Bytes of the swap file (every slot, page-rounded), on disk."""
        return self._swap.total_bytes

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """None: the shards are on disk (buffers lent from the pool count as 'pinned')."""
        return iter(())

    def bytes_on_disk(self) -> int:
        return self._swap.total_bytes

    def _slot(self, key: Hashable) -> int:
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(
                f"shard {key!r} was not reserved in the NVMe tier (its slots are planned when "
                "the tier is built)"
            ) from None

    def _wait_write(self, i: int) -> None:
        h = self._last_write[i]
        if h is not None:
            self._last_write[i] = None  # a failed write is raised once (the slot is unreadable)
            h.wait()

    def _check_buffer(self, key: Hashable, i: int, buf: torch.Tensor) -> None:
        numel, dtype = self._spec[i]
        if buf.numel() != numel or buf.dtype != dtype:
            raise ValueError(
                f"shard {key!r} is {numel} x {dtype} but the buffer is "
                f"{buf.numel()} x {buf.dtype}; they must match"
            )
        if not buf.is_contiguous():
            raise ValueError(f"shard {key!r}: the buffer must be contiguous")


class ReadAhead:
    """A shard fetched ahead of use into a pooled host buffer: wait, then `local` holds the
    shard (host memory, the tier's dtype); `release()` gives the buffer back (idempotent).

    Taken ahead of need, the buffer is a `Lease` the pool may revoke ([Note: evictable
    leases] in offload/storage/nvme.py), or the tier revokes when the shard is stored again:
    a holder asks `live()` before it uses the entry, and `claim()`s it for the use (from
    then on the pool leaves it alone). `fresh`: a copy kept at a store (`keep_after_store`),
    not a read; it stays valid until the shard's next store."""

    __slots__ = ("pending", "local", "fresh", "_lease", "_release", "_track")

    label = "read"

    def __init__(
        self,
        pending: Pending,
        local: torch.Tensor,
        release: Callable[[], None],
        *,
        lease: Optional[Lease] = None,
        fresh: bool = False,
        track: Optional[Callable[[Pending], None]] = None,
    ) -> None:
        self.pending = pending
        self.local = local
        self.fresh = fresh
        self._lease = lease
        self._release: Optional[Callable[[], None]] = release
        """Gives the buffer back once it is no longer a lease (never leased, or claimed)."""
        self._track = track
        """The pool's `Staging.track`: holds a release until the GPU copy reading it is done."""

    def live(self) -> bool:
        """False once the pool (or a new store) took the buffer back: use it no more, fetch
        the shard again."""
        return self._lease is None or self._lease.held

    def claim(self) -> bool:
        """Make the buffer the holder's until `release` (no longer revocable); False when it
        was revoked already."""
        if self._lease is None:
            return self._release is not None
        if self._lease.claim() is None:
            return False
        self._lease = None
        return True

    def done(self) -> bool:
        """Whether the read has landed (never blocks)."""
        return self.pending.done()

    def wait(self) -> torch.Tensor:
        """Wait for the read; the shard, in the pooled buffer (host memory, the tier's dtype)."""
        assert self.live(), "a revoked fetch is used"
        self.pending.wait()
        return self.local

    def release(self) -> None:
        if self._lease is not None:
            lease, self._lease, self._release = self._lease, None, None
            lease.release()  # waits for the read; nothing if the pool took it back already
        elif self._release is not None:
            wait_quietly([self.pending])  # the buffer is the read's target until it lands
            release, self._release = self._release, None
            release()

    def release_after(self, event: Any) -> None:
        """Give the buffer back once `event` (a CUDA event recorded after the GPU copy that
        reads it was queued) has completed, without waiting for it here: the pool holds the
        release as in flight, and a buffer needed now waits for it first (issue #30, F8).
        None: give it back now."""
        if event is None or self._lease is not None or self._release is None or self._track is None:
            self.release()
            return
        wait_quietly([self.pending])  # landed already: the copy read it
        release, self._release = self._release, None
        self._track(Pending([EventDone(event)], release=release))


def _direct_ok(t: torch.Tensor) -> bool:
    """Host memory the AIO engine can move by O_DIRECT without a staging copy."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.data_ptr() % ALIGNMENT == 0
        and (t.numel() * t.element_size()) % ALIGNMENT == 0
    )
