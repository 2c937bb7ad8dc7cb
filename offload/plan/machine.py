"""The machine a plan is for: GPUs, host memory and NVMe space per node, and what is held
back from each (the reserves).

`make_machine` builds one from human sizes ('80GiB', read by `offload.sizes.parse_bytes`:
GB = 10**9, GiB = 2**30) and reserves ('20%' or a size); `machine_from_system` measures
this node as it is now.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from offload.config import Config
from offload.sizes import format_bytes, parse_bytes

__all__ = ["Machine", "DEFAULT_RESERVES", "make_machine", "machine_from_system", "gpu_free_bytes",
           "mem_available_bytes", "format_size"]


def format_size(n: float) -> str:
    """Bytes as the planner prints them: `format_bytes` to one decimal (a table of tiers
    needs no more), and an empty tier as '0'."""
    return "0" if n == 0 else format_bytes(n, digits=1)


@dataclass(frozen=True)
class Machine:
    """What the run has, per node. Every node is assumed alike."""

    gpus_per_node: int = 0
    """GPUs per node, one rank each; 0 = compute on the CPU (the 'device' tier is then host
    memory)."""
    gpu_mem_bytes: Optional[int] = None
    """Memory of one GPU (free memory, when measured)."""
    cpu_mem_bytes: int = 0
    """Host memory of one node available to the run (MemAvailable, when measured)."""
    nvme_free_bytes: Optional[int] = None
    """Free space under nvme_path on one node; None = no NVMe (no nvme placement)."""
    world_size: int = 1
    """Ranks in the job (all nodes)."""
    ranks_per_node: Optional[int] = None
    """Ranks on one node; None = gpus_per_node, or world_size on a CPU run."""
    gpu_reserve_bytes: int = 0
    """Per GPU, held back for what the planner does not model: activations, the CUDA
    context, allocator fragmentation."""
    cpu_reserve_bytes: int = 0
    """Per node, held back for the OS, the data pipeline, the Python process itself."""
    nvme_reserve_bytes: int = 0
    """Per node, free space left on the NVMe filesystem."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size = {self.world_size}; it must be >= 1")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node = {self.gpus_per_node}; use 0 for a CPU run")
        if self.gpus_per_node and not self.gpu_mem_bytes:
            raise ValueError("gpu_mem_bytes is needed when gpus_per_node > 0 (e.g. --gpu-mem 80GiB)")
        if self.local_ranks < 1:
            raise ValueError(f"ranks_per_node = {self.ranks_per_node}; it must be >= 1")

    @property
    def local_ranks(self) -> int:
        if self.ranks_per_node is not None:
            return min(self.ranks_per_node, self.world_size)
        if self.gpus_per_node:
            return min(self.gpus_per_node, self.world_size)
        return self.world_size

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.local_ranks)

    def describe(self) -> str:
        gpu = (f"{self.gpus_per_node} GPU{'s' if self.gpus_per_node > 1 else ''} x "
               f"{format_size(self.gpu_mem_bytes or 0)}" if self.gpus_per_node
               else "no GPU (compute on the CPU)")
        nvme = ("no NVMe" if self.nvme_free_bytes is None
                else f"NVMe {format_size(self.nvme_free_bytes)} free")
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x [{gpu}, host memory "
                f"{format_size(self.cpu_mem_bytes)}, {nvme}]; world size {self.world_size} "
                f"({self.local_ranks} rank{'s' if self.local_ranks > 1 else ''} per node)")


DEFAULT_RESERVES = {"gpu": "20%", "cpu": "10%", "nvme": "5%"}
"""Held back by default: 20% of each GPU for activations and the CUDA context, 10% of host
memory for the OS and data loading, 5% of the NVMe filesystem."""


def _reserve(spec: Union[str, int, float, None], capacity: Optional[int]) -> int:
    """'20%' of capacity, or a size ('8GiB'), or bytes."""
    if spec is None or capacity is None:
        return 0
    if isinstance(spec, str) and spec.strip().endswith("%"):
        return int(capacity * float(spec.strip()[:-1]) / 100)
    return parse_bytes(spec)


def make_machine(*, gpus: int = 0, gpu_mem: Any = None, cpu_mem: Any = 0, nvme_free: Any = None,
                 world_size: Optional[int] = None, ranks_per_node: Optional[int] = None,
                 gpu_reserve: Any = DEFAULT_RESERVES["gpu"], cpu_reserve: Any = DEFAULT_RESERVES["cpu"],
                 nvme_reserve: Any = DEFAULT_RESERVES["nvme"]) -> Machine:
    """A `Machine` from human sizes ('80GiB') and reserves ('20%' or a size)."""
    gpu_b = parse_bytes(gpu_mem) if gpu_mem is not None else None
    cpu_b = parse_bytes(cpu_mem)
    nvme_b = parse_bytes(nvme_free) if nvme_free is not None else None
    ws = world_size if world_size is not None else max(1, gpus)
    return Machine(gpus_per_node=gpus, gpu_mem_bytes=gpu_b, cpu_mem_bytes=cpu_b,
                   nvme_free_bytes=nvme_b, world_size=ws, ranks_per_node=ranks_per_node,
                   gpu_reserve_bytes=_reserve(gpu_reserve, gpu_b),
                   cpu_reserve_bytes=_reserve(cpu_reserve, cpu_b),
                   nvme_reserve_bytes=_reserve(nvme_reserve, nvme_b))


def mem_available_bytes() -> int:
    """/proc/meminfo's MemAvailable (what can be allocated without swapping), else total."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemTotal", 0))
    except OSError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_free_bytes(device: torch.device) -> int:
    """GPU memory this process can still use: what the driver reports free, plus what torch's
    caching allocator holds in blocks no tensor uses (the driver counts those as used, and
    the engine allocates from them first: issue #30, F6)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def machine_from_system(config: Config, device: torch.device, world_size: int,
                        ranks_per_node: Optional[int] = None) -> Machine:
    """This node as it is now: free GPU memory of `device`, MemAvailable, free space under
    `config.offload.nvme_path` (None without one: nvme placements are then never chosen)."""
    gpus, gpu_mem = 0, None
    local = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cuda":
        gpus, gpu_mem = local, gpu_free_bytes(device)
    nvme = None
    path = config.offload.nvme_path
    if path and os.path.isdir(path):
        nvme = int(shutil.disk_usage(path).free)
    return make_machine(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=mem_available_bytes(),
                        nvme_free=nvme, world_size=world_size, ranks_per_node=local)
