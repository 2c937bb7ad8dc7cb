"""Where a shard's bytes live between uses: the compute device, host memory, (next) NVMe.

One small interface, so the engine never asks which tier it talks to:

- `allocate(key, numel, dtype)` reserves room for one shard (zero-filled),
- `fetch(key, out)` copies the shard into a caller's buffer (any device),
- `store(key, src)` copies a caller's buffer into the shard,
- `view(key)` returns the shard itself when its bytes are directly addressable (device and
  host tiers), or None (NVMe: bytes must be fetched into a buffer first),
- `free(key)` releases it; `bytes_allocated()` is what the tier holds right now.

Keys are small hashables chosen by the caller (the engine uses `(unit_index, "param")`).
The NVMe tier (issue 6) implements the same methods over `offload.io`'s AIOHandle and
pinned BufferPool; `fetch`/`store` then become asynchronous and return a handle, which is
why callers here already treat the return value as "something to wait on" (`wait(handle)`).
"""

from __future__ import annotations

import abc
from typing import Any, Hashable, Optional

import torch

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


def make_param_tier(param_tier: str, compute_device: torch.device, pin_memory: bool) -> Tier:
    """The tier for low-precision parameter shards, from `config.offload.param_tier`."""
    if param_tier == "device":
        return DeviceTier(compute_device)
    if param_tier == "cpu":
        return HostTier(pin_memory=pin_memory and compute_device.type == "cuda")
    if param_tier == "nvme":
        raise NotImplementedError(
            "offload.param_tier='nvme' is not available yet (the NVMe tier is the next "
            "milestone); use param_tier='cpu' or 'device'"
        )
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
