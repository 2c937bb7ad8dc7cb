"""offload's `sharding` section: how the ranks share the model past one node (HSDP, ZeRO++
hpZ). Split from offload/config/sections.py by concern; the same `Section` machinery checks
it once when it is built. What depends on the world size (the sizes divide it) is checked
by `initialize` (offload/units/mesh.py, `sharding_groups`), the one place that knows it.
docs/multinode.md has the arithmetic; docs/config.md the format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from offload.config.checks import ConfigError, Section, require

__all__ = ["ShardingConfig"]


@dataclass(frozen=True, kw_only=True)
class ShardingConfig(Section):
    _SECTION: ClassVar[str] = "sharding"

    shard_group_size: int = 0
    """HSDP (FSDP2's hybrid sharding; DeepSpeed's removed MiCS): parameters, gradients and
    optimizer state are sharded within groups of this many consecutive ranks (a node's, for
    the collectives to stay on it) and replicated across the groups; gradients are
    reduce-scattered within the group, then averaged across the groups. 0 = the world size:
    plain ZeRO over every rank. It must divide the world size and be >= 2."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ (DeepSpeed's `zero_optimization.zero_hpz_partition_size`): the primary
    partition stays over every rank (optimizer state, master, forward all-gathers), and each
    rank also keeps a secondary copy of a unit's 16-bit parameters sharded within its group
    of this many consecutive ranks (a node), so the backward's re-gather never leaves the
    node. 1 = off (DeepSpeed's default). It must divide the world size; stage 3 only."""

    def _check(self) -> None:
        require(self.shard_group_size >= 0, self._key("shard_group_size"), self.shard_group_size,
                "a group size must be >= 0 (0 = the world: plain ZeRO)",
                "use 0, or the ranks per node (e.g. 8) for HSDP")
        require(self.shard_group_size != 1, self._key("shard_group_size"), self.shard_group_size,
                "groups of 1 rank would replicate everything and shard nothing (plain data "
                "parallelism), which offload does not run",
                "use 0 (plain ZeRO), or a group of >= 2 ranks such as a node's")
        require(self.hpz_partition_size >= 1, self._key("hpz_partition_size"), self.hpz_partition_size,
                "a partition size must be >= 1 (1 = hpZ off)", "use 1, or the ranks per node (e.g. 8)")
        if self.shard_group_size and self.hpz_partition_size > 1:
            raise ConfigError(self._key("hpz_partition_size"),
                              f"= {self.hpz_partition_size} and sharding.shard_group_size = "
                              f"{self.shard_group_size} are set together, but they are two ways to keep "
                              "the re-gathers within a node (hpZ keeps a node-local copy; HSDP shards "
                              "within the node and replicates across)",
                              "keep one: hpz_partition_size (optimizer state over every rank) or "
                              "shard_group_size (fewer bytes across nodes, more host memory)")

    @property
    def hybrid(self) -> bool:
        """Whether any hybrid mode is asked for (at world sizes where it differs from ZeRO)."""
        return self.shard_group_size > 1 or self.hpz_partition_size > 1
