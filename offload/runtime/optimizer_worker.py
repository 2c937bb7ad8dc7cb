"""The optimizer worker: units' updates run on a thread of their own while autograd goes on.

With the optimizer in backward (docs/prefetch.md), each unit is updated as soon as its
gradient shard is final. Run on autograd's thread, the update stops the backward: no kernel
is queued while the CPU Adam runs, so on a GPU the step is GPU + gradient copy + Adam in
series (issue #30, F7: a 10.65B model's step on an H100 was 61 % Adam, 31 % blocking
gradient copies). The worker takes the update off that thread: the engine hands it a unit
and the event after which the unit's gradient shard is on the host; the worker waits for
that event, runs the update (the kernels release the GIL), and the backward goes on
meanwhile. The step is then about max(GPU, PCIe, CPU Adam).

One thread, jobs in submission order: the updates run in the same order, on the same
inputs, with the same kernels as on autograd's thread, so the results are bit-identical
(tests/test_optimizer_worker.py). The engine joins the worker (`settle`) before anything
reads or writes what an update touches: `engine.step()`, the next forward, checkpoints,
state dicts, `close`. A job that raises stops the worker taking new jobs; the error comes
back from `settle`, and the engine fails as it would have on autograd's thread.
"""

from __future__ import annotations

import enum
import queue
import threading
from typing import Any, Callable, Optional

import torch

from offload.config.sections import Config
from offload.device_runtime import runtime

__all__ = ["OptimizerWorker", "WorkerState", "uses_worker"]


class WorkerState(enum.Enum):
    IDLE = "idle"
    """No job queued or running."""
    BUSY = "busy"
    """Jobs queued or running."""
    FAILED = "failed"
    """A job raised: later jobs are dropped until `settle` hands the error over."""
    CLOSED = "closed"


_STOP = object()


class OptimizerWorker:
    """A thread that runs submitted jobs in order; `settle` waits for all of them."""

    def __init__(self, name: str = "offload-optimizer") -> None:
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._closed = False
        self._done: Any = None
        """The device runtime's token after the last job (offload/device_runtime.py)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def state(self) -> WorkerState:
        with self._lock:
            if self._closed:
                return WorkerState.CLOSED
            if self._error is not None:
                return WorkerState.FAILED
            return WorkerState.BUSY if self._pending else WorkerState.IDLE

    @property
    def thread_id(self) -> Optional[int]:
        return self._thread.ident

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; it runs after every job submitted before it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the optimizer worker is closed")
            self._pending += 1
        self._queue.put((job, runtime().handoff()))

    def settle(self) -> Optional[BaseException]:
        """Wait until every submitted job ran; return (and forget) the first error a job
        raised since the last settle, or None."""
        with self._idle:
            while self._pending:
                self._idle.wait()
            err, self._error = self._error, None
            done = self._done
        runtime().resume(done)  # this thread goes on after the last job
        return err

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent). Errors are dropped: the
        engine is going away."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, token = item
            try:
                with self._lock:
                    skip = self._error is not None
                if not skip:
                    runtime().resume(token)  # it starts after its submission
                    job()
            except BaseException as exc:  # handed to the engine's thread by settle()
                with self._lock:
                    if self._error is None:
                        self._error = exc
            finally:
                done = runtime().handoff()
                with self._idle:
                    self._done = done
                    self._pending -= 1
                    if not self._pending:
                        self._idle.notify_all()


def uses_worker(config: Config, device: torch.device, nvme: bool) -> bool:
    """`prefetch.optimizer_worker`: "auto" runs the updates during backward on the worker
    with a CUDA compute device and no NVMe tier (whose stores and reads stay on the engine's
    thread), and on autograd's thread on the CPU, where both compete for the same cores."""
    choice = config.prefetch.optimizer_worker
    if choice == "auto":
        return runtime().has_streams(device) and not nvme
    return choice == "on"
