"""A unit's gradient reduction in flight (`GradReduce`), from `FlatUnit.start_reduce_scatter`
(offload/units/shard.py) to the rank's gradient shard: the collective's wait, HSDP's average
across replicas (offload/units/hybrid.py), the copy or add into the shard, and on a GPU the
copy down on a side stream (`_copy_down`). Split from shard.py, which holds the unit."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from offload.device_runtime import runtime
from offload.devices import StreamPurpose, side_stream
from offload.units.groups import ProcessGroupInfo
from offload.units.hybrid import average_across_replicas
from offload.units.storage_bytes import free_storage

__all__ = ["GradReduce", "IntoShard", "AcrossReplicas"]


class IntoShard(NamedTuple):
    """Where a completed reduction goes: `reduced` (the collective's output, or a view of
    it) into the rank's gradient shard `grad_shard`, added to it (`accumulate`) or copied."""

    reduced: torch.Tensor
    grad_shard: torch.Tensor
    accumulate: bool


class AcrossReplicas(NamedTuple):
    """HSDP at an accumulation boundary: the reduced shard is averaged across `pg`'s
    replicas once the collective completed, before it goes to the gradient shard; `fold`:
    the gradient shard's un-averaged sums are added in first (`ReplicaMean.FOLD`)
    ([Note: HSDP averages once per step] in units/hybrid.py)."""

    reduced: torch.Tensor
    pg: ProcessGroupInfo
    fold: bool


class GradReduce:
    """A unit's gradient reduce-scatter in flight (see `FlatUnit.start_reduce_scatter`).
    `have[i]`: slot i had a local gradient. `wait()` is idempotent."""

    __slots__ = ("have", "_work", "_flat", "_finish", "_across")

    def __init__(
        self,
        have: list[bool],
        work: Optional[dist.Work] = None,
        flat: Optional[torch.Tensor] = None,
        finish: Optional[IntoShard] = None,
        across: Optional[AcrossReplicas] = None,
    ) -> None:
        self.have = have
        self._work = work
        self._flat = flat  # the collective's input: alive until it completes
        self._finish = finish
        """Where the reduction goes once complete; None: the collective wrote it in place."""
        self._across = across
        """HSDP's average across replicas before that; None otherwise."""

    def wait(self, host_async: bool = False, label: str = "") -> Optional[Any]:
        """Complete the reduction into the gradient shard. Returns None when the shard holds
        it now; with `host_async`, a GPU result bound for a pinned host shard is copied on a
        side stream instead, and the returned CUDA event marks when the shard holds it (the
        optimizer worker waits for it; nothing else reads the shard before). `label` names
        the unit for the device runtime (offload/device_runtime.py)."""
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        if self._across is not None:
            (reduced, pg, fold), self._across = self._across, None
            if fold and self._finish is not None:
                out, grad_shard, _ = self._finish
                reduced[: grad_shard.numel()].add_(grad_shard.to(reduced.device, non_blocking=True))
                self._finish = IntoShard(out, grad_shard, False)  # the sum replaces the shard
            average_across_replicas(reduced, pg)  # before the copy out: every step reads the mean
        flat, self._flat = self._flat, None
        event = None
        if self._finish is not None:
            (out, grad_shard, accumulate), self._finish = self._finish, None
            out = out[: grad_shard.numel()]
            rt = runtime()
            if (host_async and not accumulate and rt.has_streams(out.device) and rt.is_pinned(grad_shard)):
                event = _copy_down(out, grad_shard, label)
            elif accumulate:
                grad_shard.add_(out.to(grad_shard.device))
            else:
                rt.copy(grad_shard, out, non_blocking=False)
            if out.untyped_storage().data_ptr() != grad_shard.untyped_storage().data_ptr():
                free_storage(out)  # a temporary (a copy down in flight keeps its block: record_stream)
        if flat is not None:
            # The collective's views of its input outlive the wait (collectives' [Note:
            # collective tensors at exit]): free the bytes now, not when the view goes (F6).
            free_storage(flat)
        return event


def _copy_down(src: torch.Tensor, dst: torch.Tensor, label: str) -> Any:
    """`dst.copy_(src)` from the GPU into pinned host memory on a side stream, after the
    compute stream's work so far (the unit's backward and reduce); returns the event recorded
    after the copy. `src` is kept from reuse until the copy has read it (`record_stream`)."""
    rt = runtime()
    device = src.device
    stream = side_stream(device, StreamPurpose.D2H)
    rt.wait_stream(stream, rt.current_stream(device))
    with rt.stream(stream):
        rt.copy(dst, src, non_blocking=True)
        event = rt.record(stream, f"d2h {label}")
    rt.keep_for(src, stream)
    return event
