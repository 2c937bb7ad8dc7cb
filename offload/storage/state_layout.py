"""One unit's optimizer state as bytes and as tensors: `StateLayout` (where the master and
each named state tensor lie in a unit's swap slot and staging buffer) and `UnitTensors` (the
tensors a caller of the stores in offload/storage/optim_state.py sees)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from offload.sizes import align_up

__all__ = ["ADAM_STATE", "StateLayout", "UnitTensors", "state_layout"]

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StateLayout:
    """Byte layout of one unit's optimizer state in its slot (and its staging buffer):
    master (fp32) at 0, then each named state tensor (`names`) at a page-aligned offset
    (`offsets`), in order."""

    master_numel: int
    moment_numel: int
    moment_itemsize: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: int
    """Total, a multiple of 4096 (O_DIRECT)."""

    def offset_of(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    @property
    def exp_avg_offset(self) -> int:
        return self.offset_of("exp_avg")

    @property
    def exp_avg_sq_offset(self) -> int:
        return self.offset_of("exp_avg_sq")


def state_layout(master_numel: int, moment_numel: int, moment_itemsize: int,
                 names: tuple[str, ...] = ADAM_STATE) -> StateLayout:
    """Pure arithmetic: each tensor page-aligned, so each is a SIMD-aligned view of one buffer
    and the whole moves with one aligned request."""
    if master_numel < 0 or moment_numel < 0 or moment_itemsize <= 0:
        raise ValueError(f"bad state sizes: {master_numel}, {moment_numel}, {moment_itemsize}")
    m = align_up(master_numel * 4)
    a = align_up(moment_numel * moment_itemsize)
    offsets = tuple(m + k * a for k in range(len(names)))
    return StateLayout(master_numel, moment_numel, moment_itemsize, tuple(names), offsets,
                       m + len(names) * a)


@dataclass
class UnitTensors:
    """One unit's state tensors as a caller sees them (valid until the context/step moves
    on), and `scratch`: page-aligned bytes for the caller (the new low-precision shard)."""

    master: torch.Tensor
    moments: dict[str, torch.Tensor]
    """The optimizer's state tensors by name (offload/optim/kinds.py `STATE_NAMES`)."""
    scratch: Optional[torch.Tensor] = None
    holds: list[Any] = field(default_factory=list)
    """Handles of writes that read from this unit's buffers: they complete before the
    buffers are reused (`hold`)."""
    _buffers: tuple[torch.Tensor, ...] = ()

    def get(self, name: str) -> torch.Tensor:
        """"master" or a state tensor by name."""
        return self.master if name == "master" else self.moments[name]

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.moments["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.moments["exp_avg_sq"]

    def hold(self, handle: Any) -> None:
        if handle is not None:
            self.holds.append(handle)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in this unit's pooled buffers (then a write from it must be held,
        not waited for, and the buffer outlives it)."""
        p = t.data_ptr()
        for b in self._buffers:
            if b.data_ptr() <= p < b.data_ptr() + b.numel() * b.element_size():
                return True
        return False
