"""HSDP's checkpoints: one group of replicas writes, every group reads.

[Note: HSDP checkpoints]
Under HSDP (offload/units/mesh.py) each shard group holds a whole replica of the state, and
the engine's `ShardedState` is that group's: its ranks and world size are the shard
group's, so a checkpoint written by one group is exactly ZeRO-3's at world size S. Shard
group 0 (rank 0 of every replicate group) writes it through the usual path
(offload/checkpoint/save.py); the other groups write nothing and learn its outcome — the
path, or the error — from a broadcast over their replicate group, so every rank returns or
raises together. A load needs nothing of its own: every group reads the same files, each
rank those of its shard rank (offload/checkpoint/load.py), and re-shards as any load does.
So the directory must be one every node sees (a shared filesystem); on a node-local
directory the other nodes find no checkpoint and the load says so. The random-number
states restored are shard group 0's, on every group.
"""

from __future__ import annotations

from typing import Callable

from offload.runtime.view import ShardedState
from offload.units import collectives as _dist

__all__ = ["written_by_one_replica"]


def written_by_one_replica(sharded: ShardedState, save: Callable[[], str]) -> str:
    """`save()` (a checkpoint write; returns its path) on shard group 0 only under HSDP, its
    outcome on every rank (see the note); without HSDP, `save()` itself."""
    h = sharded.pg.hybrid
    if h is None or h.replicate is None:
        return save()
    outcome: tuple[str, str] = ("", "")
    own = None
    if h.replicate.rank == 0:
        try:
            outcome = ("ok", save())
        except BaseException as exc:  # every replica learns it; this rank raises its own below
            own, outcome = exc, ("error", f"{type(exc).__name__}: {exc}")
    outcome = _dist.broadcast_object(outcome, h.replicate, sharded.device)
    if own is not None:
        raise own
    if outcome[0] != "ok":
        raise RuntimeError(f"shard group 0 failed writing the checkpoint (HSDP: it writes for every "
                           f"replica): {outcome[1]}")
    return outcome[1]
