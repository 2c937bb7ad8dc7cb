"""The optimizer-state store interface: what the optimizer, the checkpoints and the engine ask
of wherever a unit's fp32 master and state tensors live.

`OptimizerStates` is implemented by `HostOptimizerStates` and `NVMeOptimizerStates`
(offload/storage/optim_state.py) and by `SplitOptimizerStates` (offload/storage/split_states.py),
so nothing above asks which store it holds: `resident` / `resident_at` say whether the
tensors live in host memory, for callers that may then use them in place.
`UnitState` is what a store reads and writes of the optimizer's per-unit record
(`offload.optim.sharded.UnitOptimizerState`, a layer above).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from offload.storage.state_layout import UnitTensors

__all__ = ["OptimizerStates", "UnitState"]


class UnitState(Protocol):
    """One unit's optimizer state as the optimizer holds it: the host tensors, or None where
    the state lives in a swap file (the NVMe store drops the host master once it has
    written it: `OptimizerStates.initialized`)."""

    master: Optional[torch.Tensor]
    moments: Optional[dict[str, torch.Tensor]]


class OptimizerStates(Protocol):
    """Where each unit's optimizer state lives, unit by unit (by index). Used from the
    engine's thread (or the optimizer worker's, never both at once)."""

    resident: bool
    """Every unit's tensors live in host memory (`open` hands out the live tensors)."""

    def resident_at(self, index: int) -> bool:
        """Whether unit `index`'s tensors live in host memory."""

    def initialize(self, index: int, master: torch.Tensor) -> None:
        """Unit `index`'s first state: `master`, the state tensors at their zero."""

    def initialized(self, index: int, unit_state: UnitState) -> None:
        """Unit `index`'s master is complete (`offload.initialize`): the store takes it."""

    def open(self, index: int, write: bool = False,
             overwrite: bool = False) -> AbstractContextManager[UnitTensors]:
        """A context yielding the unit's tensors (checkpoints, consolidation, loading); with
        `write=True` what the caller changed is written back on exit, with `overwrite` too
        the old state is not read first (the caller sets every tensor)."""

    def stream(self, indices: Sequence[int],
               scratch_bytes: Callable[[int], int]) -> Iterator[tuple[int, UnitTensors]]:
        """The step's pipeline: each unit's tensors in order, with `scratch_bytes(index)`
        pooled bytes beside them for its new low-precision shard."""

    def checkout(self, index: int, scratch_bytes: int) -> UnitTensors:
        """One unit's tensors for one update (the optimizer in backward); give them back
        with `checkin`, or `abandon` after an error."""

    def checkin(self, index: int, t: UnitTensors) -> None:
        """Give back `checkout`'s tensors, writing them back where they live."""

    def abandon(self, index: int, t: UnitTensors) -> None:
        """Give back `checkout`'s tensors after an error: nothing is written."""

    def checkout_overwrite(self, index: int) -> UnitTensors:
        """A buffer laid out as unit `index`'s swap slot, not read (a checkpoint load fills
        every tensor); `checkin` writes it. Only for a unit not `resident_at`."""

    def adopt(self, index: int, t: UnitTensors, path: str, file_offsets: dict[str, int]) -> None:
        """Finish `checkout_overwrite` without writing: the unit is read from `path` until
        its next write ([Note: adopted state] in offload/storage/optim_state.py)."""

    def prefetch(self, indices: Sequence[int], scratch_bytes: Callable[[int], int],
                 limit: int = 2) -> None:
        """Start reading the first `limit` of these units' state ahead (nothing in memory)."""

    def cancel_prefetch(self, index: Optional[int] = None) -> None:
        """Drop the reads started ahead (all, or unit `index`'s)."""

    def settle(self) -> None:
        """After a failed step: drop reads ahead, wait for every write in flight."""

    def write_failure(self) -> Optional[BaseException]:
        """The error of a write that failed and lost a unit's state, or None."""

    def bytes_on_disk(self) -> int:
        """Bytes of the store's swap file (0 in host memory)."""

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each state tensor held in memory, with its accounting bucket ('host')."""
