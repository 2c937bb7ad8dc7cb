"""The kinds of tier, as an Enum with a spec each: what placement, the builder, the planner
and the accounting read instead of matching the names "device", "cpu" and "nvme".

`TierKind` values are the config's names (`offload.param_tier`, `offload.optimizer_tier`).
Its `spec` says what the rest of the engine needs to know of a kind:

- `factory` builds a parameter tier of this kind (`make_param_tier`);
- `addressable`: compute reads its shards where they are (memory), or they are fetched
  into a buffer first (swap files);
- `on_disk`: its bytes are swap-file slots, so it needs `nvme_path`, the swap files' free
  space and the pinned staging pool, and placement may keep some units in RAM instead;
- `ram_kind`: where a unit that placement keeps out of this kind's files lives (NVMe's: the
  host tier; a memory kind's: itself);
- `bucket`: the `memory_bytes()` kind of memory its shards take on a GPU run ('device' or
  'host'; None: on disk, counted as 'nvme').

A new tier (a second NVMe device, CXL memory) is one class implementing `Tier`
(offload/storage/tiers.py) and one member here with its spec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch

from offload.storage.nvme import NVMeContext
from offload.storage.nvme_tier import NVMeTier
from offload.storage.tiers import DeviceTier, HostTier, Tier

__all__ = ["TierKind", "TierSpec", "make_param_tier"]

Shards = Sequence[tuple[Hashable, int, torch.dtype]]
Factory = Callable[[torch.device, bool, Optional[NVMeContext], Shards], Tier]


@dataclass(frozen=True)
class TierSpec:
    """What the engine needs to know of one kind of tier (the module docstring)."""

    factory: Factory
    addressable: bool
    on_disk: bool
    ram_kind: "TierKind"
    bucket: Optional[str]


class TierKind(enum.Enum):
    """Where a tier keeps its shards; the values are the config's names."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"

    @classmethod
    def of(cls, name: "str | TierKind", key: str = "offload.param_tier") -> "TierKind":
        """The kind named `name` (the config's spelling), or a ValueError naming `key`."""
        if isinstance(name, TierKind):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"{key}={name!r}; allowed: {', '.join(repr(k.value) for k in cls)}") from None

    @property
    def spec(self) -> TierSpec:
        return _SPECS[self]


def _device(device: torch.device, pin_memory: bool, nvme: Optional[NVMeContext], shards: Shards) -> Tier:
    return DeviceTier(device)


def _host(device: torch.device, pin_memory: bool, nvme: Optional[NVMeContext], shards: Shards) -> Tier:
    return HostTier(pin_memory=pin_memory and device.type == "cuda")


def _nvme(device: torch.device, pin_memory: bool, nvme: Optional[NVMeContext], shards: Shards) -> Tier:
    if nvme is None:
        raise ValueError(
            "offload.param_tier='nvme' needs the rank's NVMe context (swap directory, AIO "
            "handle, staging pool); offload.initialize builds it from offload.nvme_path")
    return NVMeTier(nvme, shards)


_SPECS: dict[TierKind, TierSpec] = {
    TierKind.DEVICE: TierSpec(_device, addressable=True, on_disk=False, ram_kind=TierKind.DEVICE, bucket="device"),
    TierKind.CPU: TierSpec(_host, addressable=True, on_disk=False, ram_kind=TierKind.CPU, bucket="host"),
    TierKind.NVME: TierSpec(_nvme, addressable=False, on_disk=True, ram_kind=TierKind.CPU, bucket=None),
}


def make_param_tier(
    param_tier: "str | TierKind",
    compute_device: torch.device,
    pin_memory: bool,
    nvme: Optional[NVMeContext] = None,
    shards: Shards = (),
) -> Tier:
    """The tier for low-precision parameter shards, from `config.offload.param_tier`.
    'nvme' needs the rank's `NVMeContext` and every shard (key, numel, dtype) up front."""
    return TierKind.of(param_tier).spec.factory(compute_device, pin_memory, nvme, shards)
