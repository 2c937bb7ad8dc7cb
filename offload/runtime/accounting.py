"""What the engine holds, per kind of memory (`engine.memory_bytes()`, docs/engine.md).

'device' (compute-device memory: parameter shards on the device tier, gathered full
buffers, hpZ's node-local copies, buffers), 'host' (CPU memory: parameter shards on the host
tier, fp32 master, gradient shards, Adam moments — with the optimizer on NVMe only the
gradient shards; a unit whose optimizer state is on the device counts its master, moments
and gradient shard as 'device'), 'pinned' (the NVMe staging pool: every byte it holds, in use or idle; host
memory too, page-locked on a GPU run), 'nvme' (swap files: parameter shards and optimizer states,
page-rounded). On a CPU run 'device' and 'host' are both main memory, kept apart so the
split is visible. A storage shared by two tensors counts once.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from offload.runtime.view import ShardedState

__all__ = ["memory_bytes", "device_tensors"]


def _held(state: ShardedState) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the engine holds in memory with the bucket it counts in; the first
    bucket a storage appears under is the one it counts in."""
    for st in state.states:
        yield ("device" if st.on_device else "host"), st.grad  # a device unit's is device memory
    # Each store says where its bytes count: the optimizer state first, so that a parameter
    # shard that is the fp32 master itself (fp32 on the CPU) counts once, as 'host'.
    for owner in (state.optimizer_states, state.param_tier):
        yield from owner.memory_tensors()
    for unit in state.units:
        yield "device", unit.full
        if unit.secondary is not None and unit.secondary.copy is not None:
            yield "device", unit.secondary.copy  # hpZ's node-local copy, until the unit's update
    for b in state.module.buffers():
        yield "device", b
    for staging in state.optimizer.staging_buffers:
        yield "host", staging


def _first_bucket(state: ShardedState) -> Iterator[tuple[str, torch.Tensor]]:
    """`_held`, each storage once (empty ones left out)."""
    counted: set[int] = set()
    for kind, t in _held(state):
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in counted:
            continue
        counted.add(s.data_ptr())
        yield kind, t


def device_tensors(state: ShardedState) -> list[torch.Tensor]:
    """One tensor per storage counted as 'device' (what `engine.offload_states()` parks)."""
    return [t for kind, t in _first_bucket(state) if kind == "device"]


def memory_bytes(state: ShardedState, parked: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """`parked`: host copies of device storages (`engine.offload_states()`), counted as 'host'."""
    out = {"device": 0, "host": 0, "pinned": 0, "nvme": 0}
    for kind, t in _first_bucket(state):
        out[kind] += t.untyped_storage().nbytes()
    out["host"] += sum(t.untyped_storage().nbytes() for t in parked)
    for owner in (state.optimizer_states, state.param_tier):
        out["nvme"] += owner.bytes_on_disk()
    if state.nvme is not None:
        out["pinned"] = state.nvme.staging.pool.bytes_reserved
    return out
