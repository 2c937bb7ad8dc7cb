"""The few CUDA entry points the engine's GPU path calls, behind one typed seam.

Streams, events, the waits between them, the asynchronous copies and the host's waits are
what decide whether a step overlaps or runs in series; each owner in offload/ reaches them
through `runtime()` (a `DeviceRuntime`), never through `torch.cuda` directly. The process's
runtime is `CudaRuntime` (torch.cuda as it is). A test installs another with `using(...)`:
tests/stream_recorder.py drives the whole GPU path on the CPU with fake streams on a virtual
clock, and records who waited on what (tests/test_event_order.py checks the record).

What the seam covers, and nothing else:
- streams: the compute stream (`current_stream`), side streams (`new_stream`, made once per
  purpose by `offload.devices.side_stream`), a stream made current (`stream`);
- events: recorded on a stream (`record`), waited for by a stream (`wait_event`,
  `wait_stream`) or by the host (`synchronize`), polled (`query`);
- copies between the device and page-locked host memory (`copy`, `async_copy`), and a
  tensor kept from reuse until a stream has read it (`keep_for`, torch's `record_stream`);
- the host side of the schedule a fake needs to model it: a thread's CPU work (`host_work`),
  and a hand-over of work between threads (`handoff` / `resume`: the optimizer worker's jobs).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Protocol

import torch

__all__ = ["DeviceRuntime", "CudaRuntime", "runtime", "using"]


class DeviceRuntime(Protocol):
    """The device operations the engine's GPU path uses (see the module docstring)."""

    def has_streams(self, device: torch.device) -> bool:
        """Whether work on `device` runs asynchronously on streams (CUDA; not the CPU)."""

    def current_stream(self, device: torch.device) -> Any:
        """The stream work on `device` is queued on now (the compute stream)."""

    def new_stream(self, device: torch.device, purpose: str) -> Any:
        """A new side stream on `device`, for `purpose` (a `StreamPurpose` value)."""

    def stream(self, stream: Any) -> ContextManager[Any]:
        """Make `stream` current for the block."""

    def record(self, stream: Any, label: str = "") -> Any:
        """An event recorded now on `stream`: it completes once the work queued there so far
        has run. `label` names what it marks (for a recorder; ignored by CUDA)."""

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """`waiter`'s later work runs after `waited`'s work queued so far (no host wait)."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """`stream`'s later work runs after `event` (no host wait)."""

    def synchronize(self, what: Any) -> None:
        """The host waits for an event or a stream."""

    def query(self, event: Any) -> bool:
        """Whether `event` has completed (never blocks)."""

    def async_copy(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """Whether `dst.copy_(src, non_blocking=True)` is asynchronous for the host (device
        to page-locked host memory or back)."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether `t` is page-locked host memory a device copy can run from or into
        asynchronously."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """`dst.copy_(src)` on the current stream; blocking the host unless `non_blocking`
        and `async_copy(src, dst)`."""

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep `tensor`'s memory from reuse until `stream`'s work queued so far has run."""

    def host_work(self, label: str) -> ContextManager[None]:
        """The block is this thread's CPU work named `label` (an update, say)."""

    def handoff(self) -> Any:
        """A token for work this thread hands to another (a job submitted to a worker)."""

    def resume(self, token: Any) -> None:
        """This thread takes up work handed over with `token` (it starts after the handoff)."""


class CudaRuntime:
    """torch.cuda as it is: the runtime of every engine outside the event-order tests."""

    def has_streams(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device, purpose: str) -> Any:
        return torch.cuda.Stream(device)

    def stream(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any, label: str = "") -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, what: Any) -> None:
        what.synchronize()

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def async_copy(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        if src.device.type == "cuda" and dst.device.type == "cpu":
            return dst.is_pinned()
        return src.device.type == "cpu" and src.is_pinned() and dst.device.type == "cuda"

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_pinned()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking and self.async_copy(src, dst))

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def host_work(self, label: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def handoff(self) -> Any:
        return None

    def resume(self, token: Any) -> None:
        return None


_RUNTIME: list[DeviceRuntime] = [CudaRuntime()]


def runtime() -> DeviceRuntime:
    """The process's device runtime (`CudaRuntime` unless a test installed another)."""
    return _RUNTIME[-1]


@contextlib.contextmanager
def using(rt: DeviceRuntime) -> Iterator[DeviceRuntime]:
    """Run the block (engines built and trained in it) on `rt` instead of torch.cuda. Side
    streams are per runtime (`offload.devices.side_stream`), so none leaks across."""
    _RUNTIME.append(rt)
    try:
        yield rt
    finally:
        _RUNTIME.remove(rt)


def optional_event(device: torch.device, label: str = "") -> Optional[Any]:
    """An event recorded now on `device`'s compute stream, or None for a device without
    streams (work there is done when the call returns)."""
    rt = runtime()
    return rt.record(rt.current_stream(device), label) if rt.has_streams(device) else None
