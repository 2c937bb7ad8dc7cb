"""Host memory for gathered full buffers, reused instead of freed: `FullBuffers`.

[Note: reused full buffers]
A unit that is not aliased to its shard (world size 1 with the parameter shard on NVMe, on a
CPU run) gets its full buffer's bytes at every gather and gives them back after every use:
twice per step per unit. Through the CPU allocator that is fresh memory each time (glibc
returns blocks over 32 MB to the OS with munmap and maps them again), so every page of the
buffer is faulted in again, in forward and in backward. Measured on the 134M GPT with both
tiers on NVMe, 5 interleaved rounds: the step took 1.20x plain PyTorch's, and 1.06x with
glibc told to keep freed memory (GLIBC_TUNABLES mmap_max=0, a large trim threshold), which
also sped up PyTorch's own step by 8 %: the difference is page faults.

So a unit's full buffer takes its bytes from here and gives them back here: page-aligned
buffers (`offload.storage.io.aligned_empty`) kept up to `budget_bytes` once unused, handed
out again to the next unit whose buffer fits. The unit's storage is pointed at the buffer
and away from it again (`torch.UntypedStorage._swap_data_ptr_`; the parameters are views of
that storage, so they follow). Without those private torch calls (torch < 2.3) units
allocate as before. Only on the CPU at world size 1: on a GPU torch's caching allocator
already reuses memory, and collectives at larger world sizes may still read a buffer after
its unit lets go of it ([Note: collective tensors at exit] in offload/units/collectives.py).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["FullBuffers", "CAN_POINT", "point_storage", "unpoint_storage"]

CAN_POINT = hasattr(torch._C, "_construct_storage_from_data_pointer") and hasattr(
    torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch can point a storage at memory it does not own (torch >= 2.3)."""


def point_storage(t: torch.Tensor, buf: torch.Tensor) -> None:
    """Point `t`'s storage (and so every view of it) at the first bytes of `buf`, which the
    caller keeps alive; `t` must be empty (0 bytes) and `buf` at least as large."""
    storage = torch._C._construct_storage_from_data_pointer(
        buf.data_ptr(), buf.device, t.numel() * t.element_size())
    # A private torch method, not in its stubs (CAN_POINT says this torch has it).
    t.untyped_storage()._swap_data_ptr_(storage)  # type: ignore[attr-defined]


def unpoint_storage(t: torch.Tensor) -> None:
    """Point `t`'s storage away again: empty and resizable, as a freed one."""
    t.untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0))  # type: ignore[attr-defined]


class FullBuffers:
    """Page-aligned host byte buffers for full buffers, reused (see the note). Used from the
    engine's thread only."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        """Bytes kept while unused; buffers given back beyond it are freed."""
        self._free: list[torch.Tensor] = []
        self.taken = 0
        """Buffers handed out that were reused (not newly allocated): for tests and stats."""
        self.made = 0
        """Buffers newly allocated."""

    @property
    def kept_bytes(self) -> int:
        return sum(b.numel() for b in self._free)

    def point(self, t: torch.Tensor) -> torch.Tensor:
        """Give `t`'s (empty, resizable) storage the bytes of a buffer from here; returns the
        buffer, which the caller keeps and gives back with `unpoint`."""
        buf = self.take(t.numel() * t.element_size())
        point_storage(t, buf)
        return buf

    def unpoint(self, t: torch.Tensor, buf: torch.Tensor) -> None:
        """Point `t`'s storage away from `buf` (empty and resizable, as freed) and keep `buf`
        for the next unit, within the budget."""
        unpoint_storage(t)
        self.give(buf)

    def take(self, need: int) -> torch.Tensor:
        """A page-aligned uint8 buffer of at least `need` bytes (a kept one that fits, else a
        new one), for the caller to give back with `give` (a unit's publish copy: [Note:
        publish copies from reused buffers] in offload/units/shard.py)."""
        best: Optional[int] = None
        for i, b in enumerate(self._free):  # the smallest that fits, and not twice too large
            if need <= b.numel() <= 2 * need and (best is None or b.numel() < self._free[best].numel()):
                best = i
        if best is not None:
            self.taken += 1
            return self._free.pop(best)
        from offload.storage.io import aligned_empty

        self.made += 1
        return aligned_empty(need, torch.uint8, pin=False)

    def give(self, buf: torch.Tensor) -> None:
        """Keep `buf` (from `take`) for the next taker, within the budget; else it is freed."""
        if self.kept_bytes + buf.numel() <= self.budget_bytes:
            self._free.append(buf)

    def clear(self) -> None:
        self._free.clear()
