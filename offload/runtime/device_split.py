"""Which units' optimizer state lives on the compute device, from the config ([Note: the update
split] in offload/storage/device_states.py): `offload.optimizer_tier: device` (every unit),
`offload.optimizer_device_units` (a count: the root and the first blocks; or unit names), or
`offload.optimizer_device_fraction` (a share of the optimizer state's bytes, filled in the same
order). `placement: auto` gets its split from the planner (offload/plan/update_split.py), which
writes it back as a count. Every rank computes the same list from the same sizes."""

from __future__ import annotations

from typing import Sequence

from offload.config.sections import Config
from offload.storage.placement import device_units_by_bytes, device_units_by_count

__all__ = ["device_units", "unit_label"]


def unit_label(name: str) -> str:
    """A unit's name as the config and the messages spell it ("<root>" for the root)."""
    return name or "<root>"


def device_units(config: Config, state_bytes: Sequence[int], names: Sequence[str]) -> list[int]:
    """The indices of the units whose optimizer state goes on the device (sorted)."""
    off = config.offload
    n = len(state_bytes)
    if off.optimizer_tier == "device":
        chosen = list(range(n))
    elif off.optimizer_device_fraction is not None:
        chosen = device_units_by_bytes(state_bytes, int(off.optimizer_device_fraction * sum(state_bytes)))
    elif isinstance(off.optimizer_device_units, int):
        chosen = device_units_by_count(n, off.optimizer_device_units)
    elif off.optimizer_device_units is not None:
        labels = [unit_label(x) for x in names]
        unknown = [u for u in off.optimizer_device_units if u not in labels]
        if unknown:
            raise ValueError(
                f"offload.optimizer_device_units names {unknown}, which are not units of this model; "
                f"its units are {labels[:8]}{' ...' if len(labels) > 8 else ''} ('<root>' holds the "
                "parameters outside every block); name some of them, or give a count")
        chosen = sorted(labels.index(u) for u in off.optimizer_device_units)
    else:
        chosen = []
    if chosen and config.optimizer.moments_dtype == "8bit":
        raise NotImplementedError(
            "optimizer.moments_dtype='8bit' keeps Adam's moments as blockwise 8-bit codes that only "
            "the CPU kernels update, so no unit's optimizer state can live on the compute device: "
            "leave offload.optimizer_device_units / optimizer_device_fraction out (optimizer_tier "
            "'cpu' or 'nvme'), or use moments_dtype 'fp32' or 'bf16'")
    return chosen
