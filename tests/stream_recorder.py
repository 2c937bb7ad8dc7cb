"""A fake of the device runtime (offload/device_runtime.py) that runs the engine's GPU path on
the CPU and records who waited on what, on a virtual clock.

- The compute stream runs eagerly on the thread that issues the work (the tensors are CPU
  tensors), but on the virtual clock every op on a stream is a FIFO: it starts after the op
  before it on its stream, after the ops its stream was told to wait for, and not before
  the issuing thread got there; it lasts its cost.
- A side stream really is deferred: each has a thread that runs its copies in order, after
  the ops they wait on, each after a random real delay. A wait the engine leaves out shows as
  wrong numbers (a read before the copy landed), not only in the record.
- Host threads have virtual clocks too: a host wait (an event's or a stream's synchronize,
  a blocking copy) moves the thread to the end of what it waited for; `host_work` (an
  update) costs its time there; a job handed to the optimizer worker starts after it was
  handed over (`handoff`/`resume`), and the worker may be delayed at random in real time.
- `kernel(label)` stands for a compute kernel (the test's hooks call it: a unit's forward
  and backward), at a cost named by the label's first word.

What the record cannot see: work that does not go through the runtime (a `.item()` on a GPU
tensor, say). The engine's GPU path reaches streams, events and copies only through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch

COSTS = {"fwd": 1.0, "bwd": 2.0, "adam": 1.5, "d2h": 0.5, "upload": 0.5, "h2d": 0.5, "copy": 0.1}
"""Virtual cost per op kind (a unit's backward twice its forward; the update a little less
than the backward, as for a GPU with the optimizer on the CPU)."""
LAUNCH = 0.01
"""Virtual host time to issue one op."""


@dataclasses.dataclass
class Op:
    seq: int
    stream: str
    label: str
    thread: str
    issued: float
    start: float
    end: float
    waits: list["Op"]
    """The ops its stream was told to wait on since the op before it (wait_stream/wait_event)."""
    future: "Future[None]"
    keep: Optional[Callable[[torch.Tensor], bool]] = None
    """A copy's hook for `keep_for`: swap its source for a private copy if it has not started."""


@dataclasses.dataclass
class HostWait:
    seq: int
    thread: str
    what: str
    at: float


@dataclasses.dataclass
class HostWork:
    seq: int
    thread: str
    label: str
    start: float
    end: float


class FakeStream:
    def __init__(self, name: str, deferred: bool) -> None:
        self.name = name
        self.tail: Optional[Op] = None
        self.pending: list[Op] = []
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"fake-{name}") if deferred else None


class FakeEvent:
    def __init__(self, op: Optional[Op], label: str) -> None:
        self.op = op
        self.label = label


def _done() -> "Future[None]":
    f: "Future[None]" = Future()
    f.set_result(None)
    return f


class Recorder:
    """A `DeviceRuntime` for tests (see the module docstring). `delay`: the largest random
    real delay (s) before each side-stream op; `worker_delay`: before each handed-over job;
    without `jitter`, exactly those (a negative control that must not depend on the load)."""

    def __init__(self, delay: float = 0.0, worker_delay: float = 0.0, seed: int = 0, jitter: bool = True) -> None:
        self.delay, self.worker_delay, self.jitter = delay, worker_delay, jitter
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._seq = 0
        self._clock: dict[str, float] = {}
        self._local = threading.local()
        self.compute = FakeStream("compute", deferred=False)
        self.streams: list[FakeStream] = [self.compute]
        self.ops: list[Op] = []
        self.events: dict[str, list[FakeEvent]] = {}
        self.host_waits: list[HostWait] = []
        self.host_work_spans: list[HostWork] = []
        self.marks: list[tuple[int, str, float]] = []
        self.errors: list[str] = []

    # -- bookkeeping ------------------------------------------------------------------------

    @staticmethod
    def _thread() -> str:
        t = threading.current_thread()
        return "main" if t is threading.main_thread() else t.name

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def now(self, thread: Optional[str] = None) -> float:
        return self._clock.get(thread or self._thread(), 0.0)

    def _advance(self, thread: str, to: float) -> None:
        self._clock[thread] = max(self._clock.get(thread, 0.0), to)

    def mark(self, what: str) -> None:
        """A named point of the main thread's program (a step's start, say)."""
        with self._lock:
            self.marks.append((self._next(), what, self.now()))

    def close(self) -> None:
        for s in self.streams:
            if s.executor is not None:
                s.executor.shutdown(wait=True)

    # -- issuing work ----------------------------------------------------------------------

    def _issue(self, stream: FakeStream, label: str, cost: float, body: Optional[Callable[[], None]]) -> Op:
        with self._lock:
            thread = self._thread()
            issued = self.now(thread)
            self._advance(thread, issued + LAUNCH)
            waits, stream.pending = stream.pending, []
            prev = stream.tail
            start = max([issued] + [w.end for w in waits] + ([prev.end] if prev else []))
            op = Op(self._next(), stream.name, label, thread, issued, start, start + cost, waits, _done())
            if stream.executor is None:
                for w in waits:  # eager: the data dependencies in real time too
                    w.future.result()
                if body is not None:
                    body()
            else:
                deps = [w.future for w in waits] + ([prev.future] if prev else [])
                delay = (self._rng.uniform(0.0, self.delay) if self.jitter else self.delay) if self.delay else 0.0

                def run() -> None:
                    for d in deps:
                        d.result()
                    if delay:
                        time.sleep(delay)
                    if body is not None:
                        body()

                op.future = stream.executor.submit(run)
            stream.tail = op
            self.ops.append(op)
            return op

    def kernel(self, label: str, device: Any = "cpu") -> None:
        """A compute kernel named `label` on the current stream (the test's hooks)."""
        self._issue(self.current_stream(device), label, COSTS[label.split()[0]], None)

    def _host_wait(self, op: Optional[Op], what: str) -> None:
        if op is None:
            return
        op.future.result()
        with self._lock:
            thread = self._thread()
            self._advance(thread, op.end)
            self.host_waits.append(HostWait(self._next(), thread, what, self.now(thread)))

    # -- the DeviceRuntime protocol ----------------------------------------------------------

    def has_streams(self, device: torch.device) -> bool:
        return True

    def current_stream(self, device: Any) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    def new_stream(self, device: Any, purpose: str) -> FakeStream:
        s = FakeStream(purpose, deferred=True)
        with self._lock:
            self.streams.append(s)
        return s

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before

    def record(self, stream: FakeStream, label: str = "") -> FakeEvent:
        with self._lock:
            op = stream.tail
            if stream.pending or (op is not None and op.label and label):
                op = self._issue(stream, label, 0.0, None)  # a marker after the waits
            elif op is not None and label and not op.label:
                op.label = label
            event = FakeEvent(op, label)
            if label:
                self.events.setdefault(label, []).append(event)
            return event

    def wait_stream(self, waiter: FakeStream, waited: FakeStream) -> None:
        self._wait_on(waiter, waited.tail)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self._wait_on(stream, event.op)

    def _wait_on(self, stream: FakeStream, op: Optional[Op]) -> None:
        if op is None:
            return
        with self._lock:
            stream.pending.append(op)
        if stream.executor is None:
            # The compute stream is the host's own eager work: whatever runs next reads
            # what `op` writes, so it is waited for now in real time (not on the clock).
            op.future.result()

    def synchronize(self, what: Any) -> None:
        if isinstance(what, FakeEvent):
            self._host_wait(what.op, f"event {what.label}")
        else:
            self._host_wait(what.tail, f"stream {what.name}")

    def query(self, event: FakeEvent) -> bool:
        return event.op is None or event.op.future.done()

    def async_copy(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        return True

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        stream = self.current_stream(dst.device)
        kind = stream.name if stream is not self.compute else "copy"
        box = [src, False]  # the source, and whether the copy started
        lock = threading.Lock()

        def body() -> None:
            with lock:
                box[1] = True
            if dst.untyped_storage().nbytes() < (dst.storage_offset() + dst.numel()) * dst.element_size():
                self.errors.append("a copy into memory freed before it ran")  # on a GPU: garbage
                return
            dst.copy_(box[0])

        def keep(t: torch.Tensor) -> bool:
            with lock:
                if box[1] or t.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
                    return False
                box[0] = src.clone()
                return True

        op = self._issue(stream, "", COSTS.get(kind, COSTS["copy"]), body)
        op.keep = keep
        if not non_blocking:
            self._host_wait(op, f"blocking copy on {stream.name}")

    def keep_for(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        # The caching allocator keeps the block until the stream read it, without a host
        # wait; the CPU tensor may be freed right after: a copy not yet started reads a
        # private copy of it, one under way is waited for in real time (not on the clock).
        with self._lock:
            ops = [o for o in self.ops[-16:] if o.stream == stream.name and o.keep is not None]
        for op in ops:
            if not op.future.done() and not op.keep(tensor):
                op.future.result()

    @contextlib.contextmanager
    def host_work(self, label: str) -> Iterator[None]:
        with self._lock:
            thread = self._thread()
            start = self.now(thread)
            span = HostWork(self._next(), thread, label, start, start + COSTS[label.split()[0]])
            self._advance(thread, span.end)
            self.host_work_spans.append(span)
        yield

    def handoff(self) -> float:
        return self.now()

    def resume(self, token: Any) -> None:
        if token is None:
            return
        if self.worker_delay and self._thread() != "main":
            time.sleep((self._rng.uniform(0.5, 1.0) if self.jitter else 1.0) * self.worker_delay)
        with self._lock:
            self._advance(self._thread(), float(token))

    # -- reading the record ----------------------------------------------------------------

    def op(self, label: str, nth: int = 0) -> Op:
        ops = [o for o in self.ops if o.label == label]
        return ops[nth]

    def kernels(self, prefix: str) -> list[Op]:
        return [o for o in self.ops if o.stream == "compute" and o.label.startswith(prefix)]
