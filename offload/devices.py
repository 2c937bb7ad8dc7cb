"""Devices compared the way tensors report them.

Every tensor's `.device` carries an index (`cuda:0`), while `torch.device("cuda")` has none,
and the two compare unequal: a check `shard.device == device` against an index-less device
is False for a shard that does live there (issue #30, F2: device-tier units then copied
their shard on every use). `canonical` fills the index in; `same_device` compares through
it. Every device comparison in offload goes through these two.
"""

from __future__ import annotations

from typing import Any, Union

import torch

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


_SIDE_STREAMS: dict[tuple[str, torch.device], Any] = {}


def side_stream(device: DeviceLike, purpose: str) -> Any:
    """The CUDA stream for `purpose` on `device` ("d2h" gradient copies, "activations"
    host copies, ...): one per purpose and device for the process, made on first use, so
    each kind of side copy is ordered among its own kind and overlaps the others."""
    key = (purpose, canonical(device))
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(key[1])
    return stream


def compute_stream_event(device: DeviceLike) -> Any:
    """A CUDA event recorded now on `device`'s current stream (it completes once the work
    queued there so far has run), or None for a device without streams (the CPU: work done
    when the call returns)."""
    device = canonical(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
