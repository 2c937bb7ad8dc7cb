"""The groups of hybrid sharding, made once at `initialize` on torch's `DeviceMesh`.

`setup_groups` starts (or finds) the world's process group as `setup_process_group` does,
checks `config.sharding` against the world size (the one place that knows it), and returns
the `ProcessGroupInfo` the engine's units shard over, its `hybrid` carrying the others:

- FULL (no sharding section, or sizes equal to the world): the world itself; no subgroup.
- HSDP (`shard_group_size` S < world size W): a 2-D mesh (W / S, S) named
  ("replicate", "shard"), FSDP2's HSDP mesh. The units shard over the "shard" dimension (S
  consecutive ranks), and the returned group *is* that shard group: the layout, optimizer
  state and every sharded sum see S ranks, exactly as ZeRO-3 at world size S does. Gradients
  are then averaged over the "replicate" dimension (offload/units/grad_reduce.py); agreement
  (flags, "max") still spans the world (`ProcessGroupInfo.world`).
- HPZ (`hpz_partition_size` L < W): the units shard over the world; a mesh (W / L, L) gives
  the node groups (its second dimension) that hpZ's secondary copy is sharded within
  (offload/units/hybrid.py).

Every rank must call `setup_groups` with the same config (the mesh makes its subgroups
collectively, in the same order on every rank).

[Note: one mesh per shape]
A mesh's subgroups are process groups: NCCL communicators on a GPU (each with its own
buffers on the device), gloo's sockets and threads on the CPU. A loop that builds engine
after engine (a sweep, the tests) would make new ones at every `initialize` and never free
them, and destroying them at `engine.close()` would break the DTensors of
`sharded_state_dict()` the user may still hold. So the meshes are kept per (device type,
shape, dimension names) for the life of the world group they were made in, and every later
engine of that shape uses the same subgroups: every rank asks for the same meshes in the
same order, so every rank finds the same ones. A cached mesh whose world group was
destroyed (the user's `destroy_process_group`, then a new `init_process_group`) is made anew.

[Note: the subgroups' timeout]
torch gives a new group its backend's default timeout (30 minutes for gloo), not the world
group's. So under HSDP or hpZ a stopped rank left the ranks waiting on it in a subgroup for
half an hour, whatever `collective_timeout_s` said (a 4-rank test found it). The mesh's
groups are made with the world's timeout when offload started the world group
(`ProcessGroupInfo.timeout_s`), through `init_device_mesh`'s per-dimension backend options.
For a group the user started, torch's defaults apply to the subgroups too. The NCCL branch
has not been run (no GPU here).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from offload.config.checks import rule_error
from offload.config.sections import Config
from offload.config.sharding import ShardingConfig
from offload.units.collectives import setup_process_group
from offload.units.groups import HybridGroups, ProcessGroupInfo, ShardingMode, hsdp_groups, node_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["setup_groups", "sharding_mode"]

_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...], Optional[float]], tuple[object, "DeviceMesh"]] = {}
"""(device type, shape, names, timeout) -> (the world group it was made in, the mesh):
[Note: one mesh per shape]."""


def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
          timeout_s: Optional[float]) -> "DeviceMesh":
    """torch's `init_device_mesh`, made once per shape in this world group, its subgroups
    with the world's collective timeout ([Note: the subgroups' timeout])."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, shape, names, timeout_s)
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    override: Optional[dict[Any, Any]] = (
        None if timeout_s is None else {name: _timed_backend(device_type, timeout_s) for name in names})
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
    _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def _timed_backend(device_type: str, timeout_s: float) -> tuple[str, Any]:
    """(backend, its options with `timeout_s`) for one mesh dimension's groups: NCCL's on a
    GPU, gloo's otherwise."""
    if device_type == "cuda" and hasattr(dist, "ProcessGroupNCCL"):
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", getattr(dist.ProcessGroupGloo, "_Options")()  # untyped in torch's stubs
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


def sharding_mode(sharding: ShardingConfig, world_size: int, ranks_per_node: int) -> ShardingMode:
    """The mode `sharding` asks for at `world_size` (pure: checked here, once). A size equal
    to the world size is plain ZeRO (FULL). Raises ValueError naming the key, the value, the
    rule and the fix when a size does not divide the world (a ConfigError, a ValueError)."""
    for key, size, off in (("shard_group_size", sharding.shard_group_size, 0),
                           ("hpz_partition_size", sharding.hpz_partition_size, 1)):
        if size != off and world_size % size:
            raise rule_error(
                f"sharding.{key}", size, f"the world size {world_size} is not a multiple of it "
                f"(every group must have {size} ranks)", f"use a divisor of {world_size}, such as the "
                f"ranks per node ({ranks_per_node})")
    if 1 < sharding.shard_group_size < world_size:
        return ShardingMode.HSDP
    if 1 < sharding.hpz_partition_size < world_size:
        return ShardingMode.HPZ
    return ShardingMode.FULL


def setup_groups(config: Config, device_type: str) -> ProcessGroupInfo:
    """The group the engine's units shard over, with its `hybrid` groups (see the module
    docstring); at world size 1, `setup_process_group`'s as it is."""
    world = setup_process_group(device_type, float(config.collective_timeout_s))
    per_node = world.local_world_size
    mode = sharding_mode(config.sharding, world.world_size, per_node)  # checked at every world size
    if world.world_size == 1:
        return world
    me = dist.get_rank()
    everyone = tuple(range(world.world_size))
    if mode is ShardingMode.FULL:
        return dataclasses.replace(world, hybrid=HybridGroups(
            mode=mode, world=world, world_rank=me, shard_ranks=everyone, ranks_per_node=per_node))
    def sub(group: dist.ProcessGroup) -> ProcessGroupInfo:
        return dataclasses.replace(world, rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                                   group=group, ranks=tuple(dist.get_process_group_ranks(group)))

    if mode is ShardingMode.HSDP:
        s = config.sharding.shard_group_size
        mesh = _mesh(device_type, (world.world_size // s, s), ("replicate", "shard"), world.timeout_s)
        shard_groups, replicate_groups = hsdp_groups(world.world_size, s)
        shard = sub(mesh.get_group("shard"))
        hybrid = HybridGroups(
            mode=mode, world=world, world_rank=me, shard_ranks=shard_groups[me // s],
            ranks_per_node=per_node, replicate=sub(mesh.get_group("replicate")),
            replicate_ranks=replicate_groups[me % s], mesh=mesh)
        return dataclasses.replace(shard, hybrid=hybrid)
    size = config.sharding.hpz_partition_size
    mesh = _mesh(device_type, (world.world_size // size, size), ("across", "within"), world.timeout_s)
    hybrid = HybridGroups(
        mode=mode, world=world, world_rank=me, shard_ranks=everyone, ranks_per_node=per_node,
        node=sub(mesh.get_group("within")), node_ranks=node_groups(world.world_size, size)[me // size],
        mesh=mesh)
    return dataclasses.replace(world, hybrid=hybrid)
