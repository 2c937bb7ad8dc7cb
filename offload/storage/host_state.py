"""Host memory for a unit's fp32 master and optimizer-state tensors (`host_state_zeros`), and
what the planner counts for it (`host_state_bytes`). Re-exported by offload/optim/sharded.py,
where they were first."""

from __future__ import annotations

import torch

from offload.sizes import ALIGNMENT

__all__ = ["HOST_STATE_ALIGN_MIN_BYTES", "host_state_zeros", "host_state_bytes"]

HOST_STATE_ALIGN_MIN_BYTES = 1 << 20
"""Host optimizer-state tensors (master, moments) this large start on a page boundary
(`host_state_zeros`); smaller ones come from the CPU allocator as they are."""


def host_state_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D host tensor for a unit's master or moments. Large ones are page-aligned
    (`offload.storage.io.aligned_empty`, on transparent huge pages from 4 MiB), so a checkpoint's
    O_DIRECT reads land in them and its writes leave from them with no staging copy (the
    CPU allocator aligns to 64 bytes only). Costs one page more than the tensor
    (`host_state_bytes`)."""
    from offload.storage.io import aligned_empty

    nbytes = numel * dtype.itemsize
    if nbytes < HOST_STATE_ALIGN_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    return aligned_empty(nbytes, dtype, pin=False).zero_()


def host_state_bytes(nbytes: int) -> int:
    """Host bytes `host_state_zeros` holds for a tensor of `nbytes` (for the planner)."""
    return nbytes if nbytes < HOST_STATE_ALIGN_MIN_BYTES else nbytes + ALIGNMENT
