"""How many threads each rank's CPU optimizer runs on: `config.cpu_adam_threads`, resolved.

The native kernels' own default (`get_num_threads`) is every core in the process's
affinity. That is right for one process and wrong for several on one node: torchrun starts
LOCAL_WORLD_SIZE ranks, each would run its optimizer on every core, and the ranks' updates,
which run at about the same time (every rank reaches the accumulation boundary together),
then share each core LOCAL_WORLD_SIZE times over: every memory-bound step is slower and the
ranks wait for the slowest. So the engine's default divides the cores among the node's
ranks (issue #30, F10).
"""

from __future__ import annotations

import os

__all__ = ["resolve_threads"]


def resolve_threads(configured: int) -> int:
    """The thread count one rank's CPU optimizer steps run on.

    `configured` > 0 (`cpu_adam_threads`) is used as given. 0, the default: the cores in
    this process's affinity (`os.sched_getaffinity(0)`: what taskset, a cgroup's cpuset or
    `torchrun --numa-binding` leave it) divided by LOCAL_WORLD_SIZE, the ranks torchrun
    started on this node (1 when unset: a launcher that does not say gets today's count,
    never fewer threads than it had), at least 1. It assumes the node's ranks share those
    cores; where a launcher gives ranks cores of their own, or a NUMA node's cores to the
    ranks of that node only, set `cpu_adam_threads` to the cores per rank."""
    if configured < 0:
        raise ValueError(f"cpu_adam_threads={configured} must be >= 0 (0 = the cores this "
                         "process may use, divided among the node's ranks)")
    if configured > 0:
        return configured
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local and not (local.isdigit() and int(local) >= 1):
        raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a positive integer; torchrun sets it "
                         "to the ranks on this node: unset it, set it so, or set cpu_adam_threads")
    return max(1, len(os.sched_getaffinity(0)) // (int(local) if local else 1))
