"""One unit's optimizer state as bytes and as tensors: `StateSpec` (what one named state
tensor is), `StateLayout` (where the master and
each named state tensor lie in a unit's swap slot and staging buffer) and `UnitTensors` (the
tensors a caller of the stores in offload/storage/optim_state.py sees)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from offload.sizes import align_up

if TYPE_CHECKING:  # the layout arithmetic runs without the native I/O engine
    from offload.storage.io import Completion

__all__ = ["ADAM_STATE", "StateLayout", "StateSpec", "UnitTensors", "param_align", "state_layout",
           "uniform_specs"]

ADAM_STATE = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class StateSpec:
    """One named state tensor of a unit beside its fp32 master: its dtype, and how many of
    the shard's optimized elements one of its elements stands for (`per`: 1 for a moment
    kept per element; a quantisation block's size for per-block scales, e.g. 8-bit Adam's
    256). `zero` is the stored value that means zero (8-bit signed codes: 127), what a
    fresh state tensor is filled with."""

    name: str
    dtype: torch.dtype
    per: int = 1
    zero: float = 0.0

    def numel(self, optimized: int) -> int:
        """Elements of this tensor over a shard's `optimized` elements."""
        return -(-optimized // self.per)

    def part(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The slice of this tensor `t` over the shard's elements [start, end); `start` is a
        multiple of `per` (the layout aligns every run that way: `param_align`)."""
        if start % self.per:
            raise ValueError(f"{self.name}: a run starting at element {start} is not aligned to "
                             f"its block of {self.per}")
        return t[start // self.per : -(-end // self.per)]


def uniform_specs(names: tuple[str, ...], dtype: torch.dtype) -> tuple[StateSpec, ...]:
    """One per-element state tensor of `dtype` per name (fp32 or bf16 moments)."""
    return tuple(StateSpec(n, dtype) for n in names)


def param_align(specs: tuple[StateSpec, ...], base: int) -> int:
    """The alignment (elements) of each parameter in its unit's flat layout: `base`, or a
    block-quantised state's block when larger, so that every update run (which starts at a
    parameter or a shard boundary) starts on a block and a parameter's blocks are the same
    at every world size."""
    return max([base, *(s.per for s in specs)])


@dataclass(frozen=True)
class StateLayout:
    """Byte layout of one unit's optimizer state in its slot (and its staging buffer):
    master (fp32) at 0, then each state tensor (`specs`) at a page-aligned offset
    (`offsets`), in order."""

    master_numel: int
    moment_numel: int
    """The shard's optimized elements (what every state tensor covers)."""
    specs: tuple[StateSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    """Total, a multiple of 4096 (O_DIRECT)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def numel_of(self, spec: StateSpec) -> int:
        return spec.numel(self.moment_numel)

    def nbytes_of(self, spec: StateSpec) -> int:
        """Bytes of `spec`'s tensor (before page rounding)."""
        return spec.numel(self.moment_numel) * spec.dtype.itemsize

    def offset_of(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    @property
    def exp_avg_offset(self) -> int:
        return self.offset_of("exp_avg")

    @property
    def exp_avg_sq_offset(self) -> int:
        return self.offset_of("exp_avg_sq")


def state_layout(master_numel: int, moment_numel: int,
                 specs: tuple[StateSpec, ...] = uniform_specs(ADAM_STATE, torch.float32)) -> StateLayout:
    """Pure arithmetic: each tensor page-aligned, so each is a SIMD-aligned view of one buffer
    and the whole moves with one aligned request."""
    if master_numel < 0 or moment_numel < 0:
        raise ValueError(f"bad state sizes: {master_numel}, {moment_numel}")
    offsets, at = [], align_up(master_numel * 4)
    for spec in specs:
        offsets.append(at)
        at += align_up(spec.numel(moment_numel) * spec.dtype.itemsize)
    return StateLayout(master_numel, moment_numel, tuple(specs), tuple(offsets), at)


@dataclass
class UnitTensors:
    """One unit's state tensors as a caller sees them (valid until the context/step moves
    on), and `scratch`: page-aligned bytes for the caller (the new low-precision shard)."""

    master: torch.Tensor
    moments: dict[str, torch.Tensor]
    """The optimizer's state tensors by name (offload/optim/kinds.py `STATE_NAMES`)."""
    scratch: Optional[torch.Tensor] = None
    holds: list[Completion] = field(default_factory=list)
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

    def hold(self, handle: Optional[Completion]) -> None:
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
