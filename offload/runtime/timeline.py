"""What one training step did, and when: per-unit spans, stall time, a Chrome trace.

The engine reports, for every step, how long compute waited for data (`StepStats`): the time
the compute thread spent blocked on a parameter shard that was not there yet (an NVMe read
or a host-to-device copy still in flight), in collectives (all-gather, reduce-scatter), and
on optimizer-state I/O. Those few clock reads per unit are always taken: they are what
`engine.step_stats()` returns, and they cost nanoseconds beside a unit's compute.

With `timeline.enabled` the engine also records spans, one per stage of each unit's trip
(read, copy, gather, compute, reduce, optimizer, write-back), on named tracks ("compute",
"io", "optimizer", ...), and exports them as Chrome/Perfetto trace JSON (chrome://tracing,
https://ui.perfetto.dev). Off, `span()` returns one shared no-op context and nothing is
allocated.

Spans may be added from any thread (the optimizer worker, I/O completions observed late):
appends take a lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)

__all__ = ["Span", "StepStats", "Timeline", "now"]

now = time.perf_counter
"""The clock every span and stall uses (seconds, monotonic)."""

STALL_KINDS = ("io_wait", "copy_wait", "collective")
"""What counts as stall: the engine's thread blocked on NVMe I/O (shard reads, optimizer
state, slot ordering, staging), on a host-to-device copy, and in collectives."""


@dataclass
class Span:
    name: str
    """What ran, e.g. 'fwd h.3', 'read h.4'."""
    cat: str
    """The stage: read, copy, gather, compute, reduce, optimizer, write, wait, step."""
    track: str
    """The row it is drawn on: 'compute', 'io', 'optimizer'."""
    start: float
    end: float
    unit: Optional[int] = None
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepStats:
    """One optimizer step (all its micro-batches), as the engine measured it."""

    step: int
    """The engine's `global_steps + skipped_steps` when the step began (0-based)."""
    step_s: float = 0.0
    """From the first unit's forward to the end of `engine.step()`."""
    io_wait_s: float = 0.0
    """The engine's thread blocked on NVMe I/O, wherever (every `Pending.wait` that had to
    wait: shard reads, optimizer-state reads, a slot's earlier write, staging buffers)."""
    copy_wait_s: float = 0.0
    """Compute waiting for a prefetched host-to-device copy (CUDA)."""
    collective_s: float = 0.0
    """Compute thread in all-gather / reduce-scatter / small all-reduces (with their local
    copies: at world size 1 the gather and the gradient copy into the shard)."""
    fetch_wait_s: float = 0.0
    """Of `io_wait_s` + `copy_wait_s`: the part spent in gathers (a shard prefetch had not
    finished, or one fetched on demand)."""
    optimizer_io_s: float = 0.0
    """Of `io_wait_s`: the part spent inside optimizer updates (state reads and writes)."""
    optimizer_s: float = 0.0
    """Time spent in optimizer updates (during backward and in `step()`)."""
    optimizer_in_backward_s: float = 0.0
    """The part of `optimizer_s` that ran during backward (overlapping it)."""
    optimizer_in_backward_units: int = 0
    """Units whose update ran during backward (optimizer overlapped with backward)."""
    optimizer_wait_s: float = 0.0
    """The engine's thread waiting in `step()` for the optimizer worker to finish this
    step's updates during backward: the part of their time the backward did not hide."""
    prefetched: int = 0
    """Shard fetches that were issued ahead of their use."""
    on_demand: int = 0
    """Shard fetches that were issued only when the unit was needed."""
    off_trace: bool = False
    """The unit order differed from the trace: the step fell back to on-demand fetching."""
    spans: list[Span] = field(default_factory=list)

    @property
    def stall_s(self) -> float:
        return self.io_wait_s + self.copy_wait_s + self.collective_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "step_s": self.step_s,
            "stall_s": self.stall_s,
            "stall_fraction": self.stall_s / self.step_s if self.step_s > 0 else 0.0,
            "io_wait_s": self.io_wait_s,
            "copy_wait_s": self.copy_wait_s,
            "collective_s": self.collective_s,
            "fetch_wait_s": self.fetch_wait_s,
            "optimizer_io_s": self.optimizer_io_s,
            "optimizer_s": self.optimizer_s,
            "optimizer_in_backward_s": self.optimizer_in_backward_s,
            "optimizer_in_backward_units": self.optimizer_in_backward_units,
            "optimizer_wait_s": self.optimizer_wait_s,
            "prefetched": self.prefetched,
            "on_demand": self.on_demand,
            "off_trace": self.off_trace,
        }


class _NoSpan:
    """The shared do-nothing context of a disabled timeline."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_SPAN = _NoSpan()


class Timeline:
    """Collects `StepStats` per step, and spans when enabled.

    `keep_steps` bounds memory: only the last steps' records are kept (their stats always;
    the spans of all kept steps when enabled). `path`: where `write()` (called by the engine
    after every step when set) puts the Chrome trace of the kept steps.
    """

    def __init__(self, enabled: bool = False, path: Optional[str] = None, keep_steps: int = 8,
                 io_stats: Any = None) -> None:
        self.enabled = bool(enabled)
        if path is not None:
            path = os.path.abspath(path)  # a later chdir must not move it
            _check_writable(path)
        self.path = path
        self.keep_steps = max(1, int(keep_steps))
        self.steps: list[StepStats] = []
        self.current: Optional[StepStats] = None
        self._t0: Optional[float] = None
        self._lock = threading.Lock()
        self.io_stats = io_stats
        """The NVMe tiers' `IOStats` (or None): its `wait_s`, the seconds spent blocked on
        I/O so far, read at each step's start and end; `io_wait_s` is the difference."""
        self._io0 = 0.0

    # -- a step ------------------------------------------------------------------------------

    def begin_step(self, step: int) -> StepStats:
        """Open step `step` if none is open (idempotent within a step)."""
        if self.current is None:
            self.current = StepStats(step=step)
            self._t0 = now()
            self._io0 = self.io_stats.wait_s if self.io_stats is not None else 0.0
        return self.current

    def end_step(self) -> Optional[StepStats]:
        """Close the open step, keep it, and write the trace file if configured."""
        cur = self.current
        if cur is None:
            return None
        t0 = self._t0 if self._t0 is not None else now()
        cur.step_s = now() - t0
        if self.io_stats is not None:
            cur.io_wait_s = self.io_stats.wait_s - self._io0
        if self.enabled:
            cur.spans.append(Span("step", "step", "step", t0, t0 + cur.step_s))
        with self._lock:
            self.steps.append(cur)
            del self.steps[: -self.keep_steps]
        self.current = None
        if self.enabled and self.path:
            try:
                self.write(self.path)
            except OSError as exc:
                # The step's update is applied: a trace that cannot be written must not fail
                # it (every later step would raise too). Say so once and stop writing.
                logger.warning("timeline.path %s could not be written (%s); the trace is no "
                               "longer written, the steps' stats are still kept", self.path, exc)
                self.path = None
        return cur

    @property
    def last(self) -> Optional[StepStats]:
        return self.steps[-1] if self.steps else None

    # -- recording -----------------------------------------------------------------------

    def add(
        self, name: str, cat: str, track: str, start: float, end: float,
        unit: Optional[int] = None, **args: Any,
    ) -> None:
        """Record a span that already happened (no-op when disabled or outside a step)."""
        if not self.enabled:
            return
        cur = self.current
        if cur is None:
            return
        with self._lock:
            cur.spans.append(Span(name, cat, track, start, end, unit, args))

    def span(self, name: str, cat: str, track: str = "compute", unit: Optional[int] = None) -> Any:
        """Context manager recording a span around its body (a shared no-op when disabled)."""
        if not self.enabled or self.current is None:
            return _NO_SPAN
        return self._span(name, cat, track, unit)

    @contextlib.contextmanager
    def _span(self, name: str, cat: str, track: str, unit: Optional[int]) -> Iterator[None]:
        t0 = now()
        try:
            yield
        finally:
            self.add(name, cat, track, t0, now(), unit)

    def count(self, kind: str, seconds: float) -> None:
        """Add `seconds` to the open step's stall counter `kind` (see STALL_KINDS)."""
        cur = self.current
        if cur is not None:
            setattr(cur, kind + "_s", getattr(cur, kind + "_s") + seconds)

    # -- export ----------------------------------------------------------------------------

    def chrome_trace(self, steps: Optional[list[StepStats]] = None) -> dict[str, Any]:
        """The kept steps (or `steps`) as a Chrome trace-event dict: one process, one
        thread row per track, complete ('X') events in microseconds from the first span."""
        steps = self.steps if steps is None else steps
        spans = [s for st in steps for s in st.spans]
        if not spans:
            return {"traceEvents": [], "displayTimeUnit": "ms"}
        origin = min(s.start for s in spans)
        tracks: dict[str, int] = {}
        events: list[dict[str, Any]] = []
        for s in sorted(spans, key=lambda s: s.start):
            tid = tracks.setdefault(s.track, len(tracks) + 1)
            args = dict(s.args)
            if s.unit is not None:
                args["unit"] = s.unit
            events.append({
                "name": s.name, "cat": s.cat, "ph": "X", "pid": os.getpid(), "tid": tid,
                "ts": (s.start - origin) * 1e6, "dur": max(0.0, s.end - s.start) * 1e6,
                "args": args,
            })
        for name, tid in tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid,
                           "args": {"name": name}})
        for st in steps:
            events.append({
                "name": f"step {st.step}", "ph": "i", "s": "g", "pid": os.getpid(), "tid": 0,
                "ts": (min((s.start for s in st.spans), default=origin) - origin) * 1e6,
                "args": st.as_dict(),
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        """Write `chrome_trace()` to `path` atomically (a reader never sees half a file)."""
        data = json.dumps(self.chrome_trace())
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _check_writable(path: str) -> None:
    """At the door: the trace file's directory exists and takes a new file."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, f"timeline.path {path!r}: its directory {directory!r} does not exist; "
            "create it or point timeline.path elsewhere", path,
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=directory)
    except OSError as exc:
        raise type(exc)(exc.errno, f"timeline.path {path!r}: cannot create a file in {directory!r} "
                        f"({exc.strerror}); point timeline.path at a writable directory", path) from exc
    os.close(fd)
    os.unlink(probe)
