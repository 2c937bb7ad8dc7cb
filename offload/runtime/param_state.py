"""One parameter's fp32 value and optimizer state, read and written across the shards.

DeepSpeed's `deepspeed.utils.safe_get_full_fp32_param(param)`, `safe_set_full_fp32_param`,
`safe_get_full_optimizer_state(param, "exp_avg")`, `safe_set_full_optimizer_state` and
their `safe_get_local_*` / `safe_set_local_*` variants (offload/compat/deepspeed.py) come
here, as do `engine.param_state.full(...)` and friends.

- **Full** (`full`, `set_full`): the parameter's whole tensor, in its shape. Reading is a
  collective (each rank contributes the part its shard holds; one all-reduce of the
  parameter's size, never its unit's), writing is not (each rank copies its part in).
- **Local** (`local`, `set_local`): this rank's part, 1-D, as DeepSpeed's partition is;
  None where the rank holds none of it.
- `key`: "fp32" (the master the optimizer updates) or one of the optimizer's state names
  (Adam: "exp_avg", "exp_avg_sq"). 8-bit moments are blocks of codes and scales, not one
  value per element: refused, naming the fix (fp32/bf16 moments).
- A write goes through the optimizer's unit state (`ShardedOptimizer.load_unit_state`,
  written through to NVMe when the state lives there) and republishes the unit's
  low-precision shard from the master, so the next forward sees the new value; a resident
  unit's gathered copy (stages 1, 2) is marked stale. Frozen parameters have no master and
  no state: reads give None, writes are refused.
- Every call first lets the optimizer worker's updates land (`StepPolicy.settle`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from offload.optim.sharded import ShardedOptimizer
from offload.runtime.grads import Gradients
from offload.runtime.optimizer_step import StepPolicy
from offload.units.collectives import ProcessGroupInfo, all_reduce_host
from offload.units.shard import FROZEN_GROUP, FlatUnit

__all__ = ["ParamState"]

Param = Union[str, nn.Parameter]


class ParamState:
    """Per-parameter access to the fp32 master and optimizer state of one engine."""

    def __init__(self, grads: Gradients, units: list[FlatUnit], optimizer: ShardedOptimizer,
                 pg: ProcessGroupInfo, device: torch.device, policy: StepPolicy) -> None:
        self.grads = grads
        self.units = units
        self.optimizer = optimizer
        self.pg = pg
        self.device = device
        self.policy = policy

    # -- full ----------------------------------------------------------------------------------

    @torch.no_grad()
    def full(self, param: Param, key: str = "fp32") -> Optional[torch.Tensor]:
        """The parameter's whole `key` tensor, fp32, on the compute device (a collective:
        every rank calls it with the same parameter); None for a frozen parameter."""
        ui, si, name = self._where(param)
        slot = self.units[ui].layout.slots[si]
        if slot.group == FROZEN_GROUP:
            return None
        flat = torch.zeros(slot.numel, dtype=torch.float32)
        part = self.units[ui].layout.slot_in_shard(slot, self.pg.rank)
        with self.optimizer.unit_state(ui) as state:
            src = self._tensor(state, key, name)
            if part is not None:
                p_off, s_off, n = part
                flat[p_off:p_off + n].copy_(src[s_off:s_off + n])
        if self.pg.world_size > 1:
            flat = all_reduce_host(flat, "sum", self.pg, self.device)
        return flat.view(slot.shape).to(self.device)

    @torch.no_grad()
    def set_full(self, param: Param, value: torch.Tensor, key: str = "fp32") -> None:
        """Set the parameter's whole `key` tensor (every rank passes the same value)."""
        ui, si, name = self._where(param, writing=True)
        slot = self.units[ui].layout.slots[si]
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(f"{name}: the value has shape {tuple(value.shape)}, the parameter "
                             f"{tuple(slot.shape)}")
        part = self.units[ui].layout.slot_in_shard(slot, self.pg.rank)
        flat = value.detach().reshape(-1)
        self._write(ui, key, name, None if part is None else (part[1], flat[part[0]:part[0] + part[2]]))

    # -- this rank's part ----------------------------------------------------------------------

    @torch.no_grad()
    def local(self, param: Param, key: str = "fp32") -> Optional[torch.Tensor]:
        """This rank's part of the parameter's `key` tensor (1-D fp32, a copy); None when
        the rank holds none of it, or the parameter is frozen."""
        ui, si, name = self._where(param)
        slot = self.units[ui].layout.slots[si]
        part = self.units[ui].layout.slot_in_shard(slot, self.pg.rank)
        if slot.group == FROZEN_GROUP or part is None:
            return None
        _, s_off, n = part
        with self.optimizer.unit_state(ui) as state:
            return self._tensor(state, key, name)[s_off:s_off + n].float().clone().to(self.device)

    @torch.no_grad()
    def set_local(self, param: Param, value: torch.Tensor, key: str = "fp32") -> None:
        """Set this rank's part of the parameter's `key` tensor (`value`: as `local` gives it)."""
        ui, si, name = self._where(param, writing=True)
        slot = self.units[ui].layout.slots[si]
        part = self.units[ui].layout.slot_in_shard(slot, self.pg.rank)
        n = 0 if part is None else part[2]
        if value.numel() != n:
            raise ValueError(f"{name}: this rank holds {n} of its elements; the value has {value.numel()}")
        self._write(ui, key, name, None if part is None else (part[1], value.detach().reshape(-1)))

    # -- helpers -------------------------------------------------------------------------------

    def _where(self, param: Param, writing: bool = False) -> tuple[int, int, str]:
        err = self.policy.settle()  # the worker's updates land first
        if err is not None:
            raise err
        name, ui, si = self.grads.locate(param)
        if not writing and self.policy.updated and ui in self.policy.updated:
            self.policy.warn_read_after_update(f"{name}'s master weight or optimizer state")
        self.policy.observe()  # [Note: the update mode is learned]
        if writing and self.units[ui].layout.slots[si].group == FROZEN_GROUP:
            raise ValueError(f"{name} is frozen (requires_grad=False at initialize): it has no fp32 "
                             "master or optimizer state to set")
        if writing and self.policy.updated:
            raise RuntimeError(f"setting {name}'s state between a backward that updated units and "
                               "engine.step(): call engine.step() first")
        return ui, si, name

    def _tensor(self, state: dict, key: str, name: str) -> torch.Tensor:
        field = "master" if key == "fp32" else key
        names = ("fp32", *self.optimizer.state_names)
        if key not in names:
            raise KeyError(f"{name}: no state {key!r}; this engine's {self.optimizer.kind} keeps {list(names)}")
        t = state[field]
        if field != "master" and not t.is_floating_point():
            raise NotImplementedError(
                f"{name}: the optimizer's {key} is kept in 8 bits (blocks of codes and scales, "
                "optimizer.moments_dtype), not one value per element; use fp32 or bf16 moments to "
                "read or set it per parameter")
        return t

    def _write(self, ui: int, key: str, name: str, part: Optional[tuple[int, torch.Tensor]]) -> None:
        with self.optimizer.unit_state(ui) as state:
            self._tensor(state, key, name)  # checks the key first
            new = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        field = "master" if key == "fp32" else key
        if part is not None:
            s_off, values = part
            new[field][s_off:s_off + values.numel()].copy_(values)
        self.optimizer.load_unit_state(ui, new)  # republishes the unit's shard from the master
        self.units[ui].invalidate()  # a resident unit's gathered copy is stale now
