"""Optimizer state on the compute device for some units: the update split between GPU and CPU.

`DeviceOptimizerStates` is the in-memory store (`HostOptimizerStates`) with some units'
fp32 master and state tensors on the compute device instead of in host memory
(`Placement.state[i] is TierKind.DEVICE`, offload/storage/placement.py). The tensors are the
unit's `UnitOptimizerState` fields, as for the host store; only where they live differs.

[Note: the update split]
With every update on the CPU, Adam moves at least 28 bytes per parameter through host
memory each step, and no overlap hides it all: backward reduces the root and the first
blocks last, and the next forward needs them first, so their CPU updates (and the uploads
of their new shards) finish after everything else. A unit whose optimizer state lives on
the compute device updates there right after its gradient is reduced: its gradient shard is
device memory (the reduce-scatter writes it in place: no copy down), the update is torch's
fused Adam/AdamW kernel where it applies and the kind's torch reference update otherwise
(`OptimizerKind.device_update`, offload/optim/kind.py), and its new low-precision shard is
written into its parameter shard, which lives on the device too (no upload). The other units
keep the CPU update beside it, so the step costs about max(GPU, CPU) update time rather than
their sum. Which units, and how many: `offload.optimizer_device_units` / `_fraction`, or the
planner (`placement: auto`), root and first blocks first (`device_units_by_count`).

On a CPU-only machine the compute device is the CPU: the same units take the same path
(device tensors, the torch update, the device parameter tier), so the suite covers it.

What the rest of the engine asks of such a unit goes through the store as for any other:
- `open` hands out host copies (written back on exit with `write=True`), never the device
  tensors, so checkpoints, state dicts and consolidation read and write host memory as they
  do for an NVMe unit; `resident_at(i)` is False for a device unit (on a CPU run too, so the
  suite runs the path a GPU takes);
- `checkout_overwrite` hands out host tensors a checkpoint load fills; `checkin` copies them
  up;
- `memory_tensors` counts the device tensors as 'device' (what `engine.offload_states()`
  parks and `memory_bytes()` reports).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from offload.storage.nvme import Staging
from offload.storage.optim_state import HostOptimizerStates, UnitTensors
from offload.storage.state_store import UnitState

__all__ = ["DeviceOptimizerStates"]


class DeviceOptimizerStates(HostOptimizerStates):
    """Optimizer state in memory: units with `on_device[i]` on the compute device (see the
    module docstring), the others in host memory."""

    def __init__(self, states: Sequence[UnitState], on_device: Sequence[bool],
                 staging: Optional[Staging] = None) -> None:
        super().__init__(states, staging)
        self.on_device = tuple(bool(v) for v in on_device)
        self.resident = not any(self.on_device)
        """Every unit's tensors in host memory (none on the device)."""
        self._overwriting: dict[int, UnitTensors] = {}
        """Host tensors handed out by `checkout_overwrite`, copied up at `checkin`."""

    def resident_at(self, index: int) -> bool:
        """Whether unit `index`'s tensors live in host memory (not on the device)."""
        return not self.on_device[index]

    def _host_copies(self, index: int, read: bool) -> UnitTensors:
        master, moments = self._tensors(index)

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return out.copy_(t) if read else out

        return UnitTensors(host(master), {k: host(v) for k, v in moments.items()})

    def _copy_up(self, index: int, t: UnitTensors) -> None:
        master, moments = self._tensors(index)
        master.copy_(t.master)
        for name, dst in moments.items():
            dst.copy_(t.moments[name])

    @contextlib.contextmanager
    def open(self, index: int, write: bool = False, overwrite: bool = False) -> Iterator[UnitTensors]:
        """A device unit's tensors as host copies (not read with `overwrite` and `write`: the
        caller sets every one), written back to the device on exit when `write`."""
        if not self.on_device[index]:
            with super().open(index, write, overwrite) as t:
                yield t
            return
        t = self._host_copies(index, read=not (write and overwrite))
        yield t
        if write:
            self._copy_up(index, t)

    def checkout_overwrite(self, index: int) -> UnitTensors:
        """Host tensors laid out as unit `index`'s state, not read (a checkpoint load fills
        every one); `checkin` copies them to the device. Only for a device unit."""
        if not self.on_device[index]:
            return super().checkout_overwrite(index)  # raises: fill the host tensors in place
        t = self._overwriting[index] = self._host_copies(index, read=False)
        return t

    def checkin(self, index: int, t: UnitTensors) -> None:
        if self._overwriting.get(index) is t:
            del self._overwriting[index]
            for h in t.holds:
                h.wait()
            self._copy_up(index, t)
            return
        super().checkin(index, t)

    def abandon(self, index: int, t: UnitTensors) -> None:
        if self._overwriting.get(index) is t:
            del self._overwriting[index]
        super().abandon(index, t)

    def adopt(self, index: int, t: UnitTensors, path: str, file_offsets: dict[str, int]) -> None:
        where = "on the compute device" if self.on_device[index] else "in host memory"
        raise ValueError(f"unit {index}'s optimizer state is {where}: nothing to adopt")

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each state tensor with its accounting bucket: 'device' for a device unit's."""
        for on, st in zip(self.on_device, self._states):
            for t in (st.master, *(st.moments or {}).values()):
                if t is not None:
                    yield ("device" if on else "host"), t
