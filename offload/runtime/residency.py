"""Device memory handed back between phases: `engine.offload_states()` / `reload_states()`.

DeepSpeed's calls of those names free an engine's GPU memory while something else needs it
(an RLHF trainer's generation phase, a second model's turn) and bring it back bit for bit.
offload already keeps the fp32 master, the gradient shards and the optimizer state in host
memory (or on NVMe), so what is left on the compute device between steps is: the parameter
shards of a `device` parameter tier, the full buffers of units that stay gathered (ZeRO
stages 1 and 2, units kept or prefetched for the next iteration) and the model's buffers.

[Note: parking device storages] `DeviceResidency.offload` frees the gathered copies the
schedule can rebuild (`Gatherer.drop` / `free_all`), then copies every storage still on the
device into host memory of its exact size (page-locked on a GPU, so the copy back is DMA) and
resizes the device storage to 0 bytes. Every tensor viewing it — the tier's shard, a unit's
full buffer, the module's parameter views, a buffer — stays the same object, so nothing that
holds one goes stale: `reload` resizes the storage back and copies the bytes in. Storages
are found as the engine's accounting counts them ('device' bucket, one count per storage),
so a CPU run, whose 'device' is main memory, runs the same path. While parked, anything that
would read a parked storage (forward, backward, step, a gather outside training, a save)
raises with the fix; `close()` reloads first, so a closed model keeps its weights.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Iterable, Optional

import torch

from offload.storage.pinned import pinned_empty

logger = logging.getLogger("offload.engine")

__all__ = ["Residency", "DeviceResidency", "STATE_KINDS"]

STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
"""DeepSpeed's `OffloadStateTypeEnum` values. offload keeps optimizer states, fp32 masters
(hp_params) and gradients (lp_grads, contiguous_grad_buffer) in host memory already: only
lp_params (the low-precision parameters and the gathered buffers) live on the device."""


class Residency(enum.Enum):
    ON_DEVICE = "on the compute device"
    PARKED = "in host memory (engine.offload_states())"


class DeviceResidency:
    """One engine's parked device storages; see [Note: parking device storages]."""

    def __init__(self) -> None:
        self.state = Residency.ON_DEVICE
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """(the device storage, now 0 bytes; its bytes in host memory)."""

    @property
    def parked(self) -> bool:
        return self.state is Residency.PARKED

    def check(self, what: str) -> None:
        if self.parked:
            raise RuntimeError(f"{what} after engine.offload_states(): the engine's device memory "
                               "is parked in host memory; call engine.reload_states() first")

    def offload(self, tensors: Iterable[torch.Tensor], include: Optional[Iterable[Any]] = None,
                device: Any = "cpu", pin_memory: bool = True) -> int:
        """Park the storages of `tensors` (the engine's 'device' bucket) in host memory;
        returns the bytes moved. `include` as DeepSpeed's (None: everything); `device` must
        be DeepSpeed's `cpu` (its only supported value)."""
        kinds = _names(include)
        where = str(getattr(device, "value", device))
        if where == "none":
            logger.warning("engine.offload_states(device='none'): no device given, nothing moved")
            return 0
        if where != "cpu":
            raise ValueError(f"engine.offload_states(device={where!r}): only 'cpu' is supported (as in "
                             "DeepSpeed); with an NVMe tier the states are on NVMe already")
        if self.parked:
            return 0  # already parked (DeepSpeed's offload_states is idempotent too)
        if "lp_params" not in kinds:
            return 0  # everything else of those kinds is in host memory already
        moved = 0
        seen: set[int] = set()
        for t in tensors:
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            pin = pin_memory and storage.device.type == "cuda"
            host = pinned_empty(nbytes) if pin else torch.empty(nbytes, dtype=torch.uint8)
            host.copy_(_bytes_of(storage))
            storage.resize_(0)
            self._parked.append((storage, host))
            moved += nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the point: another user of the GPU gets the memory
        self.state = Residency.PARKED
        logger.info("offload_states: %d bytes of device memory parked in host memory", moved)
        return moved

    def reload(self) -> None:
        """Every parked storage back on its device, bit for bit."""
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host)
        if self._parked and torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are freed next
        self._parked = []
        self.state = Residency.ON_DEVICE

    def memory_tensors(self) -> list[torch.Tensor]:
        """The host copies of parked storages (the accounting's 'host' bytes while parked)."""
        return [host for _, host in self._parked]


def _names(include: Optional[Iterable[Any]]) -> frozenset[str]:
    if include is None:
        return frozenset(STATE_KINDS)
    names = frozenset(str(getattr(k, "value", k)) for k in include)  # DeepSpeed's enum or strings
    unknown = sorted(names - set(STATE_KINDS))
    if unknown:
        raise ValueError(f"engine.offload_states(include=...): {', '.join(map(repr, unknown))} "
                         f"is not a state kind; the kinds are {', '.join(STATE_KINDS)} (DeepSpeed's "
                         "OffloadStateTypeEnum)")
    return names


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
