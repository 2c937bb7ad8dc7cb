"""Where a shard's bytes live between uses: the compute device, host memory, NVMe.

One interface, so no code outside `offload/storage/` asks which tier it talks to:

- `allocate(key, numel, dtype)` reserves room for one shard (zero-filled),
- `fetch(key, out)` copies the shard into a caller's buffer (any device),
- `store(key, src)` copies a caller's buffer into the shard; `store_prefix(key, src)` into
  its first `src.numel()` elements only, the rest keeping its bytes (a unit's frozen
  suffix, which the optimizer never writes),
- `view(key)` returns the shard itself when the tier is `addressable` (device and host
  tiers: its bytes are a tensor on `device`), or None (NVMe: bytes must be fetched first),
- `free(key)` releases it; `bytes_allocated()` is what the tier holds right now;
  `memory_tensors()` / `bytes_on_disk()` say which accounting bucket those bytes count in.

What the schedule needs of a tier, every tier answers too (in-memory tiers trivially):

- `fetch_ahead(key, block)` starts bringing the shard into a pooled host buffer and returns
  a `ReadAhead` to wait on later, or None: nothing to fetch (in-memory tiers, whose shards
  are gathered where they live) or, with `block=False`, no buffer free now;
- `keep_after_store(keys)` names the shards whose next `store` the tier keeps a pooled copy
  of (the next iteration's first units), so that a later `fetch_ahead` / `take_held` hands
  that copy out as an already-completed fetch instead of reading the bytes back;
- `take_held(key)` hands out such a copy only (never starts a read), `release_held(key)`
  gives copies back.

A buffer taken ahead of need is a revocable lease on the pinned pool ([Note: evictable
leases] in offload/storage/nvme.py): the holder asks `ReadAhead.live()` before using it, and
`claim()`s it while it does. A new `store` of a shard revokes every lease on its old bytes,
so nothing stale is handed out, without telling anyone above.

Keys are small hashables chosen by the caller (the engine uses `(unit_index, "param")`).
`Tier` is that interface, a `Protocol`; `MemoryTier` the base of the two tiers here, whose
shards are tensors (`DeviceTier`, `HostTier`). `NVMeTier` (offload/storage/nvme_tier.py)
implements the same methods over `offload.storage.io`'s AIOHandle and the pinned staging
pool (`offload.storage.nvme.Staging`); its `fetch`/`store` are asynchronous and return a handle, which
is why callers treat every return value as "something to wait on" (`wait(handle)`).
`SplitTier` (offload/storage/split_tier.py) answers it over a host part and an NVMe part.
"""

from __future__ import annotations

import abc
from typing import Any, TYPE_CHECKING, Hashable, Iterable, Iterator, Optional, Protocol, Union

import torch

from offload.device_runtime import runtime
from offload.devices import same_device
from offload.storage.pinned import pinned_empty

if TYPE_CHECKING:  # the in-memory tiers run without the native I/O engine
    from offload.storage.io import Completion


Handle = Optional["Completion"]
"""What `fetch`/`store` return: None when the copy is complete on return (in stream order
for CUDA copies), or a `Completion` to `.wait()` on (the NVMe tier's I/O)."""


def wait(handle: Handle) -> None:
    if handle is not None:
        handle.wait()


class Fetch(Protocol):
    """A shard fetched ahead of use, as `fetch_ahead` / `take_held` hand it out
    (`offload.storage.nvme_tier.ReadAhead` is the one kind today)."""

    label: str
    """What the fetch is, for the timeline ('read')."""
    fresh: bool
    """A copy kept at a store (`keep_after_store`) rather than a read."""

    def done(self) -> bool:
        """Whether the bytes have landed (never blocks)."""

    def live(self) -> bool:
        """Whether the pool has not taken the buffer back ([Note: evictable leases])."""

    def claim(self) -> bool:
        """Take the buffer over (no longer revocable); False when it was taken back."""

    def wait(self) -> Optional[torch.Tensor]:
        """Wait for the bytes; the shard in host memory (a tier's `ReadAhead` always returns
        it), or None when the fetch put it in place itself (the runtime's own fetches into a
        unit's full buffer, offload/runtime/prefetch.py)."""

    def release(self) -> None:
        """Give the buffer back (idempotent)."""

    def release_after(self, event: Any) -> None:
        """Give the buffer back once `event` (a CUDA event recorded after the GPU work that
        reads it) has completed, without waiting here; None: now."""


class Tier(Protocol):
    """A place shards live (the module docstring has the contract). Not thread-safe: the
    engine calls it from one thread. Implemented by `DeviceTier`, `HostTier` (through
    `MemoryTier`), `NVMeTier` and `SplitTier`."""

    kind: str
    """'device', 'host', 'nvme' (or 'split'): the accounting bucket this tier's bytes count
    in, and its name in messages. Callers never branch on it: they ask `addressable`,
    `device`, `fetch_ahead` (or `memory_tensors` / `bytes_on_disk` for accounting)."""

    addressable: bool
    """`view(key)` returns the shard itself, a tensor on `device` (else None: the bytes are
    reached only through `fetch` / `fetch_ahead`, and written only through `store`)."""

    @property
    def device(self) -> torch.device:
        """Where `view()` tensors live (host memory for the NVMe tier's staging)."""

    def allocate(self, key: Hashable, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """Reserve a zero-filled shard; the tensor when the tier holds one (else None)."""

    def adopt(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Hold an existing tensor as the shard, without a copy (in-memory tiers only)."""

    def view(self, key: Hashable) -> Optional[torch.Tensor]:
        """The shard itself when the tier is `addressable`, else None."""

    def fetch(self, key: Hashable, out: torch.Tensor) -> Handle:
        """Copy the shard into `out` (any device)."""

    def store(self, key: Hashable, src: torch.Tensor) -> Handle:
        """Copy `src` into the shard."""

    def store_prefix(self, key: Hashable, src: torch.Tensor) -> Handle:
        """Copy `src` into the shard's first `src.numel()` elements; the rest keeps its bytes."""

    def free(self, key: Hashable) -> None:
        """Release the shard."""

    def fetch_ahead(self, key: Hashable, block: bool = False) -> Optional[Fetch]:
        """Start bringing the shard into a pooled host buffer, or None (nothing to fetch, or
        with `block=False` no buffer free now)."""

    def take_held(self, key: Hashable) -> Optional[Fetch]:
        """The copy kept at the shard's last store, as a completed fetch, or None."""

    def keep_after_store(self, keys: Iterable[Hashable]) -> None:
        """Keep, best effort, a pooled copy of these shards at their next `store`."""

    def release_held(self, key: Optional[Hashable] = None) -> None:
        """Give back the copies kept and not yet taken (all, or `key`'s)."""

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each shard held in memory, with its accounting bucket ('device' or 'host')."""

    def bytes_on_disk(self) -> int:
        """Bytes of the tier's swap file (0 for an in-memory tier)."""

    def bytes_allocated(self) -> int:
        """Bytes the tier holds right now."""

    def settle(self) -> None:
        """After a failed step: wait for every write in flight, dropping their failures."""

    def write_failure(self) -> Optional[BaseException]:
        """The error of a write that failed and lost a shard, or None."""

    def __contains__(self, key: Hashable) -> bool:
        """Whether shard `key` is allocated (NVMe: reserved) here."""


class MemoryTier(Tier, abc.ABC):
    """A tier whose shards are tensors in memory (`DeviceTier`, `HostTier`): addressable,
    copies synchronous in stream order, nothing to fetch ahead."""

    addressable: bool = True

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
        if not same_device(tensor.device, self.device) or not tensor.is_contiguous():
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
        runtime().copy(out, src, non_blocking=_may_be_async(src, out))
        return None

    def store(self, key: Hashable, src: torch.Tensor) -> Handle:
        dst = self._shards[key]
        _check_same_size(key, dst, src)
        runtime().copy(dst, src, non_blocking=_may_be_async(src, dst))
        return None

    def store_prefix(self, key: Hashable, src: torch.Tensor) -> Handle:
        """Copy `src` into the shard's first `src.numel()` elements; the rest keeps its
        bytes. The NVMe tier needs the prefix to be a multiple of 4 KiB (the layout puts a
        unit's frozen suffix on such a boundary: [Note: frozen parameters cost their shard
        only] in offload/units/layout.py)."""
        dst = self._shards[key]
        if src.numel() == dst.numel():
            return self.store(key, src)
        check_prefix(key, dst, src)
        runtime().copy(dst[: src.numel()], src, non_blocking=_may_be_async(src, dst))
        return None

    def free(self, key: Hashable) -> None:
        del self._shards[key]

    # -- what the schedule needs: fetch ahead, hold a copy, give buffers back --------------

    def fetch_ahead(self, key: Hashable, block: bool = False) -> Optional[Fetch]:
        """Start bringing shard `key` into a pooled host buffer; None when there is nothing
        to fetch ahead (here: the shard is gathered where it lives) or, with `block=False`,
        no buffer is free now (the caller fetches on demand later)."""
        return None

    def take_held(self, key: Hashable) -> Optional[Fetch]:
        """The copy kept at `key`'s last store (`keep_after_store`), as a completed fetch the
        caller now owns, or None (none kept, or taken back by the pool)."""
        return None

    def keep_after_store(self, keys: Iterable[Hashable]) -> None:
        """Keep, best effort, a pooled copy of these shards at their next `store` (replaces
        the previous set). In-memory tiers: their shards are already where compute reads
        them; nothing to keep."""

    def release_held(self, key: Optional[Hashable] = None) -> None:
        """Give back the copies kept by `keep_after_store` and not yet taken (all, or
        `key`'s)."""

    # -- accounting -----------------------------------------------------------------------------

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each shard held in memory, with the bucket its bytes count in ('device' or
        'host'); adopted tensors too (the caller counts a storage once)."""
        for t in self._shards.values():
            yield self.kind, t

    def bytes_on_disk(self) -> int:
        return 0

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


class DeviceTier(MemoryTier):
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


class HostTier(MemoryTier):
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
        if self.pin_memory:  # locked at exactly its size, zero-filled ([Note: exact pinned memory])
            return pinned_empty(numel * dtype.itemsize, dtype)
        return torch.zeros(numel, dtype=dtype)


def _check_same_size(key: Hashable, shard: torch.Tensor, buf: torch.Tensor) -> None:
    if shard.numel() != buf.numel() or shard.dtype != buf.dtype:
        raise ValueError(
            f"shard {key!r} is {shard.numel()} x {shard.dtype} but the buffer is "
            f"{buf.numel()} x {buf.dtype}; they must match"
        )


def check_prefix(key: Hashable, shard: Union[torch.Tensor, tuple[int, torch.dtype]],
                 buf: torch.Tensor) -> None:
    """`buf` fits as a prefix of the shard (`shard`: its tensor, or (numel, dtype))."""
    numel, dtype = (shard.numel(), shard.dtype) if isinstance(shard, torch.Tensor) else shard
    if buf.numel() > numel or buf.dtype != dtype:
        raise ValueError(
            f"shard {key!r} is {numel} x {dtype}; a prefix of {buf.numel()} x {buf.dtype} "
            "does not fit it"
        )


def _may_be_async(src: torch.Tensor, dst: torch.Tensor) -> bool:
    # A host<->GPU copy may run asynchronously only from/to pinned memory; the caller's
    # later kernels on the same stream are ordered after it. Host->host copies are always
    # synchronous.
    if src.device.type == "cuda" and dst.device.type == "cpu":
        return False  # the host reads the result right after; keep it synchronous
    return runtime().async_copy(src, dst)
