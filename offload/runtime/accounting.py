"""What the engine holds, per kind of memory (`engine.memory_bytes()`, docs/engine.md).

'device' (compute-device memory: parameter shards on the device tier, gathered full
buffers, buffers), 'host' (CPU memory: parameter shards on the host tier, fp32 master,
gradient shards, Adam moments — with the optimizer on NVMe only the gradient shards),
'pinned' (the NVMe staging pool: every byte it holds, in use or idle; host memory too,
page-locked on a GPU run), 'nvme' (swap files: parameter shards and optimizer states,
page-rounded). On a CPU run 'device' and 'host' are both main memory, kept apart so the
split is visible. A storage shared by two tensors counts once.
"""

from __future__ import annotations

import torch

from offload.runtime.view import ShardedState

__all__ = ["memory_bytes"]


def memory_bytes(state: ShardedState) -> dict[str, int]:
    out = {"device": 0, "host": 0, "pinned": 0, "nvme": 0}
    counted: set[int] = set()

    def add(kind: str, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in counted:
            return
        counted.add(s.data_ptr())
        out[kind] += s.nbytes()

    for st in state.states:
        add("host", st.grad)
    # Each store says where its bytes count: the optimizer state first, so that a parameter
    # shard that is the fp32 master itself (fp32 on the CPU) counts once, as 'host'.
    for owner in (state.optimizer_states, state.param_tier):
        for bucket, t in owner.memory_tensors():
            add(bucket, t)
        out["nvme"] += owner.bytes_on_disk()
    for unit in state.units:
        add("device", unit.full)
    for b in state.module.buffers():
        add("device", b)
    for staging in state.optimizer.staging_buffers:
        add("host", staging)
    if state.nvme is not None:
        out["pinned"] = state.nvme.staging.pool.bytes_reserved
    return out
