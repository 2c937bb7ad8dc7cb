"""The process groups a rank works in: `ProcessGroupInfo` (which rank, how many, the group
collectives run on) and, past one node, its hybrid-sharding groups (`HybridGroups`: the shard
group, the replicate group or hpZ's node group, and the bytes sent within and across nodes).

Pure data and arithmetic: the groups are made by offload/units/mesh.py (on torch's
`DeviceMesh`), the collectives run by offload/units/collectives.py and offload/units/hybrid.py.
Ranks are placed on nodes as torchrun places them: node i holds ranks
[i * ranks_per_node, (i + 1) * ranks_per_node), ranks_per_node being LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroupInfo", "uses_nccl", "ShardingMode", "HybridGroups", "NodeTraffic",
           "hsdp_groups", "node_groups", "peers_by_node"]


def uses_nccl(backend: Optional[str]) -> bool:
    """Whether a group whose backend torch reports as `backend` runs CUDA tensors'
    collectives on NCCL: "nccl" itself, or a per-device map that names it for cuda
    ("cuda:nccl", "cpu:gloo,cuda:nccl": what `dist.get_backend_config` reports, and what
    older torch's `get_backend` reported for a default group started without a backend).
    None (no group), "gloo", "cpu:gloo,cuda:gloo": False."""
    if not backend:
        return False
    for entry in backend.lower().split(","):
        device, _, name = entry.strip().rpartition(":")
        if name == "nccl" and device in ("", "cuda"):
            return True
    return False


@dataclass(frozen=True)
class ProcessGroupInfo:
    """Which rank we are, how many there are, and the group collectives run on.

    `group` is None when the world size is 1 and no process group exists; every collective
    below is then a local no-op (or a copy), so the engine never branches on it.
    """

    rank: int
    world_size: int
    group: Optional[dist.ProcessGroup]
    backend: Optional[str]
    """The group's backend per device as torch reports it (`dist.get_backend_config`:
    "cpu:gloo,cuda:gloo" for a gloo group, "cuda:nccl", "cpu:gloo,cuda:nccl", ...); None
    without a group. Compare it through `nccl`, never to a name: a group the user started
    without a backend is NCCL on CUDA yet is not called "nccl" (issue #30, F10)."""
    started_here: bool
    """True when the group is offload's: `setup_process_group` created it, for this engine or
    an earlier one of the process ([Note: the group offload starts])."""
    timeout_s: Optional[float] = None
    """The group's collective timeout in seconds when offload started it
    (`collective_timeout_s`); None for a group the user started (its own timeout applies)."""
    ranks: tuple[int, ...] = ()
    """The world ranks of the group's members, in group-rank order, for a subgroup (HSDP's
    shard or replicate group, hpZ's node group: offload/units/mesh.py); () = the world, whose
    group ranks are the world's. Errors name the world's ranks."""
    hybrid: Optional["HybridGroups"] = field(default=None, compare=False)
    """Past world size 1: the sharding groups this rank's units use (`HybridGroups`; with
    HSDP this group is the shard group, and `world` every rank). None at world size 1."""

    @property
    def world(self) -> "ProcessGroupInfo":
        """Every rank: where agreement (a flag any rank raises: overflow, a non-finite loss,
        which parameters got a gradient) must be reached. This group itself unless HSDP made
        it a shard group."""
        return self.hybrid.world if self.hybrid is not None else self

    @property
    def nccl(self) -> bool:
        """Whether CUDA tensors' collectives on this group run on NCCL (`uses_nccl`)."""
        return uses_nccl(self.backend)

    @property
    def local_world_size(self) -> int:
        """Ranks on this node (they share its disk): torchrun's LOCAL_WORLD_SIZE, or, from a
        launcher that does not say, every rank (one node)."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return max(1, min(int(local), self.world_size)) if local.isdigit() else self.world_size


class ShardingMode(enum.Enum):
    """How the ranks share the model (offload/config/sharding.py; docs/multinode.md)."""

    FULL = ("ZeRO-3 over every rank: parameters, gradients and optimizer state sharded over the "
            "world; every all-gather and reduce-scatter spans it")
    HSDP = ("shard within groups of consecutive ranks, replicate across them: all-gathers and "
            "reduce-scatters stay in the group; each gradient shard is then averaged across groups")
    HPZ = ("ZeRO++ hpZ: the primary partition over the world; a secondary copy of each unit's "
           "parameters sharded within a node group, from which the re-gathers of backward run")


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node of world rank `rank` (torchrun's placement: consecutive ranks per node)."""
    return rank // ranks_per_node


def peers_by_node(me: int, ranks: tuple[int, ...], ranks_per_node: int) -> tuple[int, int]:
    """(the other members of `ranks` on `me`'s node, those on other nodes)."""
    mine = node_of(me, ranks_per_node)
    others = [r for r in ranks if r != me]
    same = sum(1 for r in others if node_of(r, ranks_per_node) == mine)
    return same, len(others) - same


def hsdp_groups(world_size: int, shard_group_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(the shard groups: consecutive blocks of `shard_group_size` ranks, the replicate
    groups: the ranks at the same place in each block), FSDP2's HSDP mesh
    (replicate, shard) read by rows and by columns."""
    s = shard_group_size
    shard = [tuple(range(g * s, (g + 1) * s)) for g in range(world_size // s)]
    replicate = [tuple(range(i, world_size, s)) for i in range(s)]
    return shard, replicate


def node_groups(world_size: int, partition_size: int) -> list[tuple[int, ...]]:
    """hpZ's secondary groups: consecutive blocks of `partition_size` ranks."""
    return hsdp_groups(world_size, partition_size)[0]


@dataclass
class NodeTraffic:
    """Bytes this rank sent for its units' all-gathers, reduce-scatters and cross-group
    all-reduces, to ranks on its own node and on other nodes, since `initialize` (the small
    all-reduces of flags and norms are not counted: a few bytes per step).

    [Note: bytes a collective sends] Counted as the data each rank must exchange, whatever
    the algorithm: an all-gather of n elements per rank sends them to every other member; a
    reduce-scatter of a full buffer sends each other member its n-element share; an
    all-reduce of N elements over g ranks is a reduce-scatter and an all-gather of N / g
    each, 2 N / g to every other member. Each peer's bytes count as within or across nodes
    by the peer's node. docs/multinode.md has the per-parameter arithmetic this gives."""

    within_node_bytes: int = 0
    across_nodes_bytes: int = 0

    def exchange(self, me: int, ranks: tuple[int, ...], per_peer_bytes: int, ranks_per_node: int) -> None:
        """Count `per_peer_bytes` sent from world rank `me` to every other member of `ranks`."""
        same, other = peers_by_node(me, ranks, ranks_per_node)
        self.within_node_bytes += same * per_peer_bytes
        self.across_nodes_bytes += other * per_peer_bytes


@dataclass(frozen=True)
class HybridGroups:
    """The groups of one rank past world size 1 (made by offload/units/mesh.py)."""

    mode: ShardingMode
    world: ProcessGroupInfo
    """Every rank (no `hybrid` of its own)."""
    world_rank: int
    shard_ranks: tuple[int, ...]
    """World ranks of the group the units shard over (the world, or HSDP's shard group)."""
    ranks_per_node: int
    """LOCAL_WORLD_SIZE: the node of a rank is rank // ranks_per_node."""
    traffic: NodeTraffic = field(default_factory=NodeTraffic)
    replicate: Optional[ProcessGroupInfo] = None
    """HSDP: the ranks that hold the same shard in the other groups; None otherwise."""
    replicate_ranks: tuple[int, ...] = ()
    node: Optional[ProcessGroupInfo] = None
    """hpZ: the group the secondary copy is sharded within; None otherwise."""
    node_ranks: tuple[int, ...] = ()
    mesh: Optional["DeviceMesh"] = None
    """The torch `DeviceMesh` the subgroups came from (None for FULL: no subgroup)."""

    def count(self, ranks: tuple[int, ...], per_peer_bytes: int) -> None:
        self.traffic.exchange(self.world_rank, ranks, per_peer_bytes, self.ranks_per_node)
