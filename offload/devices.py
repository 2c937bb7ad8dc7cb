"""Devices compared the way tensors report them.

Every tensor's `.device` carries an index (`cuda:0`), while `torch.device("cuda")` has none,
and the two compare unequal: a check `shard.device == device` against an index-less device
is False for a shard that does live there (issue #30, F2: device-tier units then copied
their shard on every use). `canonical` fills the index in; `same_device` compares through
it. Every device comparison in offload goes through these two.
"""

from __future__ import annotations

import enum
import weakref

from typing import Any, Union

import torch

from offload.device_runtime import optional_event, runtime

__all__ = ["canonical", "same_device", "side_stream", "compute_stream_event"]

DeviceLike = Union[torch.device, str]


def canonical(device: DeviceLike) -> torch.device:
    """`device` with its index: an index-less accelerator device gets the process's current
    one (`torch.cuda.current_device()` for CUDA), as tensors allocated on it would report.
    The CPU and meta devices stay index-less (tensors report them so)."""
    d = torch.device(device)
    if d.index is not None or d.type in ("cpu", "meta"):
        return d
    if d.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    module = getattr(torch, d.type, None)
    current = getattr(module, "current_device", None)
    return torch.device(d.type, current()) if callable(current) else d


def same_device(a: DeviceLike, b: DeviceLike) -> bool:
    """Whether `a` and `b` are the same device, an index-less name meaning the current one."""
    da, db = torch.device(a), torch.device(b)
    if da.type != db.type:
        return False
    if da.index == db.index:
        return True
    return canonical(da) == canonical(db)


# [Note: streams and threads]
# Every stream and thread the engine runs work on, what it overlaps, what waits on it, and
# what it may touch. Streams (CUDA only; one per `StreamPurpose` and device, `side_stream`):
# - the compute stream (torch's current stream): forward, backward, the all-gathers and
#   reduce-scatters (NCCL on the current stream), the optimizer's updates of device-tier
#   state. It waits on each side stream below at the named event, never on the host.
# - `StreamPurpose.H2D` (runtime/prefetch.py): a unit's shard from pinned host memory to the
#   device ahead of its use. Starts after the compute stream's work so far (the buffer it
#   writes may have been read there); the compute stream waits on the fetch's event at the
#   unit's gather. Touches only the full or pooled buffer the fetch owns.
# - `StreamPurpose.D2H` (units/grad_reduce.py): a unit's reduced gradient from the device
#   into its pinned host gradient shard, with the optimizer worker. Starts after the compute
#   stream's reduce; the worker's update waits on its event on the host (`GradShard.ready`), the
#   step at `engine.step()` likewise. Touches the gradient shard only.
# - `StreamPurpose.UPLOAD` (optim/sharded.py): an updated device-tier shard from its pinned
#   staging buffer to the device, once nothing reads the old values: in backward, after the
#   event its gradient came down after (`GradShard.arrived`, queued after the unit's own
#   backward and reduce), so unit k's upload overlaps the later units' backward; at `step()`
#   after the compute stream's work so far (the user's own work since backward may read it). The compute stream waits on it at
#   `settle_uploads` (before the next forward, a checkpoint, a state dict); a staging buffer
#   (two, one per update in flight) is reused once its upload's event has passed.
# - `StreamPurpose.ACTIVATIONS` (runtime/activations.py): activation checkpoints to host
#   memory and back. The copy down starts after the inputs are computed; the copy back
#   is waited on by the compute stream before the recomputation reads it.
# Host waits (each one there is; tests/test_event_order.py checks the schedule on the CPU):
# - none on autograd's thread during backward with the worker: it queues kernels and copies
#   and hands each unit to the worker (the update on it, and a blocking copy, are the
#   serial path: `prefetch.optimizer_worker: off`). At world size > 1 the ranks' agreement
#   on a unit's gradients is issued there and read back by the worker before the update
#   (`all_reduce_host_later`).
# - the worker, on a unit's gradient event before its update (it reads the host shard), and
#   on a staging buffer's upload two units back (two buffers bound the copies in flight).
# - `engine.step()` joins the worker (`StepPolicy.settle`): the norm it reports, the
#   counters, the LR schedule and the gradients it clears need every update done; the last
#   update is the root unit's (reduced last, used first by the next forward), so a finer
#   wait would gain only where the worker lags behind backward. The next forward's check
#   (`Health.check_ready`) finds it settled and waits for nothing more on the host.
# - `engine.step()` synchronizes the compute stream only when it runs updates itself (the
#   first step, the non-finite guard, clipping, accumulation): those rewrite host shards
#   that queued host-to-device copies may still read. Updates during backward come after
#   their unit's gradient event, itself after every read of the unit's shard.
# - the non-finite loss guard reads the loss (`float(loss)`) before backward: whether the
#   backward runs at all depends on it, and with the guard on the updates run at step()
#   anyway ([Note: no non-finite value is applied] in runtime/nonfinite.py). With the guard
#   off (the worker's case) the loss is never read.
# Threads:
# - the user's thread: forward, `engine.step()`, the step's updates at `step()`, NVMe
#   reads and writes of the optimizer state (their completion waited on there).
# - autograd's thread(s): backward, the unit hooks, the reduces, and the updates in
#   backward when no worker runs them.
# - the optimizer worker (runtime/optimizer_worker.py, "offload-optimizer"): the updates in
#   backward on a CUDA run (`prefetch.optimizer_worker`); touches only the unit it updates
#   (master, moments, gradient shard, staging buffer) and the upload stream; the step
#   settles it before anything else reads those.
# - the native I/O threads (csrc/aio): complete O_DIRECT reads and writes of pinned buffers
#   they were handed; nothing in Python touches a buffer until its handle is waited on.
# - short-lived pools: swap-file closing at exit (storage/nvme.py), checkpoint writes,
#   verification and the NVMe read-ahead of a save (checkpoint/), each over buffers it owns
#   until joined.


class StreamPurpose(enum.Enum):
    """What a side stream carries ([Note: streams and threads])."""

    H2D = "h2d"
    """Shards fetched ahead, pinned host -> device."""
    D2H = "d2h"
    """Reduced gradients, device -> pinned host shard (the optimizer worker's input)."""
    UPLOAD = "upload"
    """Updated device-tier shards, pinned staging -> device."""
    ACTIVATIONS = "activations"
    """Activation checkpoints, device <-> host."""


_SIDE_STREAMS: "weakref.WeakKeyDictionary[Any, dict[tuple[StreamPurpose, torch.device], Any]]" = \
    weakref.WeakKeyDictionary()
"""Per device runtime (offload/device_runtime.py), its side streams."""


def side_stream(device: DeviceLike, purpose: StreamPurpose) -> Any:
    """The CUDA stream for `purpose` on `device`: one per purpose and device for the
    process, made on first use, so each kind of side copy is ordered among its own kind and
    overlaps the others ([Note: streams and threads])."""
    rt = runtime()
    streams = _SIDE_STREAMS.setdefault(rt, {})
    key = (StreamPurpose(purpose), canonical(device))
    stream = streams.get(key)
    if stream is None:
        stream = streams[key] = rt.new_stream(key[1], key[0].value)
    return stream


def compute_stream_event(device: DeviceLike) -> Any:
    """A CUDA event recorded now on `device`'s current stream (it completes once the work
    queued there so far has run), or None for a device without streams (the CPU: work done
    when the call returns)."""
    return optional_event(canonical(device))
