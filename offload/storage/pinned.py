"""Page-locked host memory at its exact size ([Note: exact pinned memory]).

    from offload.storage.pinned import pinned_empty
    grad = pinned_empty(n * 4, torch.float32)    # locked, zero-filled, exactly n * 4 bytes
"""

from __future__ import annotations

import warnings

import torch

from offload.sizes import align_up

__all__ = ["pinned_empty"]


class _RegisteredHost:
    """Anonymous page-aligned memory (mmap) registered with CUDA as page-locked
    (`cudaHostRegister`): pinned at exactly its page-rounded size, and returned to the system
    when the last tensor on it goes (`__del__`: waits for the device, unregisters, unmaps).

    [Note: exact pinned memory] torch's pinned allocator (`pin_memory=True`) rounds every
    block up to a power of two and keeps freed blocks cached: a 7B block's 805 MB gradient
    shard takes 1 GiB of locked memory, up to 2x what `memory_bytes()` and the planner count
    (issue #30, F5; a 10.6B model's first GPU run was OOM-killed this way). Long-lived
    buffers (shards, gradients, staging) are allocated here instead; short-lived ones
    (activation copies) keep torch's cache, which reuses its blocks."""

    def __init__(self, nbytes: int) -> None:
        import ctypes
        import mmap

        self.size = align_up(max(nbytes, 1), mmap.PAGESIZE)
        self.registered = False
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = (ctypes.c_char * self.size).from_buffer(self._map)
        self.ptr = ctypes.addressof(self._anchor)
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.size} bytes failed (error {int(getattr(err, 'value', err))})")
        self.registered = True
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        if self.registered:
            self.registered = False
            try:
                torch.cuda.synchronize()  # no copy may still read or write these pages
                torch.cuda.cudart().cudaHostUnregister(self.ptr)
            except Exception:  # interpreter shutdown: the process's memory goes anyway
                pass


_REGISTER_FAILED: list[str] = []


def pinned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A 1-D page-aligned, page-locked CPU tensor of `nbytes` bytes holding exactly that much
    locked memory (rounded to a page), zero-filled, released when its last view goes ([Note:
    exact pinned memory]). Falls back to torch's pinned allocator (with a warning, once) where
    CUDA refuses the registration. Needs CUDA."""
    import numpy as np

    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a multiple of the {dtype} element size ({itemsize})")
    if not _REGISTER_FAILED:
        try:
            owner = _RegisteredHost(nbytes)
            return torch.from_numpy(np.asarray(owner)).view(dtype)
        except (RuntimeError, AttributeError, OSError) as exc:
            _REGISTER_FAILED.append(str(exc))
            warnings.warn(f"exact pinned memory is not available ({exc}); torch's pinned allocator is "
                          f"used instead, which rounds blocks up to a power of two", RuntimeWarning,
                          stacklevel=2)
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True).view(dtype)
