"""Optimizer state split between host memory and NVMe, unit by unit (`Placement`).

`SplitOptimizerStates` offers the methods of the two stores of offload/storage/optim_state.py
for all units, passing each unit's call to the store that holds it. The step's pipeline
(`stream`) walks the units in the caller's order: a unit on NVMe comes from the NVMe store's
own pipeline, which was given only the NVMe units in that order, so it reads the next of
them while the units in host memory between them are updated; a unit in host memory is
handed out in place.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from offload.storage.optim_state import HostOptimizerStates, NVMeOptimizerStates, UnitTensors
from offload.storage.state_layout import StateLayout, StateSpec
from offload.storage.state_store import OptimizerStates, UnitState

__all__ = ["SplitOptimizerStates"]


class SplitOptimizerStates(OptimizerStates):
    """Units with `on_nvme[i]` in `nvme` (its slot for any other unit is empty), the rest in
    `host` (whose `UnitOptimizerState` of an NVMe unit holds no tensors)."""

    resident = False
    """Not every unit's state is in host memory: ask `resident_at(index)`."""

    def __init__(self, host: HostOptimizerStates, nvme: NVMeOptimizerStates,  # host: or DeviceOptimizerStates
                 on_nvme: Sequence[bool]) -> None:
        self.host = host
        self.nvme = nvme
        self.on_nvme = tuple(bool(v) for v in on_nvme)

    def _of(self, index: int) -> OptimizerStates:
        return self.nvme if self.on_nvme[index] else self.host

    def resident_at(self, index: int) -> bool:
        return not self.on_nvme[index] and self.host.resident_at(index)  # (a device unit's: not)

    # what the checkpoint loader asks of the NVMe store (its slots; host units have none)
    @property
    def layouts(self) -> list[StateLayout]:
        return self.nvme.layouts

    @property
    def specs(self) -> tuple[StateSpec, ...]:
        return self.nvme.specs

    @property
    def path(self) -> str:
        return self.nvme.path

    # -- one unit: its store's -------------------------------------------------------------

    def initialize(self, index: int, master: torch.Tensor) -> None:
        self._of(index).initialize(index, master)

    def initialized(self, index: int, unit_state: UnitState) -> None:
        self._of(index).initialized(index, unit_state)

    @contextlib.contextmanager
    def open(self, index: int, write: bool = False, overwrite: bool = False) -> Iterator[UnitTensors]:
        with self._of(index).open(index, write, overwrite) as t:
            yield t

    def checkout(self, index: int, scratch_bytes: int) -> UnitTensors:
        return self._of(index).checkout(index, scratch_bytes)

    def checkin(self, index: int, t: UnitTensors) -> None:
        self._of(index).checkin(index, t)

    def abandon(self, index: int, t: UnitTensors) -> None:
        self._of(index).abandon(index, t)

    def checkout_overwrite(self, index: int) -> UnitTensors:
        return self._of(index).checkout_overwrite(index)  # the host store refuses: fill it in place

    def adopt(self, index: int, t: UnitTensors, path: str, file_offsets: dict[str, int]) -> None:
        if not self.on_nvme[index]:
            raise ValueError(f"unit {index}'s optimizer state is in host memory: nothing to adopt")
        self.nvme.adopt(index, t, path, file_offsets)

    def adopted(self) -> list[int]:
        return self.nvme.adopted()

    # -- the step's pipeline ------------------------------------------------------------------

    def stream(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int]
    ) -> Iterator[tuple[int, UnitTensors]]:
        order = list(indices)
        from_disk = self.nvme.stream([i for i in order if self.on_nvme[i]], scratch_bytes)
        try:
            for i in order:
                if self.on_nvme[i]:
                    j, t = next(from_disk)
                    assert j == i, (j, i)  # the NVMe pipeline walks the same order
                    try:
                        yield i, t
                    except BaseException as exc:
                        # its pipeline abandons the unit (nothing written) and stops
                        with contextlib.suppress(BaseException):
                            from_disk.throw(exc)
                        raise
                    continue
                t = self.host.checkout(i, scratch_bytes(i))
                try:
                    yield i, t
                except BaseException:
                    self.host.abandon(i, t)
                    raise
                self.host.checkin(i, t)
            # the last NVMe unit's write is submitted when its pipeline resumes once more
            for _ in from_disk:
                raise AssertionError("the NVMe pipeline yielded a unit past the step's order")
        finally:
            from_disk.close()

    def prefetch(
        self, indices: Sequence[int], scratch_bytes: Callable[[int], int], limit: int = 2
    ) -> None:
        self.nvme.prefetch([i for i in indices if self.on_nvme[i]][:limit], scratch_bytes, limit)

    def cancel_prefetch(self, index: Optional[int] = None) -> None:
        if index is None or self.on_nvme[index]:
            self.nvme.cancel_prefetch(index)

    # -- every unit: both stores --------------------------------------------------------------

    def settle(self) -> None:
        self.host.settle()
        self.nvme.settle()

    def write_failure(self) -> Optional[BaseException]:
        return self.nvme.write_failure()

    def bytes_on_disk(self) -> int:
        return self.nvme.bytes_on_disk()

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.host.memory_tensors()
        yield from self.nvme.memory_tensors()
