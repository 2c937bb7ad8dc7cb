"""The engine's training state as checkpoints, weight export and accounting see it.

`offload.checkpoint` and the weight export functions take a `ShardedState`, never the
`Engine`: what they may read and restore is this list, not whatever the engine happens to
hold. The Engine builds one at `initialize` (`engine.sharded_state`); every field is owned
by the collaborator named beside it, the view only points at it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from offload.device_runtime import runtime

if TYPE_CHECKING:  # the seam's types; imported for the checker only (runtime/optim import this module)
    from offload.config.sections import Config
    from offload.optim.sharded import ShardedOptimizer, UnitOptimizerState
    from offload.runtime.loss_scaler import LossScaler
    from offload.storage.nvme import NVMeContext
    from offload.storage.placement import Placement
    from offload.storage.state_store import OptimizerStates
    from offload.storage.tiers import Tier
    from offload.units.collectives import ProcessGroupInfo
    from offload.units.shard import FlatUnit

__all__ = ["StepCounters", "Schedule", "Location", "StateDictEntry", "ShardedState"]


@dataclass
class StepCounters:
    """Where training is; owned by the optimizer-step policy (runtime/optimizer_step.py),
    restored by a checkpoint load."""

    global_steps: int = 0
    """Applied optimizer steps."""
    micro_steps: int = 0
    """`engine.step()` calls (micro-batches)."""
    skipped_steps: int = 0
    """Optimizer steps skipped (fp16 overflow, a non-finite loss or gradient norm)."""
    last_grad_norm: Optional[float] = None


@dataclass
class Schedule:
    """The LR scheduler stepped at every applied optimizer step (None: none). Owned by the
    optimizer-step policy (`StepPolicy.set_scheduler`, its only writer); the view holds the
    same object, so checkpoints save and restore the scheduler the policy steps."""

    scheduler: Any = None


class Location(Enum):
    """What holds the value of one `model.state_dict()` key."""

    PARAM = "param"
    """A slot of a unit: `where` is (unit index, slot index)."""
    BUFFER = "buffer"
    """A module buffer (whole on every rank, on the compute device): `where` is the tensor."""
    OTHER = "other"
    """A non-tensor extra state: `where` is the value."""


@dataclass(frozen=True)
class StateDictEntry:
    key: str
    location: Location
    where: Any


@dataclass
class ShardedState:
    """The engine, as the code around it needs it."""

    module: nn.Module
    config: "Config"
    """The typed `offload.config.Config` the engine runs with."""
    rank: int
    world_size: int
    pg: "ProcessGroupInfo"
    """`offload.units.collectives.ProcessGroupInfo`: the group and its ranks."""
    device: torch.device
    dtype: torch.dtype
    """Compute dtype of the gathered parameters."""
    units: "list[FlatUnit]"
    """`FlatUnit`s, in unit order (index 0 is the root)."""
    states: "list[UnitOptimizerState]"
    """Per unit, its `UnitOptimizerState` (gradient shard, step counts, ...)."""
    optimizer: "ShardedOptimizer"
    """`offload.optim.sharded.ShardedAdam`: param groups, per-unit state in and out."""
    param_tier: "Tier"
    optimizer_states: "OptimizerStates"
    """The optimizer-state store (host memory or NVMe)."""
    nvme: "Optional[NVMeContext]"
    """The rank's `NVMeContext` (swap directory, AIO handle, staging pool) or None."""
    scaler: "LossScaler"
    """`LossScaler` (fp16 loss scale; its state_dict goes into checkpoints)."""
    counters: StepCounters
    placement: "Placement"
    """Per unit, the tier kind of its parameter shard and of its optimizer state (what
    `initialize` built: offload/storage/placement.py)."""
    units_chosen: str = ""
    """What the unit policy chose, in words (`offload.units.partition.describe_units`)."""
    state_dict_index: list[StateDictEntry] = field(default_factory=list)
    """For each key of `module.state_dict()`, in order: what holds its value."""
    buffer_dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    """id(buffer) -> the dtype the model gave it (buffers run in the compute dtype)."""
    schedule: Schedule = field(default_factory=Schedule)

    @property
    def lr_scheduler(self) -> Any:
        return self.schedule.scheduler

    def sync_device(self) -> None:
        """Wait for the compute device's queued work (host-to-device copies read host shards
        that a load is about to rewrite)."""
        rt = runtime()
        if rt.has_streams(self.device):
            rt.synchronize(rt.current_stream(self.device))
