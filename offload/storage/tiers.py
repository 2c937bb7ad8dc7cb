"""Where a shard's bytes live between uses: the compute device, host memory, NVMe.

One small interface, so the engine never asks which tier it talks to:

- `allocate(key, numel, dtype)` reserves room for one shard (zero-filled),
- `fetch(key, out)` copies the shard into a caller's buffer (any device),
- `store(key, src)` copies a caller's buffer into the shard,
- `view(key)` returns the shard itself when its bytes are directly addressable (device and
  host tiers), or None (NVMe: bytes must be fetched into a buffer first),
- `free(key)` releases it; `bytes_allocated()` is what the tier holds right now.

Keys are small hashables chosen by the caller (the engine uses `(unit_index, "param")`).
`NVMeTier` implements the same methods over `offload.storage.io`'s AIOHandle and the pinned staging
pool (`offload.storage.nvme.Staging`); its `fetch`/`store` are asynchronous and return a handle, which
is why callers treat every return value as "something to wait on" (`wait(handle)`).
"""

from __future__ import annotations

import abc
from typing import Any, Hashable, Optional, Sequence

import torch

from offload.storage.io import ALIGNMENT
from offload.storage.nvme import NVMeContext, Pending, settle_writes, wait_quietly

Handle = Optional[Any]
"""What `fetch`/`store` return: None when the copy is complete on return (in stream order
for CUDA copies), or an object with `.wait()` (the NVMe tier's I/O completions)."""


def wait(handle: Handle) -> None:
    if handle is not None:
        handle.wait()


class Tier(abc.ABC):
    """A place shards live. Not thread-safe: the engine calls it from one thread."""

    kind: str
    """'device', 'host' or 'nvme': the accounting bucket this tier's bytes count in."""

    def __init__(self) -> None:
        self._shards: dict[Hashable, torch.Tensor] = {}

    @abc.abstractmethod
    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of `numel` elements in this tier's memory."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where `view()` tensors live."""

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if key in self._shards:
            raise KeyError(f"shard {key!r} is already allocated in the {self.kind} tier")
        t = self._empty(numel, dtype)
        self._shards[key] = t
        return t

    def adopt(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Hold an existing tensor as the shard (no copy): the fp32-on-CPU engine keeps its
        parameter shard and its fp32 master as one buffer this way."""
        if key in self._shards:
            raise KeyError(f"shard {key!r} is already allocated in the {self.kind} tier")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(
                f"cannot adopt a {tensor.device} / non-contiguous tensor into the {self.kind} tier "
                f"(needs a contiguous tensor on {self.device})"
            )
        self._shards[key] = tensor

    def view(self, key: Hashable) -> Optional[torch.Tensor]:
        return self._shards[key]

    def fetch(self, key: Hashable, out: torch.Tensor) -> Handle:
        src = self._shards[key]
        _check_same_size(key, src, out)
        out.copy_(src, non_blocking=_may_be_async(src, out))
        return None

    def store(self, key: Hashable, src: torch.Tensor) -> Handle:
        dst = self._shards[key]
        _check_same_size(key, dst, src)
        dst.copy_(src, non_blocking=_may_be_async(src, dst))
        return None

    def free(self, key: Hashable) -> None:
        del self._shards[key]

    def settle(self) -> None:
        """After a failed step: wait for every write in flight, dropping their failures
        (slots whose write failed stay unreadable until rewritten). In-memory tiers copy
        synchronously: nothing is in flight."""

    def write_failure(self) -> Optional[BaseException]:
        """The error of a write that failed and lost a shard, or None (in-memory tiers
        cannot lose one)."""
        return None

    def bytes_allocated(self) -> int:
        # Adopted tensors count too: they are this tier's bytes, whoever allocated them.
        seen: set[int] = set()
        total = 0
        for t in self._shards.values():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.numel() * t.element_size()
        return total

    def __contains__(self, key: Hashable) -> bool:
        return key in self._shards


class DeviceTier(Tier):
    """Shards resident on the compute device (GPU memory, or plain memory on a CPU run)."""

    kind = "device"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self._device)


class HostTier(Tier):
    """Shards in CPU memory: page-locked when a GPU copies from it (so host-to-device copies
    are true DMA and can be asynchronous), plain memory when compute is on the CPU (pinning
    would only cost lock-down time there)."""

    kind = "host"

    def __init__(self, pin_memory: bool) -> None:
        super().__init__()
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)
        t.zero_()
        return t


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

    Prefetch (issue 7) slots in here: `fetch` already only submits the read, and the copy
    into `out` happens when the handle is waited on.
    """

    kind = "nvme"

    def __init__(
        self,
        context: NVMeContext,
        shards: Sequence[tuple[Hashable, int, torch.dtype]],
        name: str = "param",
    ) -> None:
        super().__init__()
        self._ctx = context
        self._index: dict[Hashable, int] = {}
        self._spec: list[tuple[int, torch.dtype]] = []
        sizes = []
        for i, (key, numel, dtype) in enumerate(shards):
            if key in self._index:
                raise KeyError(f"shard {key!r} is listed twice for the NVMe tier")
            self._index[key] = i
            self._spec.append((int(numel), dtype))
            sizes.append(int(numel) * _itemsize(dtype))
        self._swap = context.directory.create(name, sizes)
        self._last_write: list[Optional[Pending]] = [None] * len(sizes)
        self.store_listeners: list[Any] = []
        """Called as fn(key, src) after every `store` (the prefetcher: a copy it holds of
        that shard is now stale, or it keeps the new bytes for the next iteration)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def path(self) -> str:
        return self._swap.path

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover
        raise TypeError("the NVMe tier holds no tensors")

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype) -> None:  # type: ignore[override]
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

    def read_ahead(self, key: Hashable, block: bool = False) -> Optional["ReadAhead"]:
        """Submit the read of shard `key` into a pooled staging buffer and return at once
        (the prefetch scheduler's NVMe stage, offload/runtime/schedule.py). With `block=False` it
        never waits: None when the pool has no free buffer now (the caller fetches on demand
        later). The caller waits on `.pending`, reads `.local`, then `.release()`s."""
        i = self._slot(key)
        self._wait_write(i)  # [Note: slot ordering]
        slot = self._swap.check_readable(i)
        ctx = self._ctx
        buf = ctx.staging.acquire(slot.nbytes) if block else ctx.staging.try_acquire(slot.nbytes)
        if buf is None:
            return None
        try:
            req = self._swap.read(ctx.aio, buf, slot.offset)
        except BaseException:
            ctx.staging.release(buf)
            raise
        ctx.stats.bytes_read += slot.nbytes
        numel, dtype = self._spec[i]
        local = buf[: numel * _itemsize(dtype)].view(dtype)
        return ReadAhead(Pending([req], stats=ctx.stats), local, lambda: ctx.staging.release(buf))

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
        for listener in self.store_listeners:
            listener(key, src)
        return handle

    def slot_bytes(self, key: Hashable) -> int:
        return self._swap.slots[self._slot(key)].nbytes

    def hold_copy(self, key: Hashable, src: torch.Tensor) -> Optional["ReadAhead"]:
        """A pooled copy of `src` (the bytes just stored under `key`) in the form of a
        completed read-ahead, or None when the pool has no free buffer: the next
        iteration's first units are taken from it instead of waiting for their write and
        reading them back."""
        i = self._slot(key)
        ctx = self._ctx
        buf = ctx.staging.try_acquire(self._swap.slots[i].nbytes)
        if buf is None:
            return None
        numel, dtype = self._spec[i]
        local = buf[: numel * _itemsize(dtype)].view(dtype)
        local.copy_(src.reshape(-1))
        return ReadAhead(Pending([]), local, lambda: ctx.staging.release(buf))

    def free(self, key: Hashable) -> None:
        i = self._slot(key)
        self._wait_write(i)
        self._swap.mark_written(i, False)

    def write_failure(self) -> Optional[BaseException]:
        return self._swap.write_failure()

    def settle(self) -> None:
        settle_writes(self._last_write)

    def flush(self) -> None:
        """Wait for every write of this tier (raises the first failure)."""
        for i in range(len(self._last_write)):
            self._wait_write(i)

    def bytes_allocated(self) -> int:
        """Bytes of the swap file (every slot, page-rounded), on disk."""
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
    """A shard read submitted ahead of use: wait on `pending`, then `local` holds the shard
    (host memory, the tier's dtype); `release()` gives the buffer back (idempotent)."""

    __slots__ = ("pending", "local", "_release")

    def __init__(self, pending: Pending, local: torch.Tensor, release: Any) -> None:
        self.pending = pending
        self.local = local
        self._release = release

    label = "read"

    def done(self) -> bool:
        """Whether the read has landed (never blocks)."""
        return self.pending.done()

    def wait(self) -> torch.Tensor:
        """Wait for the read; the shard, in the pooled buffer (host memory, the tier's dtype)."""
        self.pending.wait()
        return self.local

    def release(self) -> None:
        if self._release is not None:
            wait_quietly([self.pending])  # the buffer is the read's target until it lands
            release, self._release = self._release, None
            release()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _direct_ok(t: torch.Tensor) -> bool:
    """Host memory the AIO engine can move by O_DIRECT without a staging copy."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.data_ptr() % ALIGNMENT == 0
        and (t.numel() * t.element_size()) % ALIGNMENT == 0
    )


def make_param_tier(
    param_tier: str,
    compute_device: torch.device,
    pin_memory: bool,
    nvme: Optional[NVMeContext] = None,
    shards: Sequence[tuple[Hashable, int, torch.dtype]] = (),
) -> Tier:
    """The tier for low-precision parameter shards, from `config.offload.param_tier`.
    'nvme' needs the rank's `NVMeContext` and every shard (key, numel, dtype) up front."""
    if param_tier == "device":
        return DeviceTier(compute_device)
    if param_tier == "cpu":
        return HostTier(pin_memory=pin_memory and compute_device.type == "cuda")
    if param_tier == "nvme":
        if nvme is None:
            raise ValueError(
                "offload.param_tier='nvme' needs the rank's NVMe context (swap directory, AIO "
                "handle, staging pool); offload.initialize builds it from offload.nvme_path"
            )
        return NVMeTier(nvme, shards)
    raise ValueError(f"offload.param_tier={param_tier!r}; allowed: 'device', 'cpu', 'nvme'")


def _check_same_size(key: Hashable, shard: torch.Tensor, buf: torch.Tensor) -> None:
    if shard.numel() != buf.numel() or shard.dtype != buf.dtype:
        raise ValueError(
            f"shard {key!r} is {shard.numel()} x {shard.dtype} but the buffer is "
            f"{buf.numel()} x {buf.dtype}; they must match"
        )


def _may_be_async(src: torch.Tensor, dst: torch.Tensor) -> bool:
    # A host<->GPU copy may run asynchronously only from/to pinned memory; the caller's
    # later kernels on the same stream are ordered after it. Host->host copies are always
    # synchronous.
    if src.device.type == "cuda" and dst.device.type == "cpu":
        return False  # the host reads the result right after; keep it synchronous
    return src.device.type == "cpu" and src.is_pinned() and dst.device.type == "cuda"
