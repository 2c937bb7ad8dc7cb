"""The memory planner: how many bytes each tier needs for each placement, and which to use.

    python -m offload.plan --params 7e9 --gpus 8 --gpu-mem 80GiB --cpu-mem 1TiB --nvme-free 4TiB
    plan(model)                      # a model (may be built on the meta device)
    plan(7e9, machine=Machine(...))  # a parameter count

A placement is (where the low-precision parameter shards live, where the fp32 master and
Adam moments live): params `device` / `cpu` / `nvme` x optimizer `cpu` / `nvme`. For each,
the planner computes the bytes the engine holds between steps in each tier (GPU, host, NVMe)
per rank and per node, whether that fits the machine after its reserves, and recommends the
fastest placement that fits.

[Note: the figures are the engine's]
Nothing here is a separate guess of "bytes per parameter". The units come from the engine's
wrap policy (`offload.units.partition.plan_units`), the groups from `offload.optim.sharded.resolve_param_groups`,
the flat layout (alignment, padding to the world size) from `offload.units.shard.layout_unit`, the
dtypes from the config (`offload.optim.sharded.moments_dtype`), and `_rank_bytes` applies the engine's
allocation rules unit by unit (which buffers exist, which are aliased, which tier each lands
in). tests/test_plan.py pins the result to `Engine.memory_bytes()` after a training step.
A bare parameter count is laid out as equal units through the same functions.

What is *not* modelled: activations (they are the user's: batch, sequence length,
checkpointing), the CUDA context and allocator fragmentation, the user's data pipeline.
The reserves (`Machine.*_reserve_bytes`) stand for them; the working set of gathered
parameters and gradient buffers during forward/backward is reported as an estimate.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from offload.config import Config, load_config
from offload.units.shard import FROZEN_GROUP, UnitLayout, align_up, layout_unit
from offload.optim.sharded import (
    host_state_bytes,
    moments_dtype,
    resolve_param_groups,
    transient_grad_shards,
)
from offload.units.partition import plan_units

__all__ = ["Machine", "TierBytes", "PlacementEstimate", "Plan", "plan", "resolve_placement",
           "machine_from_system", "PLACEMENTS", "parse_bytes", "parse_count"]

logger = logging.getLogger("offload")

_KiB, _MiB, _GiB, _TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_NVME_ALIGN_BYTES = 4 * _KiB
"""Swap-file offsets and sizes are O_DIRECT-aligned (offload.storage.io); each tensor of a unit's
state is rounded up to it on NVMe."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

PLACEMENTS: tuple[tuple[str, str], ...] = (
    ("device", "cpu"),
    ("cpu", "cpu"),
    ("nvme", "cpu"),
    ("device", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)
"""Every (param_tier, optimizer_tier), fastest first. [Note: placement order]

Parameters: device > cpu > nvme; optimizer: cpu > nvme. Across the two, the order follows
the per-step traffic on the slowest link, the disk (DESIGN.md, "Numbers to design for"):
optimizer states on NVMe move 12 B read + 12 B written per parameter per step, parameters
on NVMe 2 B per gather (forward and backward) + 2 B written, so params-on-NVMe with the
optimizer in memory (about 6 B/param of disk traffic) beats any optimizer-on-NVMe placement
(24-30 B/param). Without NVMe, params on the host cost PCIe copies (2 B per gather) that
device-resident shards do not."""

_DISK_BYTES_PER_PARAM = {("device", "cpu"): 0, ("cpu", "cpu"): 0, ("nvme", "cpu"): 6,
                         ("device", "nvme"): 24, ("cpu", "nvme"): 24, ("nvme", "nvme"): 30}
"""Disk bytes moved per trainable parameter per step at a 2-byte compute dtype (see the note
above); shown in the table so the order can be checked."""

_REASONS = {
    ("device", "cpu"): "parameter shards stay in GPU memory (no host-to-device copy per gather) "
                       "and the optimizer runs from host memory (no disk traffic)",
    ("cpu", "cpu"): "everything stays in memory (no disk traffic); parameter shards are "
                    "copied from pinned host memory at each gather",
    ("nvme", "cpu"): "optimizer states stay in host memory; only parameter shards are paged "
                     "through NVMe (about 6 B/param of disk traffic per step)",
    ("device", "nvme"): "parameter shards fit in GPU memory; optimizer states are paged "
                        "through NVMe (24 B/param of disk traffic per step)",
    ("cpu", "nvme"): "parameter shards fit in host memory; optimizer states are paged "
                     "through NVMe (24 B/param of disk traffic per step)",
    ("nvme", "nvme"): "only NVMe holds the training state; everything is paged through it "
                      "(about 30 B/param of disk traffic per step)",
}


# --------------------------------------------------------------------------------------
# Parsing sizes and counts (the CLI's, also useful to callers)
# --------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": _KiB, "mib": _MiB, "gib": _GiB,
          "tib": _TiB}


def parse_bytes(text: Union[str, int, float]) -> int:
    """'80GiB', '80GB', '512G', '2TiB', '1.5e9', 1024 -> bytes (GB = 10**9, GiB = 2**30)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512GB, 2TiB or a "
                         "number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_count(text: Union[str, int, float]) -> int:
    """'7e9', '7B', '350M', '1.3b' -> a parameter count."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(text))
    if m is None:
        raise ValueError(f"cannot read {text!r} as a parameter count; write e.g. 7e9, 7B or 350M")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _fmt(n: float) -> str:
    if n == 0:
        return "0"
    for unit, size in (("TiB", _TiB), ("GiB", _GiB), ("MiB", _MiB), ("KiB", _KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_count(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------


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
               f"{_fmt(self.gpu_mem_bytes or 0)}" if self.gpus_per_node else "no GPU (compute on the CPU)")
        nvme = "no NVMe" if self.nvme_free_bytes is None else f"NVMe {_fmt(self.nvme_free_bytes)} free"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x [{gpu}, host memory "
                f"{_fmt(self.cpu_mem_bytes)}, {nvme}]; world size {self.world_size} "
                f"({self.local_ranks} rank{'s' if self.local_ranks > 1 else ''} per node)")


def _reserve(spec: Union[str, int, float, None], capacity: Optional[int]) -> int:
    """'20%' of capacity, or a size ('8GiB'), or bytes."""
    if spec is None or capacity is None:
        return 0
    if isinstance(spec, str) and spec.strip().endswith("%"):
        return int(capacity * float(spec.strip()[:-1]) / 100)
    return parse_bytes(spec)


DEFAULT_RESERVES = {"gpu": "20%", "cpu": "10%", "nvme": "5%"}
"""Held back by default: 20% of each GPU for activations and the CUDA context, 10% of host
memory for the OS and data loading, 5% of the NVMe filesystem."""


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


def _mem_available_bytes() -> int:
    """/proc/meminfo's MemAvailable (what can be allocated without swapping), else total."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemTotal", 0))
    except OSError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_from_system(config: Config, device: torch.device, world_size: int,
                        ranks_per_node: Optional[int] = None) -> Machine:
    """This node as it is now: free GPU memory of `device`, MemAvailable, free space under
    `config.offload.nvme_path` (None without one: nvme placements are then never chosen)."""
    gpus, gpu_mem = 0, None
    local = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        gpus, gpu_mem = local, int(free)
    nvme = None
    path = config.offload.nvme_path
    if path and os.path.isdir(path):
        nvme = int(shutil.disk_usage(path).free)
    return make_machine(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=_mem_available_bytes(),
                        nvme_free=nvme, world_size=world_size, ranks_per_node=local)


# --------------------------------------------------------------------------------------
# The model's layout, as the engine builds it
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UnitSpec:
    layout: UnitLayout
    trainable: bool
    """Some parameter requires grad: the engine allocates an fp32 gradient shard."""


@dataclass(frozen=True)
class _ModelSpec:
    units: tuple[_UnitSpec, ...]
    """Index 0 is the root unit, as in the engine."""
    buffer_bytes: int
    """Module buffers, whole on every rank's compute device, floating ones in compute dtype."""
    params: int
    trainable_params: int


def _spec_from_model(model: nn.Module, config: Config, optimizer: Any, world_size: int,
                     p_bytes: int) -> _ModelSpec:
    # Exactly Engine._build_units' grouping and layout (see [Note: the figures are the engine's]).
    plans = plan_units(model, config.unit_modules)
    _groups, group_of, _ = resolve_param_groups(model, config.optimizer, optimizer)
    units = []
    params = trainable = 0
    for plan_ in plans:
        entries = []
        for rec in plan_.params:
            p = rec.param
            g = group_of.get(id(p), FROZEN_GROUP) if p.requires_grad else FROZEN_GROUP
            entries.append((rec.name, tuple(p.shape), g))
            params += p.numel()
            trainable += p.numel() if g != FROZEN_GROUP else 0
        layout = layout_unit(entries, world_size)
        units.append(_UnitSpec(layout, any(rec.param.requires_grad for rec in plan_.params)))
    seen: set[int] = set()
    buffer_bytes = 0
    for b in model.buffers():
        if id(b) in seen:
            continue
        seen.add(id(b))
        buffer_bytes += b.numel() * (p_bytes if b.is_floating_point() else b.element_size())
    return _ModelSpec(tuple(units), buffer_bytes, params, trainable)


def default_units(params: int) -> int:
    """Units for a bare parameter count: one per ~200M parameters (a 7B model: 35), at least
    one; a transformer's blocks are typically of that order."""
    return max(1, round(params / 2e8))


def _spec_from_count(params: int, world_size: int, units: Optional[int]) -> _ModelSpec:
    """A bare count laid out as `units` equal trainable units under an empty root (the
    engine always has a root), through the engine's own layout function."""
    n = units or default_units(params)
    per, extra = divmod(params, n)
    specs = [_UnitSpec(layout_unit([], world_size), False)]
    for i in range(n):
        numel = per + (1 if i < extra else 0)
        specs.append(_UnitSpec(layout_unit([(f"unit{i}", (numel,), 0)], world_size), True))
    return _ModelSpec(tuple(specs), 0, params, params)


# --------------------------------------------------------------------------------------
# Bytes per tier
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierBytes:
    device: int = 0
    """Compute-device memory (GPU; host memory on a CPU run)."""
    host: int = 0
    """Host memory: shards, master, moments, gradients (pinned where a GPU copies them)."""
    pinned: int = 0
    """The NVMe tier's pinned staging pool (host memory too): its budget, an upper bound."""
    nvme: int = 0
    """Swap-file bytes."""

    def __add__(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(self.device + other.device, self.host + other.host,
                         self.pinned + other.pinned, self.nvme + other.nvme)

    def max(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(max(self.device, other.device), max(self.host, other.host),
                         max(self.pinned, other.pinned), max(self.nvme, other.nvme))

    @property
    def host_total(self) -> int:
        return self.host + self.pinned

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "pinned": self.pinned, "nvme": self.nvme}


def _nvme(nbytes: int) -> int:
    return align_up(nbytes, _NVME_ALIGN_BYTES) if nbytes else 0


def _rank_bytes(spec: _ModelSpec, rank: int, param_tier: str, optimizer_tier: str, *,
                p_bytes: int, m_bytes: int, on_gpu: bool, pinned_budget_bytes: int,
                transient_grads: bool = False) -> TierBytes:
    """What `Engine.memory_bytes()` reports on `rank` between steps (after the first step).

    The engine's rules, unit by unit (offload/engine.py `_build_units`, offload/optim/sharded.py):
    - fp32 master: the whole shard; fp32 gradient shard: the whole shard if any parameter
      of the unit is trainable; exp_avg and exp_avg_sq: the shard's optimized prefix, in
      the moments dtype. Host memory, or (optimizer on NVMe) master and moments in the
      swap file, each 4 KiB-aligned, while the gradient shard stays in host memory (it is
      the reduce-scatter's target, accumulated over micro-batches) — except when the
      shards are transient (`offload.optim.sharded.transient_grad_shards`: every update runs during
      backward on a CPU run): then none is held between steps (one unit's during
      backward, counted in the working set).
    - the parameter shard (compute dtype) in its tier; with fp32 compute and the shard in
      host memory (a CPU run, or param_tier cpu) it *is* the master: no second buffer.
    - gathered full buffers are freed between steps (at world size 1 with the shard on the
      compute device the full buffer is the shard: nothing more).
    - buffers: on the compute device.
    - the optimizer's low-precision staging buffer (one largest shard, host) exists when
      the parameter shard is GPU memory and the optimizer state is in host memory; with an
      NVMe tier the new shard is written into the staging pool's scratch instead.
    - with any NVMe tier, the pinned staging pool ('pinned'): at most `pinned_budget_bytes`.
    """
    dev = host = nvme = 0
    shard_in_host = param_tier == "cpu" or (param_tier == "device" and not on_gpu)
    alias_master = p_bytes == 4 and shard_in_host and optimizer_tier == "cpu"
    staging = 0
    for u in spec.units:
        layout = u.layout
        shard = layout.shard_numel
        opt = layout.shard_optimized_numel(rank)
        master_b, moments_b = shard * 4, opt * m_bytes
        grad_b = shard * 4 if u.trainable and not transient_grads else 0
        host += grad_b
        if optimizer_tier == "cpu":
            host += host_state_bytes(master_b) + 2 * host_state_bytes(moments_b)
        else:
            nvme += _nvme(master_b) + 2 * _nvme(moments_b)
        if not alias_master:
            shard_b = shard * p_bytes
            if param_tier == "nvme":
                nvme += _nvme(shard_b)
            elif param_tier == "device" and on_gpu:
                dev += shard_b
            elif param_tier == "device":
                dev += shard_b  # a CPU run: the compute device is host memory, counted apart
            else:
                host += shard_b
        if (p_bytes != 4 and param_tier == "device" and on_gpu and optimizer_tier == "cpu"
                and any(s.group != FROZEN_GROUP for s in layout.slots)):
            staging = max(staging, shard * p_bytes)
    dev += spec.buffer_bytes
    host += staging
    pinned = pinned_budget_bytes if "nvme" in (param_tier, optimizer_tier) else 0
    return TierBytes(dev, host, pinned, nvme)


def _working_bytes(spec: _ModelSpec, param_tier: str, *, p_bytes: int, on_gpu: bool,
                   world_size: int) -> int:
    """Compute-device bytes the engine adds during forward/backward (an estimate, not
    counting activations): the root's full buffer and gradients (held from its forward to
    the end of backward), plus the largest other unit's full buffer, its gradients and the
    fp32 flat buffer its reduce-scatter uses. Prefetch (issue 7) adds up to
    `prefetch.prefetch_bytes + prefetch.keep_bytes` on top when it lands."""
    shard_on_device = param_tier == "device" or (param_tier == "cpu" and not on_gpu)
    aliased = world_size == 1 and shard_on_device
    fast_reduce = world_size == 1 and not on_gpu  # straight into the host grad shard

    def unit_bytes(u: _UnitSpec) -> int:
        full = 0 if aliased else u.layout.padded_numel * p_bytes
        grads = u.layout.numel * p_bytes if u.trainable else 0
        reduce = 0 if fast_reduce or not u.trainable else u.layout.padded_numel * 4
        return full + grads + reduce

    root, rest = spec.units[0], spec.units[1:]
    return unit_bytes(root) + max((unit_bytes(u) for u in rest), default=0)


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementEstimate:
    param_tier: str
    optimizer_tier: str
    per_rank: TierBytes
    """The largest rank's bytes per tier between steps (ranks differ only by padding)."""
    per_node: TierBytes
    """The fullest node's bytes per tier: the sum over its ranks."""
    working_device_bytes: int
    """Estimated extra compute-device bytes per rank during forward/backward (no activations)."""
    disk_bytes_per_step: int
    """Per rank: bytes read + written on NVMe per optimizer step (see PLACEMENTS)."""
    fits: bool
    problems: tuple[str, ...]
    """Why it does not fit (or cannot run), one line per tier."""

    @property
    def name(self) -> str:
        return f"{self.param_tier}/{self.optimizer_tier}"


@dataclass(frozen=True)
class Plan:
    params: int
    trainable_params: int
    dtype: str
    moments: str
    machine: Machine
    estimates: tuple[PlacementEstimate, ...]
    """One per placement, fastest first."""
    recommended: Optional[PlacementEstimate]
    reason: str

    def estimate(self, param_tier: str, optimizer_tier: str) -> PlacementEstimate:
        for e in self.estimates:
            if (e.param_tier, e.optimizer_tier) == (param_tier, optimizer_tier):
                return e
        raise KeyError(f"no placement {param_tier}/{optimizer_tier}")

    def config_snippet(self) -> dict[str, Any]:
        if self.recommended is None:
            return {}
        return {"offload": {"param_tier": self.recommended.param_tier,
                            "optimizer_tier": self.recommended.optimizer_tier}}

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "trainable_params": self.trainable_params,
            "dtype": self.dtype, "moments": self.moments, "machine": asdict(self.machine),
            "placements": [
                {"param_tier": e.param_tier, "optimizer_tier": e.optimizer_tier,
                 "per_rank": e.per_rank.as_dict(), "per_node": e.per_node.as_dict(),
                 "working_device_bytes": e.working_device_bytes,
                 "disk_bytes_per_step": e.disk_bytes_per_step, "fits": e.fits,
                 "problems": list(e.problems)}
                for e in self.estimates
            ],
            "recommended": None if self.recommended is None else self.recommended.name,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        m = self.machine
        gpu_word = "GPU" if m.gpus_per_node else "device"
        lines = [
            f"offload memory plan: {_fmt_count(self.params)} parameters "
            f"({_fmt_count(self.trainable_params)} trainable), {self.dtype} compute, "
            f"{self.moments} Adam moments",
            f"machine: {m.describe()}",
            f"reserved (not planned into): {'GPU ' + _fmt(m.gpu_reserve_bytes) + ' per GPU, ' if m.gpus_per_node else ''}"
            f"host {_fmt(m.cpu_reserve_bytes)} per node"
            f"{', NVMe ' + _fmt(m.nvme_reserve_bytes) + ' per node' if m.nvme_free_bytes is not None else ''}",
            "activations are the model's and are NOT modelled: the reserves must hold them "
            "(and the CUDA context); 'work' is the engine's gathered parameters and gradient "
            "buffers during forward/backward (estimate); 'pinned' is the NVMe staging budget; "
            "host/node includes it.",
            "",
        ]
        head = ["params", "optimizer", f"{gpu_word}/rank", "work/rank", "host/rank", "pinned/rank",
                "nvme/rank", "host/node", "nvme/node", "disk/step", "fits"]
        rows = []
        for e in self.estimates:
            rows.append([e.param_tier, e.optimizer_tier, _fmt(e.per_rank.device),
                         _fmt(e.working_device_bytes), _fmt(e.per_rank.host), _fmt(e.per_rank.pinned),
                         _fmt(e.per_rank.nvme), _fmt(e.per_node.host_total), _fmt(e.per_node.nvme),
                         _fmt(e.disk_bytes_per_step),
                         "yes" if e.fits else "no: " + "; ".join(e.problems)])
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head) - 1)]
        fmt_row = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]  # noqa: E731
        lines.append(fmt_row(head))
        lines.extend(fmt_row(r) for r in rows)
        lines.append("")
        if self.recommended is None:
            lines.append(f"no placement fits: {self.reason}")
        else:
            lines.append(f"recommended: params {self.recommended.param_tier}, optimizer "
                         f"{self.recommended.optimizer_tier} -- {self.reason}")
            lines.append(f"config: {json.dumps(self.config_snippet())}")
        return "\n".join(lines)


def plan(
    model_or_params: Union[nn.Module, int, float, str],
    *,
    machine: Optional[Machine] = None,
    config: Any = None,
    optimizer: Any = None,
    dtype: Optional[str] = None,
    moments: Optional[str] = None,
    units: Optional[int] = None,
    placements: Sequence[tuple[str, str]] = PLACEMENTS,
) -> Plan:
    """Bytes per tier for each placement of `model_or_params` on `machine`, and the fastest
    placement that fits.

    model_or_params: an `nn.Module` (built on any device, the meta device included: only
        shapes are read; frozen parameters get no moments; `config.unit_modules` and
        `optimizer` groups are honoured as `initialize` would) or a parameter count.
    machine: a `Machine` (see `make_machine`); None = this machine as it is now, world size 1.
    config: an `offload.Config` / dict / path; dtype, moments, pinned budget and unit policy
        come from it, unless `dtype` ('fp32'/'bf16'/'fp16') or `moments` ('fp32'/'bf16')
        override them.
    units: for a bare count, how many equal units to lay it out in (default
        `default_units`).
    """
    cfg = load_config(config)
    dtype = dtype or cfg.precision.dtype
    moments = moments or cfg.optimizer.moments_dtype
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype = {dtype!r}; allowed: {sorted(_DTYPE_BYTES)}")
    m_bytes = torch.empty(0, dtype=moments_dtype(moments)).element_size()
    p_bytes = _DTYPE_BYTES[dtype]
    if machine is None:
        machine = machine_from_system(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"), 1)
    ws = machine.world_size
    if isinstance(model_or_params, nn.Module):
        spec = _spec_from_model(model_or_params, cfg, optimizer, ws, p_bytes)
    else:
        count = parse_count(model_or_params)
        if count < 1:
            raise ValueError(f"a model needs at least one parameter, got {model_or_params!r}")
        spec = _spec_from_count(count, ws, units)
    on_gpu = machine.gpus_per_node > 0

    estimates = []
    for pt, ot in placements:
        per_rank = TierBytes()
        transient = transient_grad_shards(cfg, on_gpu)
        rank_list = [_rank_bytes(spec, r, pt, ot, p_bytes=p_bytes, m_bytes=m_bytes, on_gpu=on_gpu,
                                 pinned_budget_bytes=cfg.offload.pinned_budget_bytes,
                                 transient_grads=transient)
                     for r in range(ws)]
        for rb in rank_list:
            per_rank = per_rank.max(rb)
        per_node = TierBytes()
        for start in range(0, ws, machine.local_ranks):
            node = TierBytes()
            for rb in rank_list[start : start + machine.local_ranks]:
                node = node + rb
            per_node = per_node.max(node)
        work = _working_bytes(spec, pt, p_bytes=p_bytes, on_gpu=on_gpu, world_size=ws)
        if transient:  # the fp32 gradient shards of the units between reduce and update
            work += 2 * max((u.layout.shard_numel * 4 for u in spec.units if u.trainable), default=0)
        disk = 0
        if "nvme" in (pt, ot):
            scale = p_bytes / 2  # the table is for a 2-byte compute dtype
            params_bytes = 6 * scale if pt == "nvme" else 0
            opt_bytes = 24 if ot == "nvme" else 0
            disk = int(spec.trainable_params / ws * (opt_bytes + params_bytes))
            if pt == "nvme" and spec.trainable_params < spec.params:
                disk += int((spec.params - spec.trainable_params) / ws * 4 * scale)
        problems = _problems(machine, per_rank, per_node, work, pt, ot)
        estimates.append(PlacementEstimate(pt, ot, per_rank, per_node, work, disk,
                                           not problems, tuple(problems)))
    fitting = [e for e in estimates if e.fits]
    if fitting:
        best = fitting[0]
        slower = [e.name for e in estimates[: estimates.index(best)]]
        reason = _REASONS[(best.param_tier, best.optimizer_tier)]
        if slower:
            reason += f"; faster placements do not fit ({', '.join(slower)})"
    else:
        best = None
        last = estimates[-1] if estimates else None
        reason = ("even the smallest placement needs more than the machine has: "
                  + "; ".join(last.problems) if last else "no placements given")
    return Plan(spec.params, spec.trainable_params, dtype, moments, machine, tuple(estimates),
                best, reason)


def _problems(m: Machine, rank: TierBytes, node: TierBytes, work: int, pt: str, ot: str) -> list[str]:
    out = []
    if "nvme" in (pt, ot):
        if m.nvme_free_bytes is None:
            out.append("no NVMe (give --nvme-free / set offload.nvme_path)")
        elif node.nvme > m.nvme_free_bytes - m.nvme_reserve_bytes:
            out.append(f"NVMe {_fmt(node.nvme)} > {_fmt(m.nvme_free_bytes - m.nvme_reserve_bytes)}")
    if m.gpus_per_node:
        gpu_cap = (m.gpu_mem_bytes or 0) - m.gpu_reserve_bytes
        if rank.device + work > gpu_cap:
            out.append(f"GPU {_fmt(rank.device + work)} > {_fmt(gpu_cap)}")
        host_need = node.host_total
    else:
        # A CPU run: device memory is host memory, and every local rank has a working set.
        host_need = node.host_total + node.device + work * m.local_ranks
    host_cap = m.cpu_mem_bytes - m.cpu_reserve_bytes
    if host_need > host_cap:
        out.append(f"host {_fmt(host_need)} > {_fmt(host_cap)}")
    return out


# --------------------------------------------------------------------------------------
# placement: "auto" (called by Engine.__init__)
# --------------------------------------------------------------------------------------


def resolve_placement(model: nn.Module, config: Config, optimizer: Any, pg: Any,
                      device: torch.device) -> tuple[Config, Plan]:
    """`config` with param_tier / optimizer_tier chosen by the planner for this machine.

    Every rank measures its machine (free GPU memory, MemAvailable, free NVMe space) and the
    ranks agree on the minimum of each, so all choose the same placement. Raises
    `MemoryError` with the figures when nothing fits."""
    machine = machine_from_system(config, device, pg.world_size)
    if pg.world_size > 1:
        import offload.units.collectives as _dist

        values = [machine.gpu_mem_bytes or 0, machine.cpu_mem_bytes,
                  -1 if machine.nvme_free_bytes is None else machine.nvme_free_bytes]
        t = torch.tensor([-float(v) for v in values], dtype=torch.float64,
                         device=_dist.collective_device(pg, device))
        _dist.all_reduce_max_(t, pg)
        gpu, cpu, nvme = (int(-v) for v in t.cpu().tolist())
        machine = make_machine(gpus=machine.gpus_per_node, gpu_mem=gpu or None, cpu_mem=cpu,
                               nvme_free=None if nvme < 0 else nvme, world_size=pg.world_size,
                               ranks_per_node=machine.local_ranks)
    result = plan(model, machine=machine, config=config, optimizer=optimizer)
    if result.recommended is None:
        raise MemoryError(f"offload.placement='auto': {result.reason}\n{result}")
    best = result.recommended
    offload_cfg = replace(config.offload, param_tier=best.param_tier, optimizer_tier=best.optimizer_tier,
                          placement="manual")
    if pg.rank == 0:
        logger.info("offload.placement='auto' chose params=%s, optimizer=%s: %s "
                    "(per rank: device %s, host %s, nvme %s; machine: %s)",
                    best.param_tier, best.optimizer_tier, result.reason, _fmt(best.per_rank.device),
                    _fmt(best.per_rank.host), _fmt(best.per_rank.nvme), machine.describe())
    return replace(config, offload=offload_cfg), result


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m offload.plan",
        description="Bytes per tier (GPU, host, NVMe) for each placement of a model, and the "
                    "fastest placement that fits. Activations are not modelled: the reserves "
                    "hold them.")
    p.add_argument("--params", required=True, help="parameter count: 7e9, 7B, 350M")
    p.add_argument("--trainable", default=None,
                   help="trainable parameters (default: all); the rest are frozen (no moments)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per node (default: this machine's; 0 = compute on the CPU)")
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GiB (default: this machine's)")
    p.add_argument("--cpu-mem", default=None, help="host memory per node, e.g. 512GiB (default: "
                   "this machine's MemAvailable)")
    p.add_argument("--nvme-free", default=None, help="free NVMe space per node, e.g. 2TiB "
                   "(default: none, unless --nvme-path)")
    p.add_argument("--nvme-path", default=None, help="measure free space of this directory")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks in the job (default: --gpus, or 1); more than --gpus means several nodes")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPE_BYTES), help="compute dtype")
    p.add_argument("--moments", default="fp32", choices=["fp32", "bf16"], help="Adam moments dtype")
    p.add_argument("--units", type=int, default=None,
                   help="units (transformer blocks) to lay the count out in (default: one per ~200M)")
    p.add_argument("--pinned-budget", default="1GiB", help="pinned staging budget for NVMe tiers")
    p.add_argument("--gpu-reserve", default=DEFAULT_RESERVES["gpu"],
                   help="per GPU, held back for activations and the CUDA context: '20%%' or a size")
    p.add_argument("--cpu-reserve", default=DEFAULT_RESERVES["cpu"], help="per node: '10%%' or a size")
    p.add_argument("--nvme-reserve", default=DEFAULT_RESERVES["nvme"], help="per node: '5%%' or a size")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)

    try:
        gpus = args.gpus
        gpu_mem = args.gpu_mem
        if gpus is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and gpu_mem is None:
            if not torch.cuda.is_available():
                raise ValueError("--gpus > 0 needs --gpu-mem (no GPU on this machine to measure)")
            gpu_mem = torch.cuda.get_device_properties(0).total_memory
        cpu_mem = args.cpu_mem if args.cpu_mem is not None else _mem_available_bytes()
        nvme = args.nvme_free
        if nvme is None and args.nvme_path:
            nvme = shutil.disk_usage(args.nvme_path).free
        machine = make_machine(gpus=gpus, gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_free=nvme,
                               world_size=args.world_size, gpu_reserve=args.gpu_reserve,
                               cpu_reserve=args.cpu_reserve, nvme_reserve=args.nvme_reserve)
        cfg = Config.from_dict({"offload": {"pinned_budget_bytes": parse_bytes(args.pinned_budget)},
                                "precision": {"dtype": args.dtype},
                                "optimizer": {"moments_dtype": args.moments}})
        count = parse_count(args.params)
        if args.trainable is not None:
            model = _frozen_split_model(count, parse_count(args.trainable), args.units)
            result = plan(model, machine=machine, config=cfg)
        else:
            result = plan(count, machine=machine, config=cfg, units=args.units)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0 if result.recommended is not None else 1


def _frozen_split_model(params: int, trainable: int, units: Optional[int]) -> nn.Module:
    """A meta-device stand-in with `trainable` of `params` parameters trainable, spread
    evenly over the units (fine-tuning with frozen layers)."""
    if not 0 <= trainable <= params:
        raise ValueError(f"--trainable {trainable} must be between 0 and --params {params}")
    n = units or default_units(params)
    with torch.device("meta"):
        blocks = nn.ModuleList()
        for i in range(n):
            blk = nn.Module()
            t = trainable // n + (1 if i < trainable % n else 0)
            f = (params - trainable) // n + (1 if i < (params - trainable) % n else 0)
            blk.w = nn.Parameter(torch.empty(t)) if t else None
            blk.frozen = nn.Parameter(torch.empty(f), requires_grad=False) if f else None
            blocks.append(blk)
        root = nn.Module()
        root.blocks = blocks
    return root


if __name__ == "__main__":
    sys.exit(main())
